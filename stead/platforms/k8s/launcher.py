"""``stead run --platform k8s``: run a job on a cluster from a laptop, without the SteadJob CRD.

It makes the job's objects (token Secret, master Service, NetworkPolicy) and a
master pod running ``stead master --platform k8s -- <the same run arguments>``,
which creates and relaunches the node pods. Then it follows the master pod until
the job ends, saying what it waits for, and starts a new master pod when the
running one is deleted before the job ended (the new master adopts the node
pods, none is recreated). Its exit code is the job's, as with ``stead run`` on
the local platform. Ctrl-C stops following; the job goes on in the cluster.

Bad input is one line before anything is made (no image, a store the pods
cannot share, an unreachable API server, missing RBAC): see :mod:`.jobs`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import anyio
import structlog

from stead.core.config import load_settings
from stead.core.errors import ConfigError, PlatformRejected, PlatformUnavailable, SteadError
from stead.core.platform import NodeSpec
from stead.core.plugins import GROUP as PLUGIN_GROUP
from stead.core.runspec import RunConfig
from stead.platforms.k8s import names
from stead.platforms.k8s._client import JOBS, PODS, SECRETS, Kube
from stead.platforms.k8s.jobs import MasterSpec, check_store, create_job_objects, master_pods, start_master
from stead.platforms.k8s.manifests import check_job_name
from stead.platforms.k8s.pods import JobObjects, master_pod, node_pod, passed_env
from stead.platforms.k8s.policy import check_allowed
from stead.platforms.k8s.settings import K8sSettings
from stead.platforms.k8s.status import cannot_start, parse_time

__all__ = ["launch_job", "run_arguments"]

log = structlog.get_logger("stead.k8s")

#: `stead run` flags (with a value) that the master pod gets its own of, from the launcher's
_PINNED = ("--platform", "--store", "--job-name")
#: how often the launcher says what the master pod is waiting for
_PROGRESS_S = 10.0


def run_arguments(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` without the flags the master pod is given anew (platform, store, job name) and without its k8s
    settings: :meth:`MasterSpec.master_args` gives the master each one as this command resolved it (the settings
    that only mean something on this machine, its kubeconfig and API URL, left out), and a k8s setting given
    twice is refused."""
    kept: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in _PINNED:
            skip = "=" not in arg
            continue
        if arg == "--set" and i + 1 < len(argv) and _k8s_setting(argv[i + 1]):
            skip = True
            continue
        if arg.startswith("--set=") and _k8s_setting(arg[len("--set="):]):
            continue
        kept.append(arg)
    return tuple(kept)


def _k8s_setting(item: str) -> bool:
    return item.split("=", 1)[0].strip().startswith("k8s.")


async def launch_job(config: RunConfig, argv: Sequence[str]) -> int:
    """Run the job on the cluster and follow it; the job's exit code (0 succeeded, 1 failed, 130 interrupted)."""
    k8s = load_settings(K8sSettings, "k8s", config.settings)
    try:
        if not k8s.image:
            raise ConfigError("--platform k8s needs the container image its pods run (stead and the training script "
                              "installed): --set k8s.image=IMAGE")
        check_store(config.store_url)
        check_job_name(config.job_name)
        _check_pods(config.job_name, k8s)
        from stead.core.entrypoints import installed

        spec = MasterSpec(job=config.job_name, store_url=config.store_url, run_args=run_arguments(argv), settings=k8s,
                          env=tuple(sorted(passed_env(os.environ, config.settings, installed(PLUGIN_GROUP)).items())),
                          log_format=config.log_format)
        async with Kube(k8s, pool=8) as kube:
            return await _run(kube, spec)
    except ConfigError as exc:
        print(f"stead run: error: {exc}", file=sys.stderr)
        return 2
    except SteadError as exc:
        print(f"stead run: error: {exc}", file=sys.stderr)
        return 1


async def _run(kube: Kube, spec: MasterSpec) -> int:
    job = spec.job
    if await kube.get(JOBS, job) is not None:
        raise ConfigError(f"job {job!r} is a SteadJob resource in namespace {kube.namespace}: its operator runs it; "
                          f"`kubectl get steadjob {job}` shows it (or choose another --job-name)")
    fresh = await kube.get(SECRETS, names.secret_name(job)) is None
    objects = await create_job_objects(kube, spec)
    masters = await master_pods(kube, job)
    if masters.running:
        print(f"stead: job {job} already runs in namespace {kube.namespace} (master pod {masters.running[-1]}); "
              "following it", file=sys.stderr)
        current = masters.running[-1]
    else:
        try:
            current = await start_master(kube, spec, objects, index=masters.last_index + 1)
        except BaseException:
            if fresh:  # nothing half-made: the Secret made just now owns the Service and NetworkPolicy
                with anyio.CancelScope(shield=True):
                    await kube.delete(SECRETS, names.secret_name(job), grace_period_s=0)
            raise
        print(f"stead: job {job} submitted to namespace {kube.namespace}: master pod {current}, image "
              f"{spec.settings.image}", file=sys.stderr)
    return await _follow(kube, spec, objects, current)


