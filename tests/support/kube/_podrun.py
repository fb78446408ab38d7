"""The fake kubelet's pods: one worker per pod bound to its nodes, from images to the final DELETE.

A worker prepares the pod (image known, Secrets and ConfigMaps read, volumes set up,
environment resolved; while something is missing the containers wait with the reason a
kubelet reports: ErrImagePull, ImagePullBackOff, InvalidImageName, ContainerCreating,
CreateContainerConfigError), starts one process per container, restarts them as the
restart policy says, stops them when the pod is deleted (SIGTERM, SIGKILL after the
grace period), evicted or its node lost (SIGKILL), and writes every change of status
through ``pods/{name}/status``. With ``run_processes=False`` nothing is started: the pod
is Running at once and a deletion is finalized at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import shutil
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from stead.core.quantity import QuantityError, parse_quantity
from stead.core.tasks import TaskOwner
from tests.support.kube._client import KubeApiError, KubeClient
from tests.support.kube._podenv import (
    ConfigError,
    PodRefs,
    container_env,
    expand,
    image_name_problem,
    needed_refs,
    translate,
)
from tests.support.kube._runtime import (
    ContainerRun,
    LaunchPlan,
    StartError,
    exit_code,
    kill,
    log_tail,
    phase,
    start_process,
    tree_rss,
)
from tests.support.kube._scheduler import TERMINAL_PHASES
from tests.support.kube._store import now_rfc3339
from tests.support.kube._volumes import MountError, PodVolumes, container_mounts, prepare_volumes

__all__ = ["POD_IP", "PodRun", "PodRunner", "StopKind"]

log = structlog.get_logger("tests.support.kube.kubelet")

Obj = dict[str, Any]

#: the address every fake pod and node has
POD_IP = "127.0.0.1"
_TERMINAL = TERMINAL_PHASES


class StopKind(enum.Enum):
    """Why a pod's containers are stopped."""

    DELETE = "delete"  # deleted through the API: SIGTERM, SIGKILL after the grace period, then the final DELETE
    EVICT = "evict"  # evicted by the kubelet: SIGKILL, phase Failed with the eviction's reason
    NODE_LOST = "nodelost"  # its node failed: SIGKILL, phase Failed, reason NodeLost
    REMOVED = "removed"  # gone from the API (force-deleted): SIGKILL, nothing more to write


class _Waiting(Exception):
    """A pod that cannot start yet: the waiting reason and message of each container."""

    def __init__(self, states: Mapping[str, tuple[str, str]]) -> None:
        super().__init__(states)
        self.states = states


@dataclass
class PodRun:
    """What the kubelet knows of one pod bound to one of its nodes."""

    pod: Obj
    node: str
    containers: dict[str, ContainerRun]
    start_time: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    stop_kind: StopKind | None = None
    reason: str | None = None
    message: str | None = None
    removed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    started: bool = False  # the sandbox exists: podIP is set
    volumes: PodVolumes | None = None
    status_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_posted: str | None = None
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def uid(self) -> str:
        return str(self.pod["metadata"]["uid"])

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def restart_policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy", "Always"))

    def request_stop(self, kind: StopKind, reason: str | None = None, message: str | None = None) -> None:
        """Stop the pod for ``kind``; the first request wins (a removal is always noted)."""
        self.removed = self.removed or kind is StopKind.REMOVED
        if not self.stop.is_set():
            self.stop_kind, self.reason, self.message = kind, reason, message
            self.stop.set()


