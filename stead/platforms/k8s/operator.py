"""The operator (``stead k8s operator``): a SteadJob resource becomes a running job, written with kopf.

For each ``SteadJob`` it makes what ``stead run --platform k8s`` makes from a
laptop (:mod:`.jobs`: the token Secret, the master's Service, the job's
NetworkPolicy, the master pod), owned by the SteadJob so that deleting the job
garbage-collects all of it. It does not manage node pods: the master does. It

- starts a new master pod when the running one is deleted or evicted before the
  job ended (the new master replays the job's log and adopts the node pods);
- mirrors the job into ``status``: the phase, round, step, restarts, nodes and
  goodput, read from the job's store every ``status_interval_s``, and the end
  from the master pod's exit;
- suspends (``spec.suspend: true``: every pod of the job deleted with its grace
  period, so agents persist their checkpoints; the store is kept) and resumes.

Its kopf registry is built by :func:`registry`; :func:`run` runs it in this
event loop (``kopf.testing.KopfRunner`` runs the same registry in tests).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import kopf
import structlog

from stead.core.config import Settings, load_settings
from stead.core.entrypoints import installed
from stead.core.errors import ConfigError, PlatformError, SteadError
from stead.core.events.log import EventLog
from stead.core.plugins import GROUP as PLUGIN_GROUP
from stead.core.statemachine import JobPhase, fold_all
from stead.core.store import open_store
from stead.core.views.goodput import ledger
from stead.platforms.k8s import names
from stead.platforms.k8s._client import PODS, Kube, warn_insecure
from stead.platforms.k8s.jobs import MasterSpec, create_job_objects, master_pods, start_master
from stead.platforms.k8s.manifests import check_job_name, default_image
from stead.platforms.k8s.pods import Owner, passed_env
from stead.platforms.k8s.policy import OPERATOR_FIELDS, check_allowed, check_run_args, check_store
from stead.platforms.k8s.settings import K8sSettings

__all__ = ["master_spec", "registry", "run"]

log = structlog.get_logger("stead.k8s.operator")

JsonObject = dict[str, Any]

#: how often a running job's status is read from its store
STATUS_INTERVAL_S = 5.0
_TERMINAL = ("Succeeded", "Failed", "Stopped")
#: the k8s settings of a job's pods that are the operator's to say (a SteadJob has no field for them)
_FROM_OPERATOR = ("pod_api_url", "insecure_skip_tls_verify", "master_host", "master_port", "create_concurrency",
                  "pending_timeout_s", "bad_host_expiry_s", "cordon_bad_hosts", "watch_timeout_s", "request_timeout_s",
                  "working_dir", "run_as_user", "read_only_root_fs", "metrics_port", "metrics_token_secret",
                  "etcd_client_secret", "etcd_user", "etcd_auth_secret", "node_egress_cidrs")
_PHASES = {JobPhase.NEW: "Pending", JobPhase.STARTING: "Pending", JobPhase.RUNNING: "Running",
           JobPhase.RECOVERING: "Recovering", JobPhase.SUCCEEDED: "Succeeded", JobPhase.FAILED: "Failed",
           JobPhase.STOPPED: "Stopped"}


def master_spec(name: str, spec: Mapping[str, Any], base: K8sSettings) -> MasterSpec:
    """The master a SteadJob's spec describes: its `stead run` arguments and the k8s settings of its pods."""
    args: list[str] = ["--nnodes", str(spec.get("nnodes", "1")), "--nproc-per-node", str(spec.get("nprocPerNode", 1)),
                       "--max-restarts", str(spec.get("maxRestarts", 3))]
    if spec.get("maxNodeRelaunches") is not None:
        args += ["--max-node-relaunches", str(spec["maxNodeRelaunches"])]
    if spec.get("startNodes") is not None:
        args += ["--start-nodes", str(spec["startNodes"])]
    for key, value in sorted((spec.get("settings") or {}).items()):
        args.append(f"--set={key}={value}")
    args += [str(a) for a in spec.get("runArgs") or []]
    if spec.get("module"):
        args.append("--module")
    command = [str(c) for c in spec.get("command") or []]
    if not command:
        raise kopf.PermanentError(f"SteadJob {name}: spec.command is empty; give the training script and its "
                                  "arguments, e.g. [train.py, --epochs, '3']")
    resources = spec.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    volume = spec.get("checkpointVolume") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted((spec.get("nodeSelector") or {}).items()))
    import json

    store = str(spec.get("store", ""))
    if store:
        check_store(store)
    settings = K8sSettings(**{
        **{f: getattr(base, f) for f in _FROM_OPERATOR},
        "namespace": base.namespace, "api_url": base.api_url, "master_image": base.master_image or default_image(),
        "image": str(spec.get("image", "")), "image_pull_policy": str(spec.get("imagePullPolicy", "IfNotPresent")),
        "service_account": str(spec.get("serviceAccountName") or ""),
        "cpu": str(limits.get("cpu") or requests.get("cpu") or ""),
        "memory": str(limits.get("memory") or requests.get("memory") or ""),
        "gpus": int(limits.get("nvidia.com/gpu") or requests.get("nvidia.com/gpu") or 0),
        "shm_size": str(spec.get("shmSize") or "1Gi"),
        "checkpoint_claim": str(volume.get("claimName") or ""),
        "checkpoint_mount": str(volume.get("mountPath") or "/stead/checkpoints"),
        "grace_period_s": int(spec.get("terminationGracePeriodSeconds") or 60),
        "ptrace": bool(spec.get("ptrace")), "node_selector": selector,
        "tolerations": json.dumps(spec["tolerations"]) if spec.get("tolerations") else "",
        "env": json.dumps(spec["env"]) if spec.get("env") else "",
    })
    env = passed_env(os.environ, Settings(), installed(PLUGIN_GROUP))
    return MasterSpec(job=name, store_url=store, run_args=(*args, *command), settings=settings,
                      env=tuple(sorted(env.items())))