async def _follow(kube: Kube, spec: MasterSpec, objects: JobObjects, current: str) -> int:
    """Follow the master pod until the job ends; a master pod deleted meanwhile is replaced."""
    job = spec.job
    said = ""
    last_progress = anyio.current_time()
    index = int(current.rsplit("-", 1)[-1])
    while True:
        try:
            pod = await kube.get(PODS, current)
        except PlatformUnavailable as exc:
            log.warning("k8s_api_unreachable", error=str(exc), action="retrying")
            await anyio.sleep(1.0)
            continue
        if pod is None or (pod["metadata"].get("deletionTimestamp") and not _ended(pod)):
            masters = await master_pods(kube, job)
            if masters.running and masters.running[-1] != current:
                current = masters.running[-1]  # someone else (the operator, another launcher) made one
                continue
            index = max(index, masters.last_index) + 1
            gone = current
            current = await start_master(kube, spec, objects, index=index)
            print(f"stead: master pod {gone} was deleted; started {current} (it takes the job over: running nodes "
                  "are adopted, none restarted)", file=sys.stderr)
            continue
        phase = (pod.get("status") or {}).get("phase", "Pending")
        found = cannot_start(pod)
        if found:
            await kube.delete(SECRETS, names.secret_name(job), grace_period_s=0)  # its objects go with it
            raise PlatformRejected(f"the master pod {current} cannot start: {found}; fix k8s.image (or the pod's "
                                   "configuration) and run again (nothing of the job is left on the cluster)")
        ended = _ended(pod)
        if ended is not None:
            code, how = ended
            print(f"stead: job {job} {'succeeded' if code == 0 else 'failed'} (master pod {current}: {how}); "
                  f"`stead status --job {job} --store {spec.store_url}` shows it", file=sys.stderr)
            return 0 if code == 0 else 1
        now = anyio.current_time()
        line = f"master pod {current}: {phase}{_why(pod)}"
        if line != said or now - last_progress >= _PROGRESS_S:
            print(f"stead: {line}", file=sys.stderr)
            said, last_progress = line, now
        await anyio.sleep(0.5)


def _check_pods(job: str, k8s: K8sSettings) -> None:
    """The pods the job will ask for, built once here: a setting Kubernetes would refuse (a quantity, a node
    selector, the JSON of env or tolerations), or one that escalates without its ``allowed_*`` beside it
    (:mod:`.policy`), is said now, before anything is made on the cluster."""
    check_allowed(k8s, k8s, who="this command", job=job)
    objects = JobObjects(job=job, namespace=k8s.namespace or "default", master_address="check:1")
    node_pod(NodeSpec(job=job, node_id="node-0", incarnation=1, command=("python", "-m", "stead", "agent")), objects,
             k8s)
    master_pod(objects, k8s, name=f"{job}-master-1", store_url="etcd://check:1", run_args=())


def _ended(pod: dict[str, object]) -> tuple[int, str] | None:
    status = pod.get("status")
    if not isinstance(status, dict) or status.get("phase") not in ("Succeeded", "Failed"):
        return None
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            code = int(terminated.get("exitCode", 1))
            return code, f"exit code {code}" + (f", {terminated['reason']}" if terminated.get("reason") else "")
    return (0, "Succeeded") if status.get("phase") == "Succeeded" else (1, str(status.get("reason") or "Failed"))


def _why(pod: dict[str, object]) -> str:
    status = pod.get("status")
    if not isinstance(status, dict):
        return ""
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            return f" ({waiting['reason']}: {waiting.get('message', '')})"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f" ({condition.get('reason')}: {condition.get('message', '')})"
    if status.get("phase") == "Running":
        spec = pod.get("spec")
        host = spec.get("nodeName", "") if isinstance(spec, dict) else ""
        started = parse_time(status.get("startTime"))
        return f" on {host}" + (" (the job trains; its events: stead events --follow)" if started else "")
    return ""

