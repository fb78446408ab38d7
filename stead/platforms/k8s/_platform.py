"""K8sPlatform: every node's agent is a pod, created and watched through the Kubernetes API.

One informer per job (list the job's node pods, then watch from the list's
resourceVersion with bookmarks, list again on ``410 Gone``; never a polling
loop) turns pod changes into NodeStarted / NodeExited / NodePending. Pods are
created concurrently (``k8s.create_concurrency`` at a time), not from a timed
queue, so a relaunch of 300 nodes goes out at once. Launch, kill and adopt are
idempotent by ``(node_id, incarnation)``: the pod's name is made of both.

A new master adopts the pods that still run (found by label in the informer's
first list) instead of recreating them. A master that leaves while the job goes
on (its pod deleted, or preempted) calls :meth:`K8sPlatform.detach` first, so
that closing leaves the pods to the next master; a master whose job ended
deletes the pods still running when it closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from collections.abc import AsyncGenerator, Iterable
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from stead.core.config import Settings
from stead.core.entrypoints import installed
from stead.core.errors import PlatformError, RetryableError
from stead.core.events import NodeExited, NodePending, NodeStarted
from stead.core.platform import NodeSpec, PlatformEvent
from stead.core.plugins import GROUP as PLUGIN_GROUP
from stead.platforms.k8s import names
from stead.platforms.k8s._client import JOBS, NODES, PODS, SECRETS, Expired, Kube
from stead.platforms.k8s.pods import JobObjects, Owner, node_pod, passed_env
from stead.platforms.k8s.settings import K8sSettings
from stead.platforms.k8s.status import Ended, PodView, view

__all__ = ["K8sPlatform"]

log = structlog.get_logger("stead.k8s")

_Key = tuple[str, int]
#: how often unscheduled pods are looked at for k8s.pending_timeout_s (the informer has their status already)
_PENDING_LOOK_S = 1.0


@dataclasses.dataclass(eq=False)
class _Node:
    """One node incarnation this platform launched or adopted."""

    spec: NodeSpec
    pod: str
    started: bool = False
    reported: bool = False
    pending_reported: bool = False
    #: this platform deleted it (kill, or a start that cannot succeed)
    killed: bool = False
    view: PodView | None = None
    ended: anyio.Event = dataclasses.field(default_factory=anyio.Event)


class K8sPlatform:
    """Runs each node's agent in a pod. ``async with K8sPlatform(settings, k8s) as platform``.

    ``events()`` is meant for one consumer; it ends after the platform is closed.
    """

    name = "k8s"

    def __init__(self, settings: Settings | None = None, k8s: K8sSettings | None = None, *,
                 environ: dict[str, str] | None = None) -> None:
        self._settings = settings if settings is not None else Settings()
        self.k8s = k8s if k8s is not None else K8sSettings()
        self._kube = Kube(self.k8s)
        self._nodes: dict[_Key, _Node] = {}
        #: every pod of the job the informer has seen, by name (adoption looks here)
        self._pods: dict[str, dict[str, Any]] = {}
        self._job: str | None = None
        self._objects: JobObjects | None = None
        self._listed = anyio.Event()
        self._detached = False
        self._closed = False
        self._job_lock = anyio.Lock()
        self._limit = anyio.Semaphore(self.k8s.create_concurrency)
        #: host -> when it was first asked to be avoided (its anti-affinity expires after bad_host_expiry_s)
        self._bad_hosts: dict[str, float] = {}
        self._env = passed_env(os.environ if environ is None else environ, self._settings, installed(PLUGIN_GROUP))
        self._send: MemoryObjectSendStream[PlatformEvent]
        self._receive: MemoryObjectReceiveStream[PlatformEvent]
        self._task_group: anyio.abc.TaskGroup | None = None
        self._stack = contextlib.AsyncExitStack()

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._task_group is not None or self._closed:
            raise PlatformError("this K8sPlatform was already started; create a new one")
        self._send, self._receive = anyio.create_memory_object_stream[PlatformEvent](math.inf)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self._kube)
            self._task_group = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._stop)  # before the task group waits for the informer
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        return await self._stack.__aexit__(exc_type, exc, tb)

    def detach(self) -> None:
        """Leave the pods running when this platform closes: the master goes away but the job does not, and the
        next master adopts them."""
        self._detached = True

    # -- the Platform protocol ------------------------------------------------------

    async def launch(self, spec: NodeSpec) -> None:
        objects = await self._for_job(spec.job)
        key = (spec.node_id, spec.incarnation)
        if key in self._nodes:
            log.debug("node_launch_repeated", node=spec.node_id, incarnation=spec.incarnation)
            return
        node = self._nodes[key] = _Node(spec=spec, pod=names.pod_name(spec.job, spec.node_id, spec.incarnation))
        avoid = self._avoid(spec.avoid_hosts)
        try:
            body = node_pod(spec, objects, self.k8s, env=self._env, avoid_hosts=avoid,
                            memory=spec.resources.get("memory", ""))
            async with self._limit:
                await self._older_incarnations_gone(spec)
                created = await self._kube.create(PODS, body, exist_ok=True)
        except BaseException:
            del self._nodes[key]  # nothing was made: a later launch tries again
            raise
        log.info("node_launched", job=spec.job, node=spec.node_id, incarnation=spec.incarnation, pod=node.pod,
                 existed=created is None, avoid_hosts=avoid or None)
        pod = self._pods.get(node.pod)
        if pod is not None:  # the informer saw it first (or it existed): act on what it knows
            self._update(node, pod)

    async def kill(self, node_id: str, incarnation: int) -> None:
        node = self._nodes.get((node_id, incarnation))
        if node is None or node.reported:
            log.debug("node_kill_ignored", node=node_id, incarnation=incarnation, known=node is not None)
            return
        node.killed = True
        log.info("node_killed", node=node_id, incarnation=incarnation, pod=node.pod,
                 grace_s=self.k8s.grace_period_s)
        async with self._limit:
            gone = not await self._kube.delete(PODS, node.pod, grace_period_s=self.k8s.grace_period_s)
        if gone:
            self._report(node, NodeExited(node_id=node_id, incarnation=incarnation, signal=int(signal.SIGKILL),
                                          reason="pod deleted"))

    async def adopt(self, spec: NodeSpec, *, pid: int | None) -> bool:
        """Take over the pod an earlier master created for this node incarnation, if it still runs."""
        await self._for_job(spec.job)
        key = (spec.node_id, spec.incarnation)
        if key in self._nodes:
            return True
        node = self._nodes[key] = _Node(spec=spec, pod=names.pod_name(spec.job, spec.node_id, spec.incarnation))
        pod = self._pods.get(node.pod)
        found = view(pod) if pod is not None else None
        if found is None or found.ended is not None or found.deleting:
            log.warning("node_adoption_failed", node=spec.node_id, incarnation=spec.incarnation, pod=node.pod,
                        reason="its pod is gone" if found is None else "its pod ended")
            ended = found.ended if found is not None and found.ended is not None else Ended(None, None, "pod gone")
            self._report(node, _exited(spec, ended))
            return False
        node.started = found.running  # its NodeStarted is in the log already
        log.info("node_adopted", node=spec.node_id, incarnation=spec.incarnation, pod=node.pod, host=found.host)
        assert pod is not None
        self._update(node, pod)
        return True

    def events(self) -> AsyncGenerator[PlatformEvent, None]:
        if self._task_group is None or self._closed:
            raise PlatformError("the k8s platform is not running; use it inside `async with platform:`")
        return _iterate(self._receive.clone())

    # -- the job's objects ----------------------------------------------------------

    async def _for_job(self, job: str) -> JobObjects:
        """The job's objects (owner, master address) and its informer, started on first use; one job per platform."""
        async with self._job_lock:
            if self._closed or self._task_group is None:
                raise PlatformError("the k8s platform is not running; launch nodes inside `async with platform:`")
            if self._objects is not None:
                if job != self._job:
                    raise PlatformError(f"this k8s platform runs job {self._job!r}; start another for {job!r}")
                return self._objects
            self._job = job
            owner = await self._owner(job)
            host = self.k8s.master_host or f"{names.master_name(job)}.{self._kube.namespace}.svc"
            self._objects = JobObjects(job=job, namespace=self._kube.namespace, owner=owner,
                                       master_address=f"{host}:{self.k8s.master_port}")
            self._task_group.start_soon(self._inform, job, name=f"k8s informer {job}")
            self._task_group.start_soon(self._watch_pending, name=f"k8s pending pods {job}")
        await self._listed.wait()  # adoption needs to know every pod that runs
        return self._objects

    async def _owner(self, job: str) -> Owner | None:
        """The job's SteadJob when there is one, else its token Secret (``stead run --platform k8s`` without the
        CRD), else nothing (pods then live until deleted by the master)."""
        with contextlib.suppress(PlatformError):
            found = await self._kube.get(JOBS, job)
            if found:
                return Owner(f"{names.API_GROUP}/{names.API_VERSION}", names.JOB_KIND, job,
                             found["metadata"]["uid"])
        secret = await self._kube.get(SECRETS, names.secret_name(job))
        if secret:
            return Owner("v1", "Secret", names.secret_name(job), secret["metadata"]["uid"])
        log.warning("k8s_job_has_no_owner", job=job,
                    hint=f"neither a SteadJob {job!r} nor a Secret {names.secret_name(job)!r}: pods are not "
                         "garbage-collected with the job")
        return None

    # -- the informer ---------------------------------------------------------------

    async def _inform(self, job: str) -> None:
        selector = f"{names.LABEL_JOB}={job},{names.LABEL_ROLE}={names.ROLE_NODE}"
        backoff = 0.2
        version = ""
        while True:
            try:
                if not version:
                    items, version = await self._kube.list(PODS, label_selector=selector)
                    self._relisted(items)
                    self._listed.set()
                async for kind, obj in self._kube.watch(PODS, resource_version=version, label_selector=selector,
                                                        timeout_s=self.k8s.watch_timeout_s):
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind != "BOOKMARK":
                        self._seen(kind, obj)
                backoff = 0.2
            except Expired:
                log.info("k8s_watch_expired", job=job, resource_version=version, action="listing again")
                version = ""
            except RetryableError as exc:
                log.warning("k8s_watch_broken", job=job, error=str(exc), retry_in_s=backoff)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _relisted(self, items: Iterable[dict[str, Any]]) -> None:
        """A fresh list: every pod in it is current, and a tracked pod missing from it was deleted meanwhile."""
        listed = {str(item["metadata"]["name"]): item for item in items}
        for name in set(self._pods) - set(listed):
            self._seen("DELETED", self._pods[name])
        for item in listed.values():
            self._seen("MODIFIED", item)

    def _seen(self, kind: str, pod: dict[str, Any]) -> None:
        name = str((pod.get("metadata") or {}).get("name", ""))
        if kind == "DELETED":
            self._pods.pop(name, None)
        else:
            self._pods[name] = pod
        found = view(pod)
        if found is None:
            return
        node = self._nodes.get((found.node_id, found.incarnation))
        if node is None:
            return
        if kind == "DELETED":
            self._update(node, pod)
            self._report(node, NodeExited(node_id=node.spec.node_id, incarnation=node.spec.incarnation,
                                          signal=int(signal.SIGKILL) if node.killed else None,
                                          reason="pod deleted" if node.killed else "pod deleted (not by stead)"))
            return
        self._update(node, pod)

    def _update(self, node: _Node, pod: dict[str, Any]) -> None:
        found = node.view = view(pod)
        if found is None or node.reported:
            return
        spec = node.spec
        if found.running and not node.started:
            node.started = True
            self._send.send_nowait(NodeStarted(node_id=spec.node_id, incarnation=spec.incarnation, host=found.host,
                                               resources=found.limits))
        if found.ended is not None:
            ended = found.ended
            if node.killed and not ended.reason:
                ended = dataclasses.replace(ended, reason="pod deleted")
            self._report(node, _exited(spec, ended))
        elif found.deleting and not node.killed:
            # deleted by someone else (a user, a drain, preemption): the node is going, whatever its agent still
            # does in its grace period (it persists the newest checkpoint); the job replaces it now, not after
            self._report(node, NodeExited(node_id=spec.node_id, incarnation=spec.incarnation,
                                          reason="pod deleted (not by stead); it stops within its grace period"))
        elif found.cannot_start and self._task_group is not None:
            log.error("node_cannot_start", node=spec.node_id, incarnation=spec.incarnation, pod=node.pod,
                      reason=found.cannot_start)
            self._report(node, NodeExited(node_id=spec.node_id, incarnation=spec.incarnation,
                                          reason=found.cannot_start, permanent=True))
            self._task_group.start_soon(self._delete, node.pod, 0)

    def _report(self, node: _Node, event: NodeExited) -> None:
        if node.reported:
            return
        node.reported = True
        node.ended.set()
        log.info("node_exited", node=event.node_id, incarnation=event.incarnation, pod=node.pod,
                 exit_code=event.exit_code, signal=event.signal, reason=event.reason or None)
        self._send.send_nowait(event)

    async def _watch_pending(self) -> None:
        """Report each pod the scheduler has had no room for for ``pending_timeout_s`` (once per pod)."""
        while True:
            await anyio.sleep(_PENDING_LOOK_S)
            now = time.time()
            for node in list(self._nodes.values()):
                found = node.view
                if node.reported or node.pending_reported or found is None or found.host or not found.created_at:
                    continue
                waited = now - found.created_at
                if waited >= self.k8s.pending_timeout_s:
                    node.pending_reported = True
                    reason = found.unschedulable or "not scheduled"
                    log.warning("node_pending", node=node.spec.node_id, incarnation=node.spec.incarnation,
                                pod=node.pod, waited_s=round(waited, 1), reason=reason)
                    self._send.send_nowait(NodePending(node_id=node.spec.node_id, incarnation=node.spec.incarnation,
                                                       pending_s=round(waited, 3), reason=reason))

    # -- helpers --------------------------------------------------------------------

    def _avoid(self, hosts: Iterable[str]) -> list[str]:
        """The excluded hosts whose anti-affinity has not expired (bad_host_expiry_s after first asked)."""
        now = time.monotonic()
        kept = []
        for host in hosts:
            first = self._bad_hosts.setdefault(host, now)
            if now - first < self.k8s.bad_host_expiry_s:
                kept.append(host)
                if first == now and self.k8s.cordon_bad_hosts and self._task_group is not None:
                    self._task_group.start_soon(self._cordon, host)
        return kept

    async def _cordon(self, host: str) -> None:
        try:
            await self._kube.patch(NODES, host, {"spec": {"unschedulable": True}})
            log.warning("k8s_host_cordoned", host=host, hint=f"uncordon it with `kubectl uncordon {host}` once fixed")
        except PlatformError as exc:
            log.warning("k8s_host_cordon_failed", host=host, error=str(exc))

    async def _older_incarnations_gone(self, spec: NodeSpec) -> None:
        """A node's pods of earlier incarnations that this platform does not know (an earlier master left them:
        it died after creating one and before its log said so) go now: two agents of one node must not run at
        once behind the job's back. Incarnations it launched or adopted are the job's to end."""
        for name, pod in list(self._pods.items()):
            found = view(pod)
            if (found is not None and found.node_id == spec.node_id and found.incarnation < spec.incarnation
                    and found.ended is None and not found.deleting
                    and (found.node_id, found.incarnation) not in self._nodes):
                log.warning("node_old_pod_deleted", node=spec.node_id, pod=name, incarnation=found.incarnation)
                await self._kube.delete(PODS, name, grace_period_s=self.k8s.grace_period_s)

    async def _delete(self, pod: str, grace_s: int) -> None:
        try:
            async with self._limit:
                await self._kube.delete(PODS, pod, grace_period_s=grace_s)
        except PlatformError as exc:
            log.warning("k8s_pod_delete_failed", pod=pod, error=str(exc))

    async def _stop(self) -> None:
        """Close: delete the pods still running unless detached, wait for them (``shutdown_grace_s``), stop."""
        with anyio.CancelScope(shield=True):
            self._closed = True
            running = [n for n in self._nodes.values() if not n.reported]
            if running and not self._detached:
                with anyio.move_on_after(self._settings.shutdown_grace_s + self.k8s.request_timeout_s):
                    async with anyio.create_task_group() as tasks:
                        for node in running:
                            node.killed = True
                            tasks.start_soon(self._delete, node.pod, self.k8s.grace_period_s)
                    with anyio.move_on_after(self._settings.shutdown_grace_s):
                        for node in running:
                            await node.ended.wait()
                for node in running:
                    if not node.reported:
                        log.warning("node_stop_timed_out", node=node.spec.node_id, pod=node.pod,
                                    grace_s=self._settings.shutdown_grace_s)
                    self._report(node, NodeExited(node_id=node.spec.node_id, incarnation=node.spec.incarnation,
                                                  signal=int(signal.SIGKILL), reason="pod deleted"))
            elif running:
                log.info("k8s_platform_detached", pods=sorted(n.pod for n in running),
                         hint="the job's next master adopts them")
            if self._task_group is not None:
                self._task_group.cancel_scope.cancel()
            self._send.close()
            self._receive.close()


def _exited(spec: NodeSpec, ended: Ended) -> NodeExited:
    return NodeExited(node_id=spec.node_id, incarnation=spec.incarnation, exit_code=ended.exit_code,
                      signal=ended.signal, reason=ended.reason, oom=ended.oom)


async def _iterate(receive: MemoryObjectReceiveStream[PlatformEvent]) -> AsyncGenerator[PlatformEvent, None]:
    with receive:
        async for event in receive:
            yield event
