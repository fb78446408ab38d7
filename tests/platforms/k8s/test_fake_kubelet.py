"""The fake kubelet: pods scheduled and run as local processes, driven through the real kubernetes_asyncio client."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import TEST_IMAGE
from kubernetes_asyncio import client

from stead.core.procs import is_alive
from tests.support.kube import FakeKubeApi, FakeKubelet, local_image_env

pytestmark = pytest.mark.anyio

NS = "default"
#: a guard against a hung test, not a measured duration
TIMEOUT_S = 20.0
SLEEP = "import time; time.sleep(60)"


def pod(name: str, code: str, *args: str, env: list[dict[str, Any]] | None = None, restart: str = "Never",
        **spec: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": TEST_IMAGE, "command": ["python", "-c", code, *args],
                                 "env": env or []}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": restart, "containers": [container], **spec}}


def phase_of(api: FakeKubeApi, name: str) -> str | None:
    obj = api.get_object("pods", NS, name, copy=False)
    return None if obj is None else obj.get("status", {}).get("phase")


async def wait_phase(api: FakeKubeApi, name: str, *phases: str) -> dict[str, Any]:
    await api.wait_for(lambda: phase_of(api, name) in phases, TIMEOUT_S)
    obj = api.get_object("pods", NS, name)
    assert obj is not None
    return obj


async def wait_pod(api: FakeKubeApi, name: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    await api.wait_for(lambda: (obj := api.get_object("pods", NS, name)) is not None and check(obj), TIMEOUT_S)
    obj = api.get_object("pods", NS, name)
    assert obj is not None
    return obj


def container_state(obj: dict[str, Any]) -> dict[str, Any]:
    statuses = obj.get("status", {}).get("containerStatuses") or [{}]
    state: dict[str, Any] = statuses[0].get("state") or {}
    return state


async def test_exit_codes_become_succeeded_and_failed(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                      core_v1: Any) -> None:
    await core_v1.create_namespaced_pod(NS, pod("ok", "print('fine')"))
    await core_v1.create_namespaced_pod(NS, pod("bad", "import sys; sys.exit(3)"))
    ok = await wait_phase(kube_api, "ok", "Succeeded", "Failed")
    bad = await wait_phase(kube_api, "bad", "Succeeded", "Failed")
    assert ok["status"]["phase"] == "Succeeded" and bad["status"]["phase"] == "Failed"
    assert container_state(ok)["terminated"]["reason"] == "Completed"
    terminated = container_state(bad)["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert terminated["startedAt"] and terminated["finishedAt"]
    assert ok["spec"]["nodeName"] in kubelet.nodes and ok["status"]["podIP"] == "127.0.0.1"
    assert ok["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")
    assert await core_v1.read_namespaced_pod_log("ok", NS) == "fine\n"
    assert kubelet.log_path(NS, "ok").read_text() == "fine\n"


async def test_env_comes_from_secrets_field_refs_and_expansion_and_nothing_else(
        kube_api: FakeKubeApi, kubelet: FakeKubelet, core_v1: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEAD_TEST_LEAK", "from-the-test-process")
    await core_v1.create_namespaced_secret(NS, {"metadata": {"name": "job-token"},
                                                "data": {"token": base64.b64encode(b"s3cret").decode()}})
    await core_v1.create_namespaced_config_map(NS, {"metadata": {"name": "settings"}, "data": {"RANKS": "8"}})
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "job-token", "key": "token"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
        {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        {"name": "GREETING", "value": "$(POD) on $(NODE), $$(POD) kept"},
    ]
    code = ("import os, json; print(json.dumps({k: v for k, v in os.environ.items()}))")
    body = pod("envy", code, env=env, container={"envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "C_"}],
                                                  "resources": {"limits": {"memory": "256Mi"}}})
    body["metadata"]["labels"] = {"role": "node"}
    await core_v1.create_namespaced_pod(NS, body)
    done = await wait_phase(kube_api, "envy", "Succeeded", "Failed")
    assert done["status"]["phase"] == "Succeeded"
    import json
    seen = json.loads(kubelet.log_path(NS, "envy").read_text())
    node = done["spec"]["nodeName"]
    assert seen["TOKEN"] == "s3cret" and seen["POD"] == "envy" and seen["NODE"] == node and seen["ROLE"] == "node"
    assert seen["MEM"] == "256" and seen["C_RANKS"] == "8"
    assert seen["GREETING"] == f"envy on {node}, $(POD) kept"
    assert seen["HOSTNAME"] == "envy"
    assert seen["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and seen["KUBERNETES_SERVICE_PORT"] == str(kube_api.port)
    assert "STEAD_TEST_LEAK" not in seen and seen["PATH"] == local_image_env()["PATH"]


async def test_a_missing_secret_is_create_container_config_error_until_it_exists(
        kube_api: FakeKubeApi, kubelet: FakeKubelet, core_v1: Any) -> None:
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "later", "key": "token"}}}]
    await core_v1.create_namespaced_pod(NS, pod("waits", "print('started')", env=env))
    waiting = await wait_pod(kube_api, "waits", lambda o: "waiting" in container_state(o))
    assert waiting["status"]["phase"] == "Pending"
    assert container_state(waiting)["waiting"]["reason"] == "CreateContainerConfigError"
    assert container_state(waiting)["waiting"]["message"] == 'secret "later" not found'
    await core_v1.create_namespaced_secret(NS, {"metadata": {"name": "later"}, "stringData": {"token": "t"}})
    assert (await wait_phase(kube_api, "waits", "Succeeded", "Failed"))["status"]["phase"] == "Succeeded"


async def test_a_memory_empty_dir_is_real_tmpfs_reached_by_path_translation_and_removed_after_deletion(
        kube_api: FakeKubeApi, kubelet: FakeKubelet, core_v1: Any) -> None:
    code = ("import os, sys, time\n"
            "open(os.path.join(sys.argv[1], 'flash'), 'w').write(os.environ['SHM'])\n"
            "open(os.path.join(os.environ['SHM'], 'ready'), 'w').close()\n"
            "time.sleep(60)\n")
    body = pod("shm", code, "/dev/shm", env=[{"name": "SHM", "value": "/dev/shm"}],
               container={"volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]},
               volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}])
    await core_v1.create_namespaced_pod(NS, body)
    await wait_phase(kube_api, "shm", "Running")
    host = kubelet.volume_path(NS, "shm", "dshm")
    await kube_api.wait_for(lambda: (host / "ready").exists(), TIMEOUT_S)
    assert str(host).startswith("/dev/shm/") and host != Path("/dev/shm")
    assert (host / "flash").read_text() == str(host)  # the env value was translated too
    await core_v1.delete_namespaced_pod("shm", NS, grace_period_seconds=1)
    await kube_api.wait_for(lambda: kube_api.get_object("pods", NS, "shm") is None, TIMEOUT_S)
    assert not host.exists()


async def test_a_claim_is_one_directory_for_every_node(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                       core_v1: Any) -> None:
    await core_v1.create_namespaced_persistent_volume_claim(NS, {
        "metadata": {"name": "ckpt"}, "spec": {"accessModes": ["ReadWriteMany"],
                                               "resources": {"requests": {"storage": "1Gi"}}}})
    volumes = [{"name": "data", "persistentVolumeClaim": {"claimName": "ckpt"}}]
    mounts = {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    write = pod("writer", "import sys; open(sys.argv[1], 'w').write('step-7')", "/data/latest", container=mounts,
                volumes=volumes, nodeSelector={"kubernetes.io/hostname": "host-a"})
    await core_v1.create_namespaced_pod(NS, write)
    assert (await wait_phase(kube_api, "writer", "Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
    read = pod("reader", "import sys; print(open(sys.argv[1]).read())", "/data/latest", container=mounts,
               volumes=volumes, nodeSelector={"kubernetes.io/hostname": "host-b"})
    await core_v1.create_namespaced_pod(NS, read)
    done = await wait_phase(kube_api, "reader", "Succeeded", "Failed")
    assert done["spec"]["nodeName"] == "host-b" and done["status"]["phase"] == "Succeeded"
    assert kubelet.log_path(NS, "reader").read_text() == "step-7\n"


async def test_a_pod_mounting_a_missing_claim_is_unschedulable(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                               core_v1: Any) -> None:
    body = pod("claims", "pass", volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "absent"}}])
    await core_v1.create_namespaced_pod(NS, body)
    waiting = await wait_pod(kube_api, "claims", lambda o: any(
        c.get("reason") == "Unschedulable" for c in o["status"].get("conditions") or []))
    assert 'persistentvolumeclaim "absent" not found' in waiting["status"]["conditions"][0]["message"]


async def test_secret_and_config_map_volumes_are_files_and_every_container_runs(
        kube_api: FakeKubeApi, kubelet: FakeKubelet, core_v1: Any) -> None:
    await core_v1.create_namespaced_secret(NS, {"metadata": {"name": "tls"}, "stringData": {"key.pem": "KEY"}})
    await core_v1.create_namespaced_config_map(NS, {"metadata": {"name": "cfg"}, "data": {"job.json": "{}"}})
    reader = {"name": "reader", "image": TEST_IMAGE, "workingDir": "/scratch",
              "command": ["python", "-c", "import sys; open('out', 'w').write(open(sys.argv[1]).read() + "
                                          "open(sys.argv[2]).read())", "/etc/tls/key.pem", "/etc/cfg/job.json"],
              "volumeMounts": [{"name": "tls", "mountPath": "/etc/tls"}, {"name": "cfg", "mountPath": "/etc/cfg"},
                               {"name": "work", "mountPath": "/scratch"}]}
    other = {"name": "other", "image": TEST_IMAGE, "command": ["python", "-c", "print('other')"]}
    await core_v1.create_namespaced_pod(NS, {"metadata": {"name": "files"}, "spec": {
        "restartPolicy": "Never", "containers": [reader, other],
        "volumes": [{"name": "tls", "secret": {"secretName": "tls"}}, {"name": "cfg", "configMap": {"name": "cfg"}},
                    {"name": "work", "hostPath": {"path": "/var/work"}}]}})
    done = await wait_phase(kube_api, "files", "Succeeded", "Failed")
    assert done["status"]["phase"] == "Succeeded" and len(done["status"]["containerStatuses"]) == 2
    out = kubelet.node_dir(done["spec"]["nodeName"]) / "host" / "var" / "work" / "out"
    assert out.read_text() == "KEY{}"
    assert kubelet.log_path(NS, "files", "other").read_text() == "other\n"


async def test_the_kubelet_relists_after_its_watch_expired(tmp_path: Path) -> None:
    # no bookmarks: the kubelet's version stays at the last pod change it saw, older than the config map below
    async with FakeKubeApi(bookmark_interval_s=3600) as api, \
            FakeKubelet(api.url, root=tmp_path / "nodes", images={TEST_IMAGE: local_image_env()}), \
            client.ApiClient(api.configuration()) as api_client:
        core = client.CoreV1Api(api_client)
        await core.create_namespaced_config_map(NS, {"metadata": {"name": "newer"}})
        api.compact()
        api.close_watches()  # the kubelet resumes from a version history no longer has: 410, then a new list
        await core.create_namespaced_pod(NS, pod("after", "pass"))
        assert (await wait_phase(api, "after", "Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
        assert api.requests[("list", "pods")] == 2


async def test_graceful_deletion_sends_sigterm_then_removes_the_pod(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                                    core_v1: Any) -> None:
    code = ("import signal, sys, time\n"
            "def bye(*_):\n"
            "    print('got SIGTERM', flush=True)\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    await core_v1.create_namespaced_pod(NS, pod("graceful", code, terminationGracePeriodSeconds=20))
    await wait_phase(kube_api, "graceful", "Running")
    log = kubelet.log_path(NS, "graceful")
    await kube_api.wait_for(lambda: log.exists() and "ready" in log.read_text(), TIMEOUT_S)
    pid = kubelet.pid(NS, "graceful")
    assert pid is not None
    await core_v1.delete_namespaced_pod("graceful", NS)
    held = kube_api.get_object("pods", NS, "graceful")
    assert held is None or held["metadata"]["deletionGracePeriodSeconds"] == 20
    await kube_api.wait_for(lambda: kube_api.get_object("pods", NS, "graceful") is None, TIMEOUT_S)
    assert log.read_text() == "ready\ngot SIGTERM\n" and not is_alive(pid)


async def test_a_process_over_its_memory_limit_is_oom_killed(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                             core_v1: Any) -> None:
    code = "import time; hog = b'x' * (300 << 20); time.sleep(60)"
    await core_v1.create_namespaced_pod(NS, pod("hog", code, container={"resources": {"limits": {"memory": "64Mi"}}}))
    done = await wait_phase(kube_api, "hog", "Failed", "Succeeded")
    terminated = container_state(done)["terminated"]
    assert (done["status"]["phase"], terminated["exitCode"], terminated["reason"]) == ("Failed", 137, "OOMKilled")


async def test_oom_kill_on_demand_reports_oom_killed(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                     core_v1: Any) -> None:
    await core_v1.create_namespaced_pod(NS, pod("victim", SLEEP))
    await wait_phase(kube_api, "victim", "Running")
    await kubelet.oom_kill(NS, "victim")
    done = await wait_phase(kube_api, "victim", "Failed")
    assert container_state(done)["terminated"]["reason"] == "OOMKilled"
    assert container_state(done)["terminated"]["exitCode"] == 137


async def test_on_failure_restarts_the_container_and_counts_restarts(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                                     core_v1: Any, tmp_path: Path) -> None:
    code = ("import os, sys\n"
            "marker = sys.argv[1]\n"
            "if not os.path.exists(marker):\n"
            "    open(marker, 'w').close()\n"
            "    sys.exit(1)\n")
    await core_v1.create_namespaced_pod(NS, pod("retry", code, str(tmp_path / "marker"), restart="OnFailure"))
    done = await wait_phase(kube_api, "retry", "Succeeded", "Failed")
    status = done["status"]["containerStatuses"][0]
    assert done["status"]["phase"] == "Succeeded" and status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 1


async def test_an_unknown_image_waits_in_err_image_pull(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                        core_v1: Any) -> None:
    body = pod("nope", "pass", container={"image": "registry.example/nope:1"})
    await core_v1.create_namespaced_pod(NS, body)
    waiting = await wait_pod(kube_api, "nope", lambda o: "waiting" in container_state(o))
    assert waiting["status"]["phase"] == "Pending"
    assert container_state(waiting)["waiting"]["reason"] == "ErrImagePull"
    backoff = await wait_pod(kube_api, "nope", lambda o: container_state(o).get("waiting", {}).get(
        "reason") == "ImagePullBackOff")
    assert backoff["status"]["phase"] == "Pending"
    await core_v1.create_namespaced_pod(NS, pod("invalid", "pass", container={"image": "Has:Upper:Case"}))
    invalid = await wait_pod(kube_api, "invalid", lambda o: "waiting" in container_state(o))
    assert container_state(invalid)["waiting"]["reason"] == "InvalidImageName"
    await core_v1.delete_namespaced_pod("nope", NS)  # a pod that never started is finalized at once
    await kube_api.wait_for(lambda: kube_api.get_object("pods", NS, "nope") is None, TIMEOUT_S)


async def test_node_affinity_not_in_keeps_pods_off_a_host(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                          core_v1: Any) -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["host-a"]}]}]}}}
    names = [f"p{i}" for i in range(6)]
    for name in names:
        await core_v1.create_namespaced_pod(NS, pod(name, SLEEP, affinity=affinity))
    for name in names:
        await wait_phase(kube_api, name, "Running")
    nodes = {kube_api.get_object("pods", NS, name)["spec"]["nodeName"] for name in names}  # type: ignore[index]
    assert nodes == {"host-b", "host-c"}


async def test_a_full_node_leaves_pods_unschedulable_until_one_ends(kube_api: FakeKubeApi, tmp_path: Path,
                                                                    core_v1: Any) -> None:
    gate = tmp_path / "gate"
    waits_for_gate = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.02)"
    async with FakeKubelet(kube_api.url, nodes=("solo",), root=tmp_path / "nodes", max_pods_per_node=1,
                           images={TEST_IMAGE: local_image_env()}):
        await core_v1.create_namespaced_pod(NS, pod("first", waits_for_gate))
        await wait_phase(kube_api, "first", "Running")
        await core_v1.create_namespaced_pod(NS, pod("second", "pass"))
        pending = await wait_pod(kube_api, "second", lambda o: bool(o["status"].get("conditions")))
        condition = pending["status"]["conditions"][0]
        assert (condition["type"], condition["status"], condition["reason"]) == ("PodScheduled", "False",
                                                                                 "Unschedulable")
        assert condition["message"].startswith("0/1 nodes are available: 1 Too many pods.")
        assert pending["status"]["phase"] == "Pending" and not pending["spec"].get("nodeName")
        gate.touch()
        assert (await wait_phase(kube_api, "second", "Succeeded", "Failed"))["status"]["phase"] == "Succeeded"


async def test_cordon_and_capacity_steer_scheduling(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                    core_v1: Any) -> None:
    await kubelet.cordon("host-a")
    await kubelet.set_capacity("host-b", pods=0)
    for name in ("c1", "c2"):
        await core_v1.create_namespaced_pod(NS, pod(name, SLEEP))
    for name in ("c1", "c2"):
        assert (await wait_phase(kube_api, name, "Running"))["spec"]["nodeName"] == "host-c"
    node = await core_v1.read_node("host-a")
    assert node.spec.unschedulable and node.metadata.labels["kubernetes.io/hostname"] == "host-a"


async def test_a_failed_node_loses_its_pods_and_its_directories(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                                core_v1: Any) -> None:
    await core_v1.create_namespaced_pod(NS, pod("lost", SLEEP, nodeSelector={"kubernetes.io/hostname": "host-a"}))
    await wait_phase(kube_api, "lost", "Running")
    pid = kubelet.pid(NS, "lost")
    assert pid is not None and kubelet.node_dir("host-a").exists()
    await kubelet.fail_node("host-a")
    lost = await wait_phase(kube_api, "lost", "Failed")
    assert lost["status"]["reason"] == "NodeLost" and "host-a" in lost["status"]["message"]
    assert not is_alive(pid) and not kubelet.node_dir("host-a").exists()
    ready = next(c for c in (await core_v1.read_node("host-a")).status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("Unknown", "NodeStatusUnknown")
    await core_v1.create_namespaced_pod(NS, pod("elsewhere", "pass"))
    assert (await wait_phase(kube_api, "elsewhere", "Succeeded"))["spec"]["nodeName"] != "host-a"
    await kubelet.recover_node("host-a")
    await core_v1.create_namespaced_pod(NS, pod("back", "pass", nodeSelector={"kubernetes.io/hostname": "host-a"}))
    assert (await wait_phase(kube_api, "back", "Succeeded", "Failed"))["status"]["phase"] == "Succeeded"


async def test_eviction_fails_the_pod_with_the_reason(kube_api: FakeKubeApi, kubelet: FakeKubelet,
                                                      core_v1: Any) -> None:
    await core_v1.create_namespaced_pod(NS, pod("evicted", SLEEP))
    await wait_phase(kube_api, "evicted", "Running")
    await kubelet.evict(NS, "evicted", message="The node was low on resource: memory. ")
    done = await wait_phase(kube_api, "evicted", "Failed")
    assert (done["status"]["reason"], done["status"]["message"]) == ("Evicted",
                                                                     "The node was low on resource: memory. ")
    assert any(c["type"] == "DisruptionTarget" for c in done["status"]["conditions"])


async def test_kubelet_exit_kills_and_reaps_its_processes(kube_api: FakeKubeApi, tmp_path: Path,
                                                          core_v1: Any) -> None:
    async with FakeKubelet(kube_api.url, root=tmp_path / "nodes", images={TEST_IMAGE: local_image_env()}) as fake:
        await core_v1.create_namespaced_pod(NS, pod("sleeper", SLEEP))
        await wait_phase(kube_api, "sleeper", "Running")
        pid = fake.pid(NS, "sleeper")
        assert pid is not None and is_alive(pid)
    assert not is_alive(pid)
    assert not (tmp_path / "nodes" / "host-a").exists()


async def test_run_false_marks_300_concurrent_pods_running(kube_api: FakeKubeApi, tmp_path: Path,
                                                           core_v1: Any) -> None:
    names = [f"bench-{i}" for i in range(300)]
    async with FakeKubelet(kube_api.url, root=tmp_path / "nodes", run=False, images={TEST_IMAGE: {}}):
        await asyncio.gather(*(core_v1.create_namespaced_pod(NS, pod(name, "pass")) for name in names))
        await kube_api.wait_for(lambda: all(phase_of(kube_api, name) == "Running" for name in names), TIMEOUT_S)
        placed = [kube_api.get_object("pods", NS, name)["spec"]["nodeName"] for name in names]  # type: ignore[index]
        assert {placed.count(node) for node in ("host-a", "host-b", "host-c")} == {100}
        await core_v1.delete_collection_namespaced_pod(NS)
        await kube_api.wait_for(lambda: not kube_api.objects("pods", NS, copy=False), TIMEOUT_S)