def registry(base: K8sSettings | None = None, *, status_interval_s: float = STATUS_INTERVAL_S) -> kopf.OperatorRegistry:
    """The operator's handlers, on a registry of their own; a running job's status is read from its store every
    ``status_interval_s``."""
    base = base or load_settings(K8sSettings, "k8s")
    found = kopf.OperatorRegistry()
    on = {"group": names.API_GROUP, "version": names.API_VERSION, "plural": names.JOB_PLURAL, "registry": found}

    @kopf.on.startup(registry=found)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # no watch of CustomResourceDefinitions or Namespaces (cluster-wide objects): a namespaced operator then
        # needs a Role only; the CRD is applied before the operator starts (a CRD applied later: restart it)
        settings.scanning.disabled = True

    @kopf.on.login(registry=found)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if base.api_url:  # verified against api_ca_file (or the system's CAs) unless a setting says otherwise
            if base.insecure_skip_tls_verify:
                warn_insecure(base)
            return kopf.ConnectionInfo(server=base.api_url, ca_path=base.api_ca_file or None,
                                       insecure=base.insecure_skip_tls_verify)
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.resume(**on)  # type: ignore[arg-type]
    @kopf.on.create(**on)  # type: ignore[arg-type]
    async def job_created(spec: Mapping[str, Any], status: Mapping[str, Any], patch: kopf.Patch, body: kopf.Body,
                          **_: Any) -> None:
        if status.get("phase") in _TERMINAL:
            return
        if spec.get("suspend"):
            patch.status["phase"] = "Suspended"
            return
        await _start(base, body, patch, {"phase": status.get("phase") or "Pending",
                                         "startTime": status.get("startTime") or _now()})

    @kopf.on.field(field="spec.suspend", **on)  # type: ignore[arg-type]
    async def suspend_changed(name: str, namespace: str, new: Any, status: Mapping[str, Any], patch: kopf.Patch,
                              body: kopf.Body, **_: Any) -> None:
        if status.get("phase") in _TERMINAL:
            return
        if new:
            await _delete_pods(base, name, namespace)
            patch.status.update({"phase": "Suspended", "message": "suspended: its pods were stopped; set "
                                                                  "spec.suspend to false to resume it"})
        else:
            await _start(base, body, patch, {"phase": "Pending", "message": "resumed"})

    @kopf.on.event("", "v1", "pods", labels={names.LABEL_ROLE: names.ROLE_MASTER},  # type: ignore[arg-type]
                   registry=found)
    async def master_pod_changed(type: str, body: Mapping[str, Any], namespace: str, **_: Any) -> None:
        job = (body.get("metadata", {}).get("labels") or {}).get(names.LABEL_JOB)
        if not job:
            return
        async with Kube(_in(base, namespace), pool=4) as kube:
            from stead.platforms.k8s._client import JOBS

            resource = await kube.get(JOBS, job)
            if resource is None:
                return  # a job run without the CRD (`stead run --platform k8s`): its launcher looks after it
            status = resource.get("status") or {}
            if status.get("phase") in _TERMINAL or (resource.get("spec") or {}).get("suspend"):
                return
            phase = (body.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):
                code = _exit_code(body)
                await kube.patch(JOBS, job, {"status": {
                    "phase": "Succeeded" if code == 0 else status.get("phase") if status.get("phase") in _TERMINAL
                    else "Failed", "completionTime": _now(),
                    "message": f"the master exited with code {code}"}}, subresource="status")
                return
            if type == "DELETED" or body.get("metadata", {}).get("deletionTimestamp"):
                try:
                    master = await _ensure_master(base, job, namespace, resource["metadata"]["uid"],
                                                  resource.get("spec") or {}, after=status.get("master"),
                                                  check=_unchecked(resource, status))
                except ConfigError as exc:  # its spec changed to one refused: no new master, its nodes stopped
                    await _delete_pods(base, job, namespace)
                    _refusal_event(kopf.Body(cast(kopf.RawBody, resource)), exc)
                    await kube.patch(JOBS, job, {"status": {"phase": "Failed", "message": _refusal(exc),
                                                            "completionTime": _now()}}, subresource="status")
                    return
                if master != status.get("master"):
                    log.warning("k8s_master_replaced", job=job, gone=body["metadata"]["name"], new=master)
                    await kube.patch(JOBS, job, {"status": {"master": master, **_checked(resource), "message":
                                     f"master pod {body['metadata']['name']} was deleted; {master} took the job "
                                     "over"}}, subresource="status")

    @kopf.timer(interval=status_interval_s, **on)  # type: ignore[arg-type]
    async def mirror_status(name: str, spec: Mapping[str, Any], status: Mapping[str, Any], patch: kopf.Patch,
                            **_: Any) -> None:
        if status.get("phase") in (*_TERMINAL, "Suspended") or spec.get("suspend") or not spec.get("store"):
            return
        try:
            check_store(str(spec["store"]))  # the store is opened with the operator's own credentials
            patch.status.update(await _read_status(name, str(spec["store"])))
        except SteadError as exc:
            log.warning("k8s_status_unreadable", job=name, error=str(exc))

    return found


