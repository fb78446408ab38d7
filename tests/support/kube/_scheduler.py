"""The fake kubelet's scheduler: binds each unscheduled pod to a fake node that fits, as kube-scheduler does.

It keeps the pods the kubelet's informer saw and the fake nodes' objects, and on every
change that can make room (a pod added, ended or deleted, a node changed, a capacity
set) tries the pending pods, oldest first: the filters of :mod:`._scheduling` decide, the
least loaded fitting node wins, the binding goes through ``pods/{name}/binding``. A pod
that fits nowhere gets ``PodScheduled=False, reason=Unschedulable`` with the reasons
counted, written once per distinct message. Pods being bound are "assumed" on their
node (counted there) until the informer sees them bound, so a burst of pods never
overfills a node.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

import aiohttp
import structlog

from stead.core.tasks import TaskOwner
from tests.support.kube._client import KubeApiError, KubeClient
from tests.support.kube._scheduling import NodeUsage, node_rejection, pod_requests, unschedulable_message
from tests.support.kube._store import now_rfc3339

__all__ = ["TERMINAL_PHASES", "FakeScheduler"]

log = structlog.get_logger("tests.support.kube.scheduler")

Obj = dict[str, Any]
TERMINAL_PHASES = ("Succeeded", "Failed")


class FakeScheduler:
    def __init__(self, client: KubeClient, nodes: Sequence[str], max_pods: Mapping[str, int], tasks: TaskOwner,
                 *, retry_s: float) -> None:
        self._client, self._nodes, self._max_pods, self._tasks = client, tuple(nodes), max_pods, tasks
        self._retry_s = retry_s
        #: every pod of the cluster, by uid, as last seen
        self.pods: dict[str, Obj] = {}
        #: the fake nodes' objects, as last seen
        self.node_objs: dict[str, Obj] = {}
        self.wake = asyncio.Event()
        self._pending: set[str] = set()
        self._assumed: dict[str, str] = {}  # uid -> node: bound (or being bound), not yet seen bound
        self._unschedulable: dict[str, str] = {}  # uid -> the Unschedulable message last written
        self._requests: dict[str, dict[str, Decimal]] = {}  # uid -> cpu/memory requests (a pod's never change)

    def pod_changed(self, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        self.pods[uid] = pod
        node = pod["spec"].get("nodeName")
        if not node:
            if not pod["metadata"].get("deletionTimestamp") and \
                    pod["spec"].get("schedulerName", "default-scheduler") == "default-scheduler":
                self._pending.add(uid)
                self.wake.set()
            return
        self._pending.discard(uid)
        self._unschedulable.pop(uid, None)
        if self._assumed.get(uid) == node:
            del self._assumed[uid]
        if (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
            self.wake.set()  # room on the node

    def pod_deleted(self, uid: str) -> None:
        self.pods.pop(uid, None)
        self._requests.pop(uid, None)
        self._pending.discard(uid)
        self._assumed.pop(uid, None)
        self._unschedulable.pop(uid, None)
        self.wake.set()

    def node_changed(self, node: Obj, deleted: bool = False) -> None:
        name = node["metadata"]["name"]
        if name not in self._nodes:
            return
        if deleted:
            self.node_objs.pop(name, None)
        else:
            self.node_objs[name] = node
        self.wake.set()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # a periodic retry too: a missing claim may have appeared
                async with asyncio.timeout(self._retry_s * 2 if self._pending else None):
                    await self.wake.wait()
            self.wake.clear()
            try:
                await self._schedule_pending()
            except (KubeApiError, aiohttp.ClientError, OSError) as exc:
                log.debug("scheduler_retry", error=repr(exc))

    def usage(self) -> dict[str, NodeUsage]:
        usage = {node: NodeUsage() for node in self._nodes}
        for uid, pod in self.pods.items():
            node = pod["spec"].get("nodeName") or self._assumed.get(uid)
            if node in usage and (pod.get("status") or {}).get("phase") not in TERMINAL_PHASES:
                usage[node].add(self._requests_of(uid, pod))
        return usage

    def _requests_of(self, uid: str, pod: Obj) -> dict[str, Decimal]:
        requests = self._requests.get(uid)
        if requests is None:
            requests = self._requests[uid] = pod_requests(pod)
        return requests

    async def _schedule_pending(self) -> None:
        pending = [self.pods[uid] for uid in self._pending if uid in self.pods and uid not in self._assumed]
        if not pending:
            return
        pending.sort(key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["namespace"],
                                    p["metadata"]["name"]))
        usage = self.usage()
        total = len(self._nodes)
        for pod in pending:
            uid = pod["metadata"]["uid"]
            if uid not in self._pending or uid in self._assumed:
                continue  # bound or deleted while this pass awaited
            claim = await self._missing_claim(pod)
            if claim is not None:
                self._mark_unschedulable(pod, f'0/{total} nodes are available: persistentvolumeclaim "{claim}" not '
                                              f"found. preemption: 0/{total} nodes are available: {total} Preemption "
                                              f"is not helpful for scheduling.")
                continue
            reasons: collections.Counter[str] = collections.Counter()
            fitting = []
            for node in self._nodes:
                node_obj = self.node_objs.get(node)
                why = "node(s) not registered" if node_obj is None else \
                    node_rejection(pod, node_obj, usage[node], self._max_pods[node])
                if why is None:
                    fitting.append(node)
                else:
                    reasons[why] += 1
            if not fitting:
                self._mark_unschedulable(pod, unschedulable_message(reasons, total))
                continue
            chosen = min(fitting, key=lambda n: usage[n].pods)  # spread, as the default scoring roughly does
            usage[chosen].add(self._requests_of(uid, pod))
            self._assumed[uid] = chosen
            self._tasks.start(self._bind, pod, chosen, name=f"kubelet:bind:{pod['metadata']['name']}")

    async def _missing_claim(self, pod: Obj) -> str | None:
        """The first PersistentVolumeClaim the pod mounts that does not exist (the scheduler waits for it)."""
        for volume in pod["spec"].get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim:
                try:
                    await self._client.get(f"/api/v1/namespaces/{pod['metadata']['namespace']}/"
                                           f"persistentvolumeclaims/{claim}")
                except KubeApiError as exc:
                    if exc.status == 404:
                        return str(claim)
                    raise
        return None

    def _mark_unschedulable(self, pod: Obj, message: str) -> None:
        uid = pod["metadata"]["uid"]
        if self._unschedulable.get(uid) == message:
            return
        self._unschedulable[uid] = message
        self._tasks.start(self._write_unschedulable, pod, message, name=f"kubelet:unschedulable:{uid}")

    async def _write_unschedulable(self, pod: Obj, message: str) -> None:
        meta = pod["metadata"]
        conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != "PodScheduled"]
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
                           "lastProbeTime": None, "lastTransitionTime": now_rfc3339()})
        try:
            await self._client.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                                     {"status": {"conditions": conditions}})
        except (KubeApiError, aiohttp.ClientError, OSError) as exc:
            log.debug("unschedulable_not_written", pod=meta["name"], error=repr(exc))
            self._unschedulable.pop(meta["uid"], None)
            return
        log.info("pod_unschedulable", namespace=meta["namespace"], pod=meta["name"], message=message)

    async def _bind(self, pod: Obj, node: str) -> None:
        meta = pod["metadata"]
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        try:
            await self._client.create(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", body)
        except (KubeApiError, aiohttp.ClientError, OSError) as exc:
            if self._assumed.get(meta["uid"]) == node:
                del self._assumed[meta["uid"]]
            log.debug("bind_failed", pod=meta["name"], node=node, error=repr(exc))
            self.wake.set()
