"""The Kubernetes platform against the test cluster: what it reports of pods, and what it refuses.

The platform contract suite (``tests/platforms/test_platform_contract.py``) runs the k8s backend too;
these are the parts only Kubernetes has: pod status reasons, an informer that survives ``410 Gone``,
pending pods, hosts kept out, adoption by name, an API server that refuses or is not there.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from stead.core.config import Settings
from stead.core.errors import ConfigError, PlatformRejected, PlatformUnavailable
from stead.core.events import NodeExited, NodePending, NodeStarted
from stead.core.platform import NodeSpec, PlatformEvent
from stead.platforms.k8s import PODS, SECRETS, K8sPlatform, K8sSettings, Kube
from stead.platforms.k8s.pods import token_secret
from tests.support.kube import FakeKubeApi, FakeKubelet

pytestmark = pytest.mark.anyio

SLEEP = "import time; time.sleep(300)"
TIMEOUT_S = 30.0
SETTINGS = Settings(shutdown_grace_s=5.0)


def agent(node: str = "n1", incarnation: int = 1, code: str = SLEEP, **fields: Any) -> NodeSpec:
    return NodeSpec(job="plat", node_id=node, incarnation=incarnation, command=(sys.executable, "-c", code),
                    **fields)


def k8s(api: FakeKubeApi, **overrides: Any) -> K8sSettings:
    return K8sSettings(**{"api_url": api.url, "namespace": "default", "image": "stead:test", "grace_period_s": 2,
                          "master_host": "127.0.0.1", **overrides})


@contextlib.asynccontextmanager
async def platform(api: FakeKubeApi, **overrides: Any) -> AsyncIterator[K8sPlatform]:
    async with Kube(k8s(api), pool=1) as kube:
        await kube.create(SECRETS, token_secret("plat", "default", "p" * 43), exist_ok=True)
    async with K8sPlatform(SETTINGS, k8s(api, **overrides), environ={}) as made:
        yield made


async def next_of(events: AsyncIterator[PlatformEvent], kind: type[Any]) -> Any:
    with anyio.fail_after(TIMEOUT_S):
        async for event in events:
            if isinstance(event, kind):
                return event
    raise AssertionError(f"the events ended before a {kind.__name__}")


async def test_a_pods_end_comes_with_its_reason_oom_eviction_and_a_lost_host(kube_api: FakeKubeApi,
                                                                            kubelet: FakeKubelet) -> None:
    async with platform(kube_api, memory="4Gi") as made:
        events = made.events()
        for node in ("a", "b", "c"):
            await made.launch(agent(node))
        started = {e.node_id: e for e in [await next_of(events, NodeStarted) for _ in range(3)]}
        assert dict(started["a"].resources)["memory"] == "4Gi"
        await kubelet.oom_kill("default", "plat-a-1")
        oom = await next_of(events, NodeExited)
        assert (oom.node_id, oom.signal, oom.oom, oom.reason) == ("a", signal.SIGKILL, True, "OOMKilled")
        await kubelet.evict("default", "plat-b-1", message="The node was low on resource: memory.")
        evicted = await next_of(events, NodeExited)
        assert evicted.node_id == "b" and evicted.reason.startswith("Evicted: The node was low on resource")
        await kubelet.fail_node(started["c"].host)
        lost = await next_of(events, NodeExited)
        assert lost.node_id == "c" and lost.reason.startswith("NodeLost")


async def test_a_pod_that_can_never_start_is_reported_permanent_and_deleted(kube_api: FakeKubeApi,
                                                                           kubelet: FakeKubelet) -> None:
    async with platform(kube_api, image="registry.invalid/nope:1") as made:
        events = made.events()
        await made.launch(agent())
        exited = await next_of(events, NodeExited)
        assert exited.permanent and exited.reason.startswith(("ErrImagePull", "ImagePullBackOff"))
        await kube_api.wait_for(lambda: kube_api.get_object("pods", "default", "plat-n1-1") is None, TIMEOUT_S)


async def test_a_pod_no_host_has_room_for_is_reported_pending_once(kube_api: FakeKubeApi,
                                                                  kubelet: FakeKubelet) -> None:
    for host in kubelet.nodes:
        await kubelet.set_capacity(host, pods=0)
    async with platform(kube_api, pending_timeout_s=0.3) as made:
        events = made.events()
        await made.launch(agent())
        pending = await next_of(events, NodePending)
        assert pending.node_id == "n1" and pending.pending_s >= 0.3
        assert pending.reason.startswith("Unschedulable")
        await kubelet.set_capacity("host-a", pods=5)  # room at last: it starts
        assert (await next_of(events, NodeStarted)).host == "host-a"


async def test_excluded_hosts_are_kept_out_until_their_exclusion_expires(kube_api: FakeKubeApi,
                                                                         kubelet: FakeKubelet) -> None:
    async with platform(kube_api) as made:
        events = made.events()
        await made.launch(agent("x", avoid_hosts=("host-a", "host-b")))
        assert (await next_of(events, NodeStarted)).host == "host-c"
        pod = kube_api.get_object("pods", "default", "plat-x-1")
        assert pod is not None and "affinity" in pod["spec"]
    async with platform(kube_api, bad_host_expiry_s=0.0) as made:
        await made.launch(agent("y", avoid_hosts=("host-a",)))
        pod = kube_api.get_object("pods", "default", "plat-y-1")
        assert pod is not None and "affinity" not in pod["spec"]
    assert not (kube_api.get_object("nodes", None, "host-a") or {}).get("spec", {}).get("unschedulable")
    async with platform(kube_api, cordon_bad_hosts=True) as made:  # off by default; on, the host is cordoned too
        await made.launch(agent("z", avoid_hosts=("host-a",)))
        await kube_api.wait_for(lambda: bool((kube_api.get_object("nodes", None, "host-a") or {})
                                             .get("spec", {}).get("unschedulable")), timeout_s=TIMEOUT_S)


async def test_a_pod_deleted_by_someone_else_is_gone_at_once_and_the_informer_survives_410(
        kube_api: FakeKubeApi, kubelet: FakeKubelet) -> None:
    async with platform(kube_api, grace_period_s=30) as made:
        events = made.events()
        await made.launch(agent("a"))
        await made.launch(agent("b"))
        for _ in range(2):
            await next_of(events, NodeStarted)
        kube_api.compact()
        kube_api.close_watches()  # the watch must start again from a version no longer kept: 410, list again
        async with Kube(k8s(kube_api), pool=1) as kube:
            await kube.delete(PODS, "plat-a-1", grace_period_s=30)
        gone = await next_of(events, NodeExited)  # not 30 s later: the deletion itself says the node is going
        assert gone.node_id == "a" and "not by stead" in gone.reason
        await kubelet.oom_kill("default", "plat-b-1")
        assert (await next_of(events, NodeExited)).oom


async def test_a_new_master_adopts_the_pods_that_run_and_reports_the_gone_ones(kube_api: FakeKubeApi,
                                                                             kubelet: FakeKubelet) -> None:
    async with platform(kube_api) as first:
        events = first.events()
        await first.launch(agent("a"))
        await first.launch(agent("b"))
        for _ in range(2):
            await next_of(events, NodeStarted)
        first.detach()  # the master leaves, the job does not
    assert {p["metadata"]["name"] for p in kube_api.objects("pods", "default")} >= {"plat-a-1", "plat-b-1"}
    await kubelet.oom_kill("default", "plat-b-1")  # ends while no master runs
    async with platform(kube_api) as second:
        events = second.events()
        assert await second.adopt(agent("a"), pid=None)
        assert not await second.adopt(agent("b"), pid=None)
        assert not await second.adopt(agent("c"), pid=None)  # never launched
        ended = [await next_of(events, NodeExited) for _ in range(2)]
        assert {(e.node_id, e.oom) for e in ended} == {("b", True), ("c", False)}
        await second.launch(agent("a"))  # adopted: not created again
        await second.kill("a", 1)
        assert (await next_of(events, NodeExited)).node_id == "a"
    names = [p["metadata"]["name"] for p in kube_api.objects("pods", "default")]
    assert names.count("plat-a-1") <= 1 and "plat-a-2" not in names


async def test_an_api_server_that_refuses_or_is_not_there_is_one_clear_error_and_nothing_is_made(
        kube_api: FakeKubeApi, kubelet: FakeKubelet, tmp_path: Path) -> None:
    kube_api.deny("create", "pods")
    async with platform(kube_api) as made:
        with pytest.raises(PlatformRejected, match=r"refused POST .*pods.*own Role, <job>-master.*deploy/rbac\.yaml"):
            await made.launch(agent())
        kube_api.allow_all()
        await made.launch(agent())  # a launch that failed left nothing behind: the same node launches now
        with pytest.raises(ConfigError, match=r"k8s\.memory 'lots' is not a Kubernetes quantity"):
            await made.launch(agent("m", resources={"memory": "lots"}))
    assert kube_api.get_object("pods", "default", "plat-m-1") is None
    with anyio.fail_after(TIMEOUT_S):
        async with K8sPlatform(SETTINGS, K8sSettings(api_url="http://127.0.0.1:9", request_timeout_s=2,
                                                     image="stead:test"), environ={}) as nowhere:
            with pytest.raises(PlatformUnavailable, match=r"cannot be reached .*check that the cluster is up"):
                await nowhere.launch(agent())