async def run(base: K8sSettings, *, namespaces: Sequence[str] = (), liveness: str | None = None,
              stop: asyncio.Event | None = None) -> None:
    """Run the operator in this event loop until ``stop`` is set (or forever): every namespace when
    ``namespaces`` is empty."""
    await kopf.operator(registry=registry(base), standalone=True, clusterwide=not namespaces,
                        namespaces=list(namespaces), liveness_endpoint=liveness, stop_flag=stop)


async def _ensure_master(base: K8sSettings, job: str, namespace: str, uid: str, spec: Mapping[str, Any], *,
                         after: object = None, check: bool = True) -> str:
    """The running master pod of the job, made (with the job's objects) when there is none; a new one is numbered
    after every earlier one (``after``: the last the job's status names, which may be gone).

    ``check``: whether what the spec asks for is checked against what the operator allows (:mod:`.policy`); not
    for a spec that already has a master, so that a stricter configuration, or an operator restart, never fails a
    job that runs (its master was allowed when it was made).
    """
    check_job_name(job)
    settings = _in(base, namespace)
    wanted = master_spec(job, spec, settings)
    if check:
        check_run_args(spec.get("settings") or {}, [str(a) for a in spec.get("runArgs") or []])
        check_allowed(wanted.settings, base, fields=OPERATOR_FIELDS, who="the operator", job=job)
    async with Kube(settings, pool=4) as kube:
        owner = Owner(f"{names.API_GROUP}/{names.API_VERSION}", names.JOB_KIND, job, uid)
        objects = await create_job_objects(kube, wanted, owner=owner)
        masters = await master_pods(kube, job)
        if masters.running:
            return masters.running[-1]
        suffix = str(after).rsplit("-", 1)[-1] if after else ""
        last = max(masters.last_index, int(suffix) if suffix.isdigit() else 0)
        return await start_master(kube, wanted, objects, index=last + 1)