class PodRunner:
    """The workers of the pods bound to the kubelet's live nodes, by pod uid."""

    def __init__(self, client: KubeClient, tasks: TaskOwner, *, root: Path, shm: Path,
                 images: Mapping[str, Mapping[str, str]], run_processes: bool,
                 node_allocatable: Callable[[str], Mapping[str, str]], fail: Callable[[str, BaseException], None],
                 retry_s: float, restart_backoff_s: float, memory_poll_s: float,
                 node_env: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self._client, self._tasks, self._root, self._shm = client, tasks, root, shm
        #: node -> environment every container on that fake host starts with (what makes a host different)
        self.node_env = dict(node_env or {})
        self.images = images
        self.run_processes = run_processes
        self._node_allocatable, self._fail = node_allocatable, fail
        self._retry_s, self._restart_backoff_s, self._memory_poll_s = retry_s, restart_backoff_s, memory_poll_s
        self.runs: dict[str, PodRun] = {}

    def node_dir(self, node: str) -> Path:
        return self._root / node

    def node_shm(self, node: str) -> Path:
        return self._shm / node

    def pod_dir(self, run: PodRun) -> Path:
        return self.node_dir(run.node) / "pods" / run.uid

    def find(self, namespace: str, name: str) -> PodRun:
        for run in self.runs.values():
            if run.namespace == namespace and run.name == name and not run.removed:
                return run
        raise KeyError(f"pod {namespace}/{name} is not on any node of this fake kubelet (not bound yet, on another "
                       f"node, or deleted): wait until it is bound, e.g. with api.wait_for(...)")

    def pod_changed(self, pod: Obj, node: str) -> None:
        """A pod bound to ``node`` (one of ours, alive) was added or changed: start its worker, or pass the
        deletion on."""
        uid = pod["metadata"]["uid"]
        run = self.runs.get(uid)
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        if run is not None:
            run.pod = pod
            if deleting:
                run.request_stop(StopKind.DELETE)
            return
        if (pod.get("status") or {}).get("phase") in _TERMINAL:
            return  # ended before this kubelet knew it: nothing to run
        run = PodRun(pod=pod, node=node, start_time=now_rfc3339(),
                     containers={c["name"]: ContainerRun(c["name"], str(c.get("image", "")))
                                 for c in pod["spec"].get("containers") or []})
        self.runs[uid] = run
        if deleting:
            run.request_stop(StopKind.DELETE)
        meta = pod["metadata"]
        self._tasks.start(self._pod_worker, run, name=f"kubelet:pod:{meta['namespace']}/{meta['name']}")

    def pod_deleted(self, uid: str) -> None:
        """The pod is gone from the API: kill what runs (a force deletion) and forget it."""
        run = self.runs.get(uid)
        if run is not None:
            run.request_stop(StopKind.REMOVED)
            if run.done.is_set():
                self._forget(run)

    def _forget(self, run: PodRun) -> None:
        """The pod is gone from the API and its worker is done: drop it and its directory (logs stay)."""
        self.runs.pop(run.uid, None)
        shutil.rmtree(self.pod_dir(run), ignore_errors=True)

    async def oom(self, run: PodRun, container: ContainerRun) -> None:
        if not self.run_processes:
            if container.running:
                container.oom = True
                container.end(137, now_rfc3339())
                await self._post_status(run)
            return
        process = container.process
        if process is None:
            return
        container.oom = True
        log.info("container_oom_killed", pod=run.name, namespace=run.namespace, container=container.name)
        kill(process, signal.SIGKILL)
        await container.exited.wait()

    async def kill_all(self) -> None:
        """SIGKILL every container process and reap it (the kubelet is going away)."""
        for run in self.runs.values():
            for container in run.containers.values():
                process = container.process
                if process is not None:
                    kill(process, signal.SIGKILL)
                    with contextlib.suppress(ProcessLookupError):
                        await process.wait()

    async def _pod_worker(self, run: PodRun) -> None:
        try:
            if self.run_processes:
                await self._run_pod(run)
            else:
                await self._simulate_pod(run)
        except (KubeApiError, aiohttp.ClientError, OSError) as exc:
            log.warning("kubelet_pod_worker_stopped", pod=run.name, namespace=run.namespace, error=repr(exc))
        except Exception as exc:
            self._fail(f"running pod {run.namespace}/{run.name}", exc)
        finally:
            for container in run.containers.values():
                kill(container.process, signal.SIGKILL)
            self._remove_ephemeral(run)
            run.done.set()
            if run.removed:
                self._forget(run)

    async def _simulate_pod(self, run: PodRun) -> None:
        if not run.stop.is_set():
            run.started = True
            for container in run.containers.values():
                container.run(None, run.start_time)
            await self._post_status(run)
            await run.stop.wait()
        if run.stop_kind in (StopKind.EVICT, StopKind.NODE_LOST):
            for container in run.containers.values():
                if container.running:
                    container.end(137, now_rfc3339())
        await self._finish(run)

    async def _run_pod(self, run: PodRun) -> None:
        plans = await self._prepare(run)
        if plans is not None:
            async with asyncio.TaskGroup() as group:
                loops = [group.create_task(self._container_loop(run, plan)) for plan in plans]
                stopper = group.create_task(self._stopper(run))
                await asyncio.gather(*loops)
                stopper.cancel()
        await self._finish(run)

    async def _finish(self, run: PodRun) -> None:
        """After the last container ended: the terminal status, the volumes removed, and the final DELETE when the
        pod was deleted (a kubelet sends it only once the pod's resources are reclaimed)."""
        if run.removed:
            return
        if run.stop_kind is StopKind.DELETE:
            if run.started and self.run_processes:
                await self._post_status(run)
            self._remove_ephemeral(run)
            with contextlib.suppress(KubeApiError):  # 404: it is gone already; 409: a new pod of that name
                await self._client.delete(f"/api/v1/namespaces/{run.namespace}/pods/{run.name}",
                                          {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                                           "preconditions": {"uid": run.uid}})
            return
        await self._post_status(run)
        self._remove_ephemeral(run)

    async def _prepare(self, run: PodRun) -> list[LaunchPlan] | None:
        """Images, Secrets and ConfigMaps, volumes, environment; waits (reporting why) until all are there.
        None when the pod is stopped before it could start."""
        attempt = 0
        while not run.stop.is_set():
            try:
                return await self._plans(run, attempt)
            except _Waiting as waiting:
                for name, (reason, message) in waiting.states.items():
                    run.containers[name].wait(reason, message)
                await self._post_status(run)
            attempt += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._retry_s):
                    await run.stop.wait()
        return None

    async def _plans(self, run: PodRun, attempt: int) -> list[LaunchPlan]:
        pod, spec = run.pod, run.pod["spec"]
        containers = spec.get("containers") or []
        images: dict[str, tuple[str, str]] = {}
        for container in containers:
            image = str(container.get("image", ""))
            problem = image_name_problem(image)
            if problem is not None:
                images[container["name"]] = ("InvalidImageName", problem)
            elif self._image_env(image) is None:
                images[container["name"]] = (
                    "ErrImagePull" if attempt == 0 else "ImagePullBackOff",
                    f'Failed to pull image "{image}": the fake kubelet knows no image {image!r} (it knows '
                    f"{sorted(self.images)}); add it to FakeKubelet(images=...)" if attempt == 0 else
                    f'Back-off pulling image "{image}"')
        if images:
            raise _Waiting(images)
        try:
            refs = await self._fetch_refs(pod)
        except KubeApiError as exc:
            raise _Waiting({c["name"]: ("CreateContainerConfigError", exc.message) for c in containers}) from None
        pod_dir = self.pod_dir(run)
        try:
            run.volumes = prepare_volumes(pod, pod_dir=pod_dir, shm_dir=self.node_shm(run.node) / run.uid,
                                          pvc_root=self._root / "pvc", host_root=self.node_dir(run.node) / "host",
                                          refs=refs)
        except MountError as exc:
            raise _Waiting({c["name"]: ("ContainerCreating", str(exc)) for c in containers}) from None
        run.started = True
        plans, problems = [], {}
        for container in containers:
            try:
                plans.append(self._plan(run, container, refs))
            except ConfigError as exc:
                problems[container["name"]] = ("CreateContainerConfigError", str(exc))
        if problems:
            raise _Waiting(problems)
        return plans

    def _image_env(self, image: str) -> Mapping[str, str] | None:
        for candidate in (image, f"{image}:latest", image.removeprefix("docker.io/library/")):
            if candidate in self.images:
                return self.images[candidate]
        return None

    async def _fetch_refs(self, pod: Obj) -> PodRefs:
        namespace = pod["metadata"]["namespace"]
        secret_names, configmap_names = needed_refs(pod)
        secrets, configmaps = {}, {}
        for name in secret_names:
            secrets[name] = await self._get_or_none(f"/api/v1/namespaces/{namespace}/secrets/{name}")
        for name in configmap_names:
            configmaps[name] = await self._get_or_none(f"/api/v1/namespaces/{namespace}/configmaps/{name}")
        return PodRefs(secrets, configmaps)

    async def _get_or_none(self, path: str) -> Obj | None:
        try:
            result: Obj = await self._client.get(path)
            return result
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def _plan(self, run: PodRun, container: Obj, refs: PodRefs) -> LaunchPlan:
        name = container["name"]
        allocatable = self._node_allocatable(run.node)
        declared = container_env(container, run.pod, refs, node_name=run.node, pod_ip=POD_IP,
                                 api_host=self._client.host, api_port=self._client.port,
                                 node_allocatable=allocatable)
        command = [expand(str(part), declared) for part in container.get("command") or []]
        args = [expand(str(part), declared) for part in container.get("args") or []]
        if not command:
            raise ConfigError(f"the fake kubelet's images have no entrypoint: container {name!r} needs a command")
        assert run.volumes is not None
        mounts = container_mounts(container, run.volumes)
        home = self.pod_dir(run) / "containers" / name
        home.mkdir(parents=True, exist_ok=True)
        image_env = self._image_env(str(container["image"])) or {}
        # only what the pod declares is translated: the image's own variables are this machine's real paths
        env = {"HOME": str(home), **image_env, **self.node_env.get(run.node, {}), "HOSTNAME": run.name,
               **{key: translate(value, mounts) for key, value in declared.items()}}
        working_dir = container.get("workingDir")
        limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        try:
            memory_limit = int(parse_quantity(limit)) if limit is not None else None
        except QuantityError:
            memory_limit = None
        return LaunchPlan(
            name=name, argv=tuple(translate(part, mounts) for part in command + args), env=env,
            cwd=Path(translate(str(working_dir), mounts)) if working_dir else home,
            log_path=self.node_dir(run.node) / "logs" / f"{run.namespace}_{run.name}_{name}.log",
            memory_limit=memory_limit,
            message_from_logs=container.get("terminationMessagePolicy") == "FallbackToLogsOnError")

    async def _container_loop(self, run: PodRun, plan: LaunchPlan) -> None:
        container = run.containers[plan.name]
        while not run.stop.is_set():
            try:
                process = await start_process(plan)
            except StartError as exc:
                container.run(None, now_rfc3339())
                container.end(128, now_rfc3339(), str(exc), reason="StartError")
            else:
                container.run(process, now_rfc3339())
                container.memory_limit = plan.memory_limit
                await self._post_status(run)
                code = exit_code(await process.wait())
                message = log_tail(plan.log_path) if plan.message_from_logs and code != 0 else None
                container.end(code, now_rfc3339(), message)
                log.info("container_exited", namespace=run.namespace, pod=run.name, container=plan.name,
                         exit_code=code, reason=container.state["terminated"]["reason"])
            code = container.state["terminated"]["exitCode"]
            policy = run.restart_policy
            if run.stop.is_set() or policy == "Never" or (policy == "OnFailure" and code == 0):
                break
            backoff = min(self._restart_backoff_s * 2 ** container.restart_count, 10 * self._restart_backoff_s)
            container.last_state = container.state
            container.restart_count += 1
            container.wait("CrashLoopBackOff", f"back-off {backoff:g}s restarting failed container={plan.name} "
                                               f"pod={run.name}_{run.namespace}({run.uid})")
            await self._post_status(run)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await run.stop.wait()
        if not container.terminated and container.last_state:  # stopped during a back-off: the last run's end
            container.state, container.last_state = container.last_state, {}
        await self._post_status(run)

    async def _stopper(self, run: PodRun) -> None:
        """Stop the containers when the pod must stop: SIGTERM then SIGKILL after the grace period (deletion),
        SIGKILL at once (eviction, lost node, removed from the API)."""
        await run.stop.wait()
        if run.stop_kind is StopKind.DELETE:
            grace = float(run.pod["metadata"].get("deletionGracePeriodSeconds") or 0)
            for container in run.containers.values():
                kill(container.process, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    for container in run.containers.values():
                        if container.process is not None:
                            await container.exited.wait()
        for container in run.containers.values():
            kill(container.process, signal.SIGKILL)

    async def memory_monitor(self) -> None:
        """OOM-kill a container whose process tree uses more than its ``limits.memory``."""
        while True:
            await asyncio.sleep(self._memory_poll_s)
            for run in list(self.runs.values()):
                for container in run.containers.values():
                    limit = container.memory_limit
                    process = container.process
                    if limit is None or process is None or process.returncode is not None or container.oom:
                        continue
                    if tree_rss(process.pid) > limit:
                        container.oom = True
                        log.info("container_over_memory_limit", pod=run.name, container=container.name,
                                 limit_bytes=limit)
                        kill(process, signal.SIGKILL)

    def _remove_ephemeral(self, run: PodRun) -> None:
        if run.volumes is not None:
            for path in run.volumes.ephemeral:
                shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(self.node_shm(run.node) / run.uid, ignore_errors=True)

    # ----- status

    def _status(self, run: PodRun) -> Obj:
        containers = list(run.containers.values())
        pod_phase = "Failed" if run.stop_kind in (StopKind.EVICT, StopKind.NODE_LOST) else phase(containers)
        ready = all(c.running for c in containers) and pod_phase == "Running"
        terminal = pod_phase in _TERMINAL
        managed = {
            "PodReadyToStartContainers": "True" if run.started and not terminal else "False",
            "Initialized": "True",
            "ContainersReady": "True" if ready else "False",
            "Ready": "True" if ready else "False",
        }
        if run.stop_kind is StopKind.EVICT:
            managed["DisruptionTarget"] = "True"
        conditions = [c for c in (run.pod.get("status") or {}).get("conditions") or [] if c.get("type") not in managed]
        for kind, value in managed.items():
            previous = run.transitions.get(kind)
            if previous is None or previous[0] != value:
                run.transitions[kind] = (value, now_rfc3339())
            condition: Obj = {"type": kind, "status": value, "lastProbeTime": None,
                              "lastTransitionTime": run.transitions[kind][1]}
            if kind in ("Ready", "ContainersReady") and value == "False":
                condition["reason"] = "PodCompleted" if terminal else "ContainersNotReady"
                if not terminal:
                    waiting = [c.name for c in containers if not c.running]
                    condition["message"] = f"containers with unready status: [{' '.join(waiting)}]"
            if kind == "DisruptionTarget":
                condition.update(reason="TerminationByKubelet", message=run.message)
            conditions.append(condition)
        status: Obj = {
            "phase": pod_phase, "conditions": conditions, "hostIP": POD_IP, "hostIPs": [{"ip": POD_IP}],
            "podIP": POD_IP if run.started else None, "podIPs": [{"ip": POD_IP}] if run.started else None,
            "startTime": run.start_time, "containerStatuses": [c.status() for c in containers],
            "reason": run.reason if run.stop_kind in (StopKind.EVICT, StopKind.NODE_LOST) else None,
            "message": run.message if run.stop_kind in (StopKind.EVICT, StopKind.NODE_LOST) else None,
        }
        return status

    async def _post_status(self, run: PodRun) -> None:
        async with run.status_lock:
            if run.removed:
                return
            status = self._status(run)
            fingerprint = json.dumps(status, sort_keys=True)
            if fingerprint == run.last_posted:
                return
            try:
                await self._client.patch(f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status",
                                         {"status": status})
            except KubeApiError as exc:
                if exc.status == 404:
                    run.removed = True
                else:  # a real kubelet retries at its next sync; the next change of this pod will
                    log.warning("pod_status_refused", namespace=run.namespace, pod=run.name, error=str(exc))
                return
            except (aiohttp.ClientError, OSError) as exc:
                log.warning("pod_status_not_written", namespace=run.namespace, pod=run.name, error=repr(exc))
                return
            run.last_posted = fingerprint

    def log_source(self, namespace: str, name: str, container: str) -> tuple[Path, Callable[[], bool]] | str:
        try:
            run = self.find(namespace, name)
        except KeyError as exc:
            return str(exc)
        target = run.containers.get(container)
        if target is None:
            return f"container {container} is not valid for pod {name}"
        if not target.container_id:
            reason = target.state.get("waiting", {}).get("reason", "ContainerCreating")
            return f'container "{container}" in pod "{name}" is waiting to start: {reason}'
        path = self.node_dir(run.node) / "logs" / f"{namespace}_{name}_{container}.log"
        return path, lambda: target.process is not None
