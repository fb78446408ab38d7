"""A fake kubelet (and scheduler) that runs each pod's containers as local processes.

:class:`FakeKubelet` is a client of the API server like a real kubelet: it registers a
Node per fake node, watches pods (list, then watch from the list's version, re-list on
410), binds each unscheduled pod to a node that fits (:mod:`._scheduling`), and runs the
pods bound to its nodes: images checked against ``images``, environment resolved from
Secrets, ConfigMaps and the downward API, volumes set up, containers started as
processes, status written through ``pods/{name}/status`` as a kubelet writes it, and
graceful deletion (SIGTERM, SIGKILL after the grace period, then the final DELETE with
``gracePeriodSeconds=0``). Faults come on demand: OOM kills, evictions, lost nodes.

**How a fake node mounts without a mount namespace.** All fake nodes share this
machine's filesystem, so each volume is a host directory (see :mod:`._volumes`) and the
container's paths are translated instead of mounted: every environment value the pod
declares (``env``, ``envFrom``), every command and argument (after ``$(VAR)`` expansion)
and ``workingDir`` that equals a container's ``volumeMounts[].mountPath`` or starts with
``mountPath + "/"`` is rewritten to the volume's host directory, the longest mount path
first. The image's own environment is not translated (it holds this machine's real
paths). A path a program builds itself, or one embedded inside a longer string
(``--dir=/data``), is not translated: pass paths to pods as whole values, and choose
mount paths that no real path of this machine starts with (a mount at ``/tmp`` is
never translated: see :mod:`._volumes`). A container's default working directory
(and ``HOME``, unless the image sets one) is a directory of its own under the pod's
directory.

Layout under ``root``: ``<node>/pods/<pod uid>/`` (emptyDirs, secret and configMap
files, working directories), ``<node>/logs/<namespace>_<pod>_<container>.log`` (stdout
and stderr), ``<node>/host/`` (hostPath volumes), ``pvc/<namespace>/<claim>/`` (shared by
all nodes); memory emptyDirs live under a directory of the kubelet's own in /dev/shm.
Everything it made is removed, and every process it started killed and reaped, on exit.

``run=False`` starts nothing: bound pods are marked Running at once and deletions are
finalized at once, for benchmarks of what sits above the kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import structlog

from stead.core.tasks import TaskOwner
from tests.support.kube._client import KubeApiError, KubeClient
from tests.support.kube._logs import LogEndpoint
from tests.support.kube._podenv import local_image_env
from tests.support.kube._podrun import POD_IP, PodRunner, StopKind
from tests.support.kube._scheduler import FakeScheduler
from tests.support.kube._store import now_rfc3339

__all__ = ["FakeKubelet", "local_image_env"]

log = structlog.get_logger("tests.support.kube.kubelet")

Obj = dict[str, Any]

#: the NoSchedule/NoExecute taints the node lifecycle controller puts on a node that stopped reporting
_UNREACHABLE_TAINTS = [{"key": "node.kubernetes.io/unreachable", "effect": effect} for effect in
                       ("NoSchedule", "NoExecute")]


class FakeKubelet:
    """``async with FakeKubelet(api.url, root=tmp_path, images={...}) as kubelet:`` schedules and runs pods.

    ``images`` maps an image name to the environment its containers start with (see :func:`local_image_env`);
    ``max_pods_per_node`` is each node's pod capacity; ``enforce_memory_limits`` OOM-kills a container whose
    process tree outgrows its ``limits.memory``; ``run=False`` runs nothing (see the module docstring).
    ``root`` (a temporary directory by default) holds the nodes' directories. ``node_env`` gives the containers
    of a fake host more environment (what makes that host different: a fault a test injects there).
    """

    def __init__(self, api_url: str, *, nodes: Sequence[str] = ("host-a", "host-b", "host-c"),
                 root: str | Path | None = None, images: Mapping[str, Mapping[str, str]] | None = None,
                 run: bool = True, max_pods_per_node: int = 110, enforce_memory_limits: bool = True,
                 node_cpu: str = "64", node_memory: str = "256Gi", token: str | None = None,
                 memory_poll_s: float = 0.2, retry_s: float = 0.5, restart_backoff_s: float = 0.2,
                 node_env: Mapping[str, Mapping[str, str]] | None = None) -> None:
        if not nodes or len(set(nodes)) != len(nodes):
            raise ValueError(f"FakeKubelet needs one or more distinct node names, got {list(nodes)}")
        self.nodes = tuple(nodes)
        self.images: dict[str, Mapping[str, str]] = dict(images or {})
        self.run_processes = run
        self.enforce_memory_limits = enforce_memory_limits
        self._client = KubeClient(api_url, token=token)
        self._max_pods = dict.fromkeys(self.nodes, max_pods_per_node)
        self._node_cpu, self._node_memory = node_cpu, node_memory
        self._memory_poll_s, self._retry_s, self._restart_backoff_s = memory_poll_s, retry_s, restart_backoff_s
        #: node -> environment every container on that fake host gets (a faulty GPU, say, as a test injects it)
        self.node_env = {node: dict(env) for node, env in (node_env or {}).items()}
        self._given_root = Path(root) if root is not None else None
        self._root = self._given_root or Path()
        self._made: list[Path] = []
        self._tasks = TaskOwner()
        self._scheduler = FakeScheduler(self._client, self.nodes, self._max_pods, self._tasks, retry_s=retry_s)
        self._runner: PodRunner | None = None
        self._logs = LogEndpoint(lambda namespace, name, container: self._pods.log_source(namespace, name, container))
        self._failed: set[str] = set()
        self._pods_synced = asyncio.Event()
        self._nodes_synced = asyncio.Event()
        self._failures: list[BaseException] = []

    @property
    def _pods(self) -> PodRunner:
        if self._runner is None:
            raise RuntimeError("FakeKubelet is not running; use it as `async with FakeKubelet(...) as kubelet:`")
        return self._runner

    # ----- life cycle

    async def __aenter__(self) -> FakeKubelet:
        if self._given_root is None:
            self._root = Path(tempfile.mkdtemp(prefix="stead-kubelet-"))
            self._made.append(self._root)
        else:
            self._root.mkdir(parents=True, exist_ok=True)
        for path in [*(self._root / node for node in self.nodes), self._root / "pvc"]:
            path.mkdir(parents=True, exist_ok=True)
            self._made.append(path)
        # memory emptyDirs go to real tmpfs; the name avoids "stead", which the suite's shm leak check reserves
        shm = Path(tempfile.mkdtemp(prefix="kube-fake-kubelet-", dir=_shm_parent(self._root)))
        self._made.append(shm)
        self._runner = PodRunner(self._client, self._tasks, root=self._root, shm=shm, images=self.images,
                                 run_processes=self.run_processes, node_allocatable=self._allocatable,
                                 fail=self._fail, retry_s=self._retry_s, restart_backoff_s=self._restart_backoff_s,
                                 memory_poll_s=self._memory_poll_s, node_env=self.node_env)
        try:
            await self._client.__aenter__()
            await self._logs.__aenter__()
            for node in self.nodes:
                await self._register(node)
            await self._tasks.__aenter__()
        except BaseException:
            await self._close()
            raise
        self._tasks.start(self._informer, "/api/v1/nodes", self._nodes_listed, self._node_event, self._nodes_synced,
                          name="kubelet:nodes")
        self._tasks.start(self._informer, "/api/v1/pods", self._pods_listed, self._pod_event, self._pods_synced,
                          name="kubelet:pods")
        self._tasks.start(self._scheduler.run, name="kubelet:scheduler")
        if self.run_processes and self.enforce_memory_limits:
            self._tasks.start(self._pods.memory_monitor, name="kubelet:memory")
        await self._nodes_synced.wait()
        await self._pods_synced.wait()
        log.debug("fake_kubelet_started", nodes=self.nodes, root=str(self._root), run=self.run_processes)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._tasks.running:
            await self._tasks.__aexit__(None, None, None)
        await self._close()
        if self._failures and exc is None:
            raise RuntimeError(f"the fake kubelet failed {len(self._failures)} time(s), first: "
                               f"{self._failures[0]!r}; this is a bug of tests.support.kube") from self._failures[0]

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.kill_all()
        await self._logs.__aexit__(None, None, None)
        await self._client.__aexit__(None, None, None)
        for path in reversed(self._made):
            shutil.rmtree(path, ignore_errors=True)
        self._made.clear()

    def _fail(self, what: str, exc: BaseException) -> None:
        log.error("fake_kubelet_bug", what=what, error=repr(exc), exc_info=exc)
        self._failures.append(exc)

    def _allocatable(self, node: str) -> Mapping[str, str]:
        allocatable: Mapping[str, str] = ((self._scheduler.node_objs.get(node) or {}).get("status") or {}).get(
            "allocatable") or {}
        return allocatable

    # ----- test inspection

    def processes(self) -> dict[tuple[str, str, str], int]:
        """``(namespace, pod, container) -> pid`` of every container process running now."""
        return {(run.namespace, run.name, name): c.process.pid for run in self._pods.runs.values()
                for name, c in run.containers.items() if c.process is not None and c.process.returncode is None}

    def pid(self, namespace: str, name: str, container: str | None = None) -> int | None:
        """The pid of the pod's container (its first by default) while it runs; None otherwise."""
        run = self._pods.find(namespace, name)
        target = run.containers[container] if container else next(iter(run.containers.values()))
        process = target.process
        return process.pid if process is not None and process.returncode is None else None

    def node_of(self, namespace: str, name: str) -> str:
        return self._pods.find(namespace, name).node

    def log_path(self, namespace: str, name: str, container: str | None = None) -> Path:
        """Where the container's stdout and stderr go (it may not exist before the container starts)."""
        run = self._pods.find(namespace, name)
        container = container or next(iter(run.containers))
        return self._pods.node_dir(run.node) / "logs" / f"{namespace}_{name}_{container}.log"

    def volume_path(self, namespace: str, name: str, volume: str) -> Path:
        """The host directory that stands for a pod's volume (once the pod started)."""
        run = self._pods.find(namespace, name)
        if run.volumes is None or volume not in run.volumes.paths:
            raise KeyError(f"pod {namespace}/{name} has no volume {volume!r} set up (yet)")
        return run.volumes.paths[volume]

    def node_dir(self, node: str) -> Path:
        """``root/<node>``: the node's pods, logs and hostPath volumes."""
        return self._root / node

    # ----- nodes

    def _node_object(self, node: str) -> Obj:
        capacity = {"cpu": self._node_cpu, "memory": self._node_memory, "pods": str(self._max_pods[node]),
                    "ephemeral-storage": "100Gi"}
        now = now_rfc3339()
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux",
                                                  "kubernetes.io/arch": "amd64", "stead.dev/fake-node": "true"}},
            "spec": {},
            "status": {
                "capacity": capacity, "allocatable": dict(capacity),
                "conditions": [_node_condition("Ready", "True", "KubeletReady", "kubelet is posting ready status", now)]
                + [_node_condition(kind, "False", f"KubeletHasNo{kind}", f"kubelet has no {kind}", now)
                   for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")],
                "addresses": [{"type": "InternalIP", "address": POD_IP}, {"type": "Hostname", "address": node}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self._logs.port}},
                "nodeInfo": {"kubeletVersion": "v1.31.0-stead-fake", "containerRuntimeVersion": "stead-fake://1",
                             "operatingSystem": "linux", "architecture": "amd64", "osImage": "stead fake node",
                             "kernelVersion": "", "kubeProxyVersion": "", "machineID": node, "systemUUID": node,
                             "bootID": node}},
        }

    async def _register(self, node: str) -> None:
        body = self._node_object(node)
        try:
            registered = await self._client.create("/api/v1/nodes", body)
        except KubeApiError as exc:
            if exc.status != 409:
                raise
            await self._client.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": body["metadata"]["labels"]}})
            registered = await self._client.patch(f"/api/v1/nodes/{node}/status", {"status": body["status"]})
        self._scheduler.node_changed(registered)

    async def _set_ready(self, node: str, ready: bool) -> None:
        current = self._scheduler.node_objs.get(node) or await self._client.get(f"/api/v1/nodes/{node}")
        now = now_rfc3339()
        conditions = [c for c in current["status"].get("conditions") or [] if c.get("type") != "Ready"]
        if ready:
            conditions.append(_node_condition("Ready", "True", "KubeletReady", "kubelet is posting ready status", now))
        else:  # what the node lifecycle controller writes for a node whose kubelet went silent
            conditions.append(_node_condition("Ready", "Unknown", "NodeStatusUnknown",
                                              "Kubelet stopped posting node status.", now))
        await self._client.patch(f"/api/v1/nodes/{node}/status", {"status": {"conditions": conditions}})
        taints = [t for t in current["spec"].get("taints") or [] if t not in _UNREACHABLE_TAINTS]
        if not ready:
            taints += _UNREACHABLE_TAINTS
        self._scheduler.node_changed(await self._client.patch(f"/api/v1/nodes/{node}",
                                                              {"spec": {"taints": taints or None}}))

    async def cordon(self, node: str, unschedulable: bool = True) -> None:
        """Mark the node unschedulable through the API, as ``kubectl cordon`` does (False: uncordon)."""
        self._check_node(node)
        self._scheduler.node_changed(await self._client.patch(f"/api/v1/nodes/{node}",
                                                              {"spec": {"unschedulable": unschedulable or None}}))

    async def uncordon(self, node: str) -> None:
        await self.cordon(node, unschedulable=False)

    async def set_capacity(self, node: str, *, pods: int) -> None:
        """How many pods the node takes (its ``capacity.pods``); pods waiting for room are retried."""
        self._check_node(node)
        self._max_pods[node] = pods
        self._scheduler.node_changed(await self._client.patch(
            f"/api/v1/nodes/{node}/status", {"status": {"capacity": {"pods": str(pods)},
                                                        "allocatable": {"pods": str(pods)}}}))

    def _check_node(self, node: str) -> None:
        if node not in self.nodes:
            raise KeyError(f"{node!r} is not a node of this fake kubelet: its nodes are {list(self.nodes)}")

    # ----- faults

    async def oom_kill(self, namespace: str, name: str, container: str | None = None) -> None:
        """Kill the container (all of the pod's by default) as the kernel's OOM killer would: SIGKILL, exit code
        137, reason OOMKilled. Returns once the process is gone."""
        run = self._pods.find(namespace, name)
        for target in [run.containers[container]] if container else list(run.containers.values()):
            await self._pods.oom(run, target)

    async def evict(self, namespace: str, name: str, reason: str = "Evicted", message: str | None = None) -> None:
        """Evict the pod as a kubelet under node pressure does: its processes killed, phase Failed with
        ``status.reason`` and ``status.message``. Returns once that status is written."""
        run = self._pods.find(namespace, name)
        run.request_stop(StopKind.EVICT, reason, message or "The node was low on resource: memory. ")
        await run.done.wait()

    async def fail_node(self, node: str) -> None:
        """The node is lost: every process on it SIGKILLed, its pods Failed (reason NodeLost), the node not Ready
        (condition Ready=Unknown, reason NodeStatusUnknown, the unreachable taints), its directories and memory
        volumes wiped. Returns once all of that is written."""
        self._check_node(node)
        self._failed.add(node)
        runs = [run for run in self._pods.runs.values() if run.node == node and not run.done.is_set()]
        for run in runs:
            run.request_stop(StopKind.NODE_LOST, "NodeLost",
                             f"Node {node} which was running pod {run.name} is unresponsive")
        for run in runs:
            await run.done.wait()
        await self._set_ready(node, False)
        shutil.rmtree(self._root / node, ignore_errors=True)
        shutil.rmtree(self._pods.node_shm(node), ignore_errors=True)
        log.info("fake_node_failed", node=node, pods=len(runs))

    async def recover_node(self, node: str) -> None:
        """The node is back, empty and Ready; pods can be scheduled onto it again."""
        self._check_node(node)
        (self._root / node).mkdir(parents=True, exist_ok=True)
        self._failed.discard(node)
        await self._set_ready(node, True)

    # ----- informers

    async def _informer(self, path: str, listed: Callable[[list[Obj]], None], event: Callable[[str, Obj], None],
                        synced: asyncio.Event) -> None:
        """List, then watch from the list's version; re-list when the version expired (410)."""
        while True:
            try:
                listing = await self._client.get(path)
                listed(listing["items"])
                synced.set()
                version = listing["metadata"]["resourceVersion"]
                while version is not None:
                    version = await self._watch(path, version, event)
            except (KubeApiError, aiohttp.ClientError, OSError, ValueError) as exc:
                log.debug("kubelet_watch_retry", path=path, error=repr(exc))
                await asyncio.sleep(self._retry_s)

    async def _watch(self, path: str, version: str, event: Callable[[str, Obj], None]) -> str | None:
        """Watch from ``version`` until the stream ends; the version to resume from, or None to re-list."""
        stream = self._client.watch(path, resourceVersion=version, allowWatchBookmarks="true")
        async with contextlib.aclosing(stream) as events:
            async for item in events:
                kind, obj = item.get("type"), item.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return None
                    raise KubeApiError(int(obj.get("code", 500)), str(obj.get("reason")), str(obj.get("message")))
                version = obj["metadata"]["resourceVersion"]
                if kind != "BOOKMARK":
                    try:
                        event(str(kind), obj)
                    except Exception as exc:
                        self._fail(f"handling {kind} of {path}", exc)
        return version

    def _nodes_listed(self, items: list[Obj]) -> None:
        for node in items:
            self._node_event("ADDED", node)

    def _node_event(self, kind: str, node: Obj) -> None:
        self._scheduler.node_changed(node, deleted=kind == "DELETED")

    def _pods_listed(self, items: list[Obj]) -> None:
        present = {pod["metadata"]["uid"] for pod in items}
        for uid, pod in list(self._scheduler.pods.items()):
            if uid not in present:
                self._pod_event("DELETED", pod)
        for pod in items:
            self._pod_event("ADDED", pod)

    def _pod_event(self, kind: str, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            self._scheduler.pod_deleted(uid)
            self._pods.pod_deleted(uid)
            return
        self._scheduler.pod_changed(pod)
        node = pod["spec"].get("nodeName")
        if node in self.nodes and node not in self._failed:
            self._pods.pod_changed(pod, node)


def _shm_parent(fallback: Path) -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else fallback


def _node_condition(kind: str, status: str, reason: str, message: str, now: str) -> Obj:
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastHeartbeatTime": now,
            "lastTransitionTime": now}