async def _start(base: K8sSettings, body: kopf.Body, patch: kopf.Patch, status: Mapping[str, Any]) -> None:
    """Make sure the job has a master (:func:`_ensure_master`) and patch ``status`` and its master's name onto its
    status; a job the operator refuses is Failed instead (:func:`_refused`)."""
    meta, before = body["metadata"], body.get("status") or {}
    try:
        master = await _ensure_master(base, meta["name"], meta["namespace"], meta["uid"], body.get("spec") or {},
                                      after=before.get("master"), check=_unchecked(body, before))
    except ConfigError as exc:
        _refused(body, patch, exc)
        return
    patch.status.update({**status, "master": master, **_checked(body)})


async def _delete_pods(base: K8sSettings, job: str, namespace: str) -> None:
    async with Kube(_in(base, namespace), pool=8) as kube:
        items, _ = await kube.list(PODS, label_selector=f"{names.LABEL_JOB}={job}")
        for pod in items:
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                try:
                    await kube.delete(PODS, pod["metadata"]["name"])
                except PlatformError as exc:
                    log.warning("k8s_pod_delete_failed", pod=pod["metadata"]["name"], error=str(exc))


async def _read_status(job: str, store_url: str) -> dict[str, Any]:
    """The job's status fields, folded from its event log."""
    store = await open_store(store_url, settings=Settings.from_env())  # the store's TLS and auth: STEAD_ETCD_*
    try:
        items = await EventLog(store, job).scan()
    finally:
        await store.close()
    records = [item for item in items if hasattr(item, "event")]
    state = fold_all(records)  # type: ignore[arg-type]
    book = ledger(items, now=time.time())
    alive = sum(1 for node in state.nodes.values() if node.phase.alive)
    found: dict[str, Any] = {"phase": _PHASES.get(state.phase, "Pending"), "round": state.rdzv.round,
                             "restarts": state.restarts, "nodes": alive, "goodput": round(book.goodput, 4)}
    if state.spec is not None:
        found["targetNodes"] = state.target or state.spec.start_nodes or state.spec.max_nodes
    if state.step is not None:
        found["step"] = state.step
    if state.phase.terminal:
        found["completionTime"] = _now()
        found["message"] = state.reason
    return found


def _unchecked(job: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether the job's spec is yet to be checked against what the operator allows: it has no master yet, or its
    spec changed since it was checked (a job made before the operator recorded ``observedGeneration`` was
    checked by the operator that made its master)."""
    checked = status.get("observedGeneration")
    return not status.get("master") or (checked is not None and checked != _generation(job))


def _checked(job: Mapping[str, Any]) -> dict[str, Any]:
    """The status field that records the spec generation the operator checked and runs."""
    generation = _generation(job)
    return {} if generation is None else {"observedGeneration": generation}


def _generation(job: Mapping[str, Any]) -> int | None:
    generation = (job.get("metadata") or {}).get("generation")
    return int(generation) if generation is not None else None


def _refusal(exc: ConfigError) -> str:
    return (f"{exc}; a refused job stays Failed: fix its spec, then delete it and create it again "
            "(kubectl delete steadjob NAME, then kubectl apply)")


def _refusal_event(job: kopf.Body, exc: ConfigError) -> None:
    log.warning("k8s_job_refused", job=job.get("metadata", {}).get("name"), reason=str(exc))
    kopf.warn(job, reason="Refused", message=_refusal(exc))


def _refused(body: kopf.Body, patch: kopf.Patch, exc: ConfigError) -> None:
    """A job the operator cannot run as its spec says (it asks for more than the operator allows, or names what
    is not its own): Failed, with the reason on its status and an event."""
    _refusal_event(body, exc)
    patch.status.update({"phase": "Failed", "message": _refusal(exc), "completionTime": _now()})


def _in(base: K8sSettings, namespace: str) -> K8sSettings:
    import dataclasses

    return dataclasses.replace(base, namespace=namespace)


def _exit_code(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            return int(terminated.get("exitCode", 1))
    return 0 if (pod.get("status") or {}).get("phase") == "Succeeded" else 1


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
