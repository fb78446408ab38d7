"""The operator (kopf, in the test's event loop) against the test API server.

No kubelet here: the master pods it makes stay unscheduled, and the tests play their
lives (deleted, ended) through the API, so that only the operator's part is under test.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import kopf
import pytest

from stead.core.events import JobSubmitted, NodeRequested
from stead.core.events.log import EventLog
from stead.core.store import open_store
from stead.platforms.k8s import JOBS, PODS, SERVICE_ACCOUNTS, Kube, Resource, operator
from stead.platforms.k8s.manifests import custom_resource_definition
from stead.platforms.k8s.settings import K8sSettings
from tests.support.kube import FakeKubeApi

pytestmark = pytest.mark.anyio

TIMEOUT_S = 30.0
CRDS = Resource("customresourcedefinitions", group="apiextensions.k8s.io", namespaced=False)


def steadjob(name: str, store: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "stead.dev/v1", "kind": "SteadJob", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nnodes": "2", "nprocPerNode": 1, "image": "stead:test", "command": ["train.py"],
                     "store": store, "resources": {"limits": {"memory": "8Gi"}}, **spec}}


@asynccontextmanager
async def running(registry: Any) -> AsyncIterator[None]:
    """The operator, run in this test's event loop as ``stead operator`` runs it (kopf until a stop flag).

    One loop, not kopf's threaded test runner: a runner's stop blocks the loop that serves the test API
    server, so a handler still in flight got no answer until its timeout (and the runner gave up on
    the operator), and etcd's gRPC client delivers its replies through one loop per process.
    """
    settings = kopf.OperatorSettings()
    settings.process.ultimate_exiting_timeout = None  # kopf's last resort kills its thread: pytest's here
    stop = asyncio.Event()
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(partial(kopf.operator, registry=registry, settings=settings, standalone=True,
                                     namespaces=["default"], stop_flag=stop))
            try:
                yield
            finally:
                stop.set()
    finally:
        loop = asyncio.get_running_loop()
        for number in (signal.SIGINT, signal.SIGTERM):  # kopf's, in the main thread; pytest's own again
            loop.remove_signal_handler(number)


async def until(api: FakeKubeApi, holds: Callable[[], bool]) -> None:
    await api.wait_for(holds, timeout_s=TIMEOUT_S)


def _pod(api: FakeKubeApi, name: str) -> dict[str, Any] | None:
    return api.get_object("pods", "default", name)


def _status(api: FakeKubeApi, job: str) -> dict[str, Any]:
    found = api.get_object("steadjobs", "default", job)
    return dict((found or {}).get("status") or {})


async def test_a_steadjob_gets_its_objects_and_master_a_deleted_master_is_replaced_and_its_end_is_mirrored(
        kube_api: FakeKubeApi, tmp_path: Path) -> None:
    base = K8sSettings(api_url=kube_api.url, pod_api_url=kube_api.url, master_host="127.0.0.1")
    async with Kube(base, pool=2) as kube:
        await kube.create(CRDS, custom_resource_definition())
        async with running(operator.registry(base)):
            made = await kube.create(JOBS, steadjob("demo", "etcd://127.0.0.1:2379"))
            assert made is not None
            uid = made["metadata"]["uid"]
            await until(kube_api, lambda: _pod(kube_api, "demo-master-1") is not None)
            pod = _pod(kube_api, "demo-master-1")
            assert pod is not None and pod["metadata"]["ownerReferences"][0]["uid"] == uid
            command = pod["spec"]["containers"][0]["command"]
            assert command[command.index("--") + 1:][-1] == "train.py" and "--set=k8s.memory=8Gi" in command
            assert pod["spec"]["serviceAccountName"] == "demo-master"  # the job's own, reading only its Secret
            for kind, name in (("secrets", "demo-token"), ("services", "demo-master"),
                               ("networkpolicies", "demo-isolation"), ("networkpolicies", "demo-master"),
                               ("serviceaccounts", "demo-master"), ("roles", "demo-master"),
                               ("rolebindings", "demo-master")):
                owned = kube_api.get_object(kind, "default", name)
                assert owned is not None and owned["metadata"]["ownerReferences"][0]["uid"] == uid, kind
            await until(kube_api, lambda: _status(kube_api, "demo").get("master") == "demo-master-1")

            await kube.delete(PODS, "demo-master-1", grace_period_s=0)  # evicted, preempted, deleted by hand
            await until(kube_api, lambda: _pod(kube_api, "demo-master-2") is not None)

            await kube.patch(PODS, "demo-master-2", {"status": {"phase": "Succeeded", "containerStatuses": [
                {"name": "master", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}},
                subresource="status")
            await until(kube_api, lambda: _status(kube_api, "demo").get("phase") == "Succeeded")
            await anyio.sleep(0.5)
            assert _pod(kube_api, "demo-master-3") is None  # an ended job gets no new master

            await kube.delete(JOBS, "demo")  # the job's objects go with it (garbage collection)
            await until(kube_api, lambda: not kube_api.objects("secrets", "default")
                        and not kube_api.objects("services", "default"))


async def test_a_suspended_job_has_no_pods_and_resumes_when_unsuspended(kube_api: FakeKubeApi) -> None:
    base = K8sSettings(api_url=kube_api.url, master_host="127.0.0.1")
    async with Kube(base, pool=2) as kube:
        await kube.create(CRDS, custom_resource_definition())
        async with running(operator.registry(base)):
            await kube.create(JOBS, steadjob("held", "etcd://127.0.0.1:2379", suspend=True))
            await until(kube_api, lambda: _status(kube_api, "held").get("phase") == "Suspended")
            assert not kube_api.objects("pods", "default")
            await kube.patch(JOBS, "held", {"spec": {"suspend": False}})
            await until(kube_api, lambda: _pod(kube_api, "held-master-1") is not None
                        and _status(kube_api, "held").get("phase") == "Pending")
            await kube.patch(JOBS, "held", {"spec": {"suspend": True}})
            await until(kube_api, lambda: _status(kube_api, "held").get("phase") == "Suspended")
            assert not kube_api.objects("pods", "default")


async def test_a_running_jobs_status_is_read_from_its_store(kube_api: FakeKubeApi, tmp_path: Path,
                                                           etcd_url: str) -> None:
    store = await open_store(etcd_url)
    try:
        log = EventLog(store, "watched")
        await log.append(JobSubmitted(job="watched", min_nodes=1, max_nodes=2, nproc_per_node=1, start_nodes=2))
        await log.append(NodeRequested(node_id="node-0", incarnation=1))
    finally:
        await store.close()
    base = K8sSettings(api_url=kube_api.url, master_host="127.0.0.1")
    async with Kube(base, pool=2) as kube:
        await kube.create(CRDS, custom_resource_definition())
        async with running(operator.registry(base, status_interval_s=0.2)):
            await kube.create(JOBS, steadjob("watched", etcd_url))
            await until(kube_api, lambda: "targetNodes" in _status(kube_api, "watched"))
            status = _status(kube_api, "watched")
            assert status["phase"] == "Pending" and status["targetNodes"] == 2 and status["nodes"] == 1
            assert 0.0 <= status["goodput"] <= 1.0


async def test_a_steadjob_asking_for_what_the_operator_does_not_allow_is_refused_with_the_reason(
        kube_api: FakeKubeApi) -> None:
    base = K8sSettings(api_url=kube_api.url, master_host="127.0.0.1", allowed_service_accounts="shared",
                       allowed_env_secrets="wandb")
    other_token = [{"name": "STOLEN", "valueFrom": {"secretKeyRef": {"name": "victim-token", "key": "token"}}}]
    allowed_env = [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}}]
    async with Kube(base, pool=2) as kube:
        await kube.create(CRDS, custom_resource_definition())
        async with running(operator.registry(base)):
            await kube.create(JOBS, steadjob("greedy", "etcd://127.0.0.1:2379", serviceAccountName="admin",
                                             env=other_token))
            await kube.create(JOBS, steadjob("sneaky", "etcd://127.0.0.1:2379",
                                             settings={"k8s.service_account": "admin"}))
            await kube.create(JOBS, steadjob("modest", "etcd://127.0.0.1:2379", serviceAccountName="shared",
                                             env=allowed_env))
            await until(kube_api, lambda: _status(kube_api, "greedy").get("phase") == "Failed"
                        and _status(kube_api, "sneaky").get("phase") == "Failed"
                        and _pod(kube_api, "modest-master-1") is not None)
            message = _status(kube_api, "greedy")["message"]
            assert "spec.serviceAccountName=admin" in message and "k8s.allowed_service_accounts" in message
            assert "spec.env[0].valueFrom.secretKeyRef.name=victim-token" in message
            assert "k8s.allowed_env_secrets" in message
            assert "spec.settings.k8s.service_account" in _status(kube_api, "sneaky")["message"]
            await until(kube_api, lambda: any(e.get("reason") == "Refused" and "victim-token" in e.get("message", "")
                                              for e in kube_api.objects("events", "default")))
            # nothing was made for a refused job: no master, no Secret, no RBAC
            names = {o["metadata"]["name"] for kind in ("pods", "secrets", "roles", "serviceaccounts")
                     for o in kube_api.objects(kind, "default")}
            assert not {n for n in names if n.startswith(("greedy", "sneaky"))}
            modest = _pod(kube_api, "modest-master-1")
            assert modest is not None and modest["spec"]["serviceAccountName"] == "shared"
            binding = kube_api.get_object("rolebindings", "default", "modest-master")
            assert binding is not None and binding["subjects"][0]["name"] == "shared"
            assert kube_api.get_object("serviceaccounts", "default", "modest-master") is None


async def test_an_operator_restart_keeps_a_running_job_and_a_spec_changed_to_a_refused_one_gets_no_new_master(
        kube_api: FakeKubeApi) -> None:
    lenient = K8sSettings(api_url=kube_api.url, master_host="127.0.0.1", allowed_service_accounts="shared",
                          master_image="stead:operator")
    strict = K8sSettings(api_url=kube_api.url, master_host="127.0.0.1", master_image="stead:operator")
    async with Kube(lenient, pool=2) as kube:
        await kube.create(CRDS, custom_resource_definition())
        async with running(operator.registry(lenient)):
            await kube.create(JOBS, steadjob("kept", "etcd://127.0.0.1:2379", serviceAccountName="shared"))
            await until(kube_api, lambda: _status(kube_api, "kept").get("master") == "kept-master-1")
        pod = _pod(kube_api, "kept-master-1")
        assert pod is not None and pod["spec"]["containers"][0]["image"] == "stead:operator"  # never the job's
        # restarted with a stricter configuration: the running job is not failed ...
        async with running(operator.registry(strict)):
            await kube.delete(PODS, "kept-master-1", grace_period_s=0)
            await until(kube_api, lambda: _pod(kube_api, "kept-master-2") is not None)  # ... and keeps a master
            assert _status(kube_api, "kept")["phase"] == "Pending"

            # its spec changed: what it asks for now is checked before a new master runs it
            await kube.patch(JOBS, "kept", {"spec": {"settings": {"ckpt.keep_last": "2"}}})
            await kube.delete(PODS, "kept-master-2", grace_period_s=0)
            await until(kube_api, lambda: _status(kube_api, "kept").get("phase") == "Failed")
            message = _status(kube_api, "kept")["message"]
            assert "spec.serviceAccountName=shared" in message and "delete it and create it again" in message
            await until(kube_api, lambda: any(e.get("reason") == "Refused" and "shared" in e.get("message", "")
                                              for e in kube_api.objects("events", "default")))
            assert _pod(kube_api, "kept-master-3") is None


async def test_a_job_never_takes_over_an_object_it_did_not_make(kube_api: FakeKubeApi) -> None:
    base = K8sSettings(api_url=kube_api.url, master_host="127.0.0.1", master_image="stead:operator")
    async with Kube(base, pool=2) as kube:
        await kube.create(CRDS, custom_resource_definition())
        await kube.create(SERVICE_ACCOUNTS, {"apiVersion": "v1", "kind": "ServiceAccount",
                                             "metadata": {"name": "taken-master", "namespace": "default"}})
        async with running(operator.registry(base)):
            await kube.create(JOBS, steadjob("taken", "etcd://127.0.0.1:2379"))
            await kube.create(JOBS, steadjob("stead", "etcd://127.0.0.1:2379"))  # its account: the shared one
            await until(kube_api, lambda: _status(kube_api, "taken").get("phase") == "Failed"
                        and _status(kube_api, "stead").get("phase") == "Failed")
        assert ("ServiceAccount 'taken-master' in namespace default is there already and is not job 'taken''s"
                in _status(kube_api, "taken")["message"])
        assert "stead-master, the ServiceAccount that jobs allowed to cordon hosts share" in _status(
            kube_api, "stead")["message"]
        account = kube_api.get_object("serviceaccounts", "default", "taken-master")
        assert account is not None and not account["metadata"].get("ownerReferences")  # left as it was
        assert not kube_api.objects("pods", "default") and kube_api.get_object("roles", "default", "taken-master") \
            is None
