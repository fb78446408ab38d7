"""The objects the Kubernetes platform asks for, checked offline: valid for the API, and carrying what stead needs."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.platform import HOST_ENV, NodeSpec
from stead.platforms.k8s import names
from stead.platforms.k8s.jobs import MasterSpec
from stead.platforms.k8s.launcher import run_arguments
from stead.platforms.k8s.manifests import custom_resource_definition, example_job
from stead.platforms.k8s.operator import master_spec
from stead.platforms.k8s.pods import (
    TOKEN_FILE,
    JobObjects,
    Owner,
    master_pod,
    master_service,
    node_pod,
    passed_env,
    token_secret,
)
from stead.platforms.k8s.settings import K8sSettings
from stead.platforms.k8s.status import Ended, view
from tests.support.kube_validate import validate_builtin, validate_custom

SETTINGS = K8sSettings(image="stead:test", memory="8Gi", cpu="4", checkpoint_claim="ckpts", ptrace=True,
                       node_selector="pool=gpu", tolerations='[{"key": "gpu", "operator": "Exists"}]')
OWNER = Owner("stead.dev/v1", "SteadJob", "demo", "0f0e0d0c-0000-4000-8000-000000000001")
OBJECTS = JobObjects(job="demo", namespace="jobs", master_address="demo-master.jobs.svc:50051", owner=OWNER)
AGENT = NodeSpec(job="demo", node_id="node-3", incarnation=2, env={"STEAD_RUN_SPEC": '{"job_name": "demo"}'},
                 command=("/opt/venv/bin/python3", "-m", "stead", "agent", "--master", "127.0.0.1:4000",
                          "--token-file", "/home/me/.stead/demo.token", "--node-id", "node-3", "--incarnation", "2"))


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod["spec"]["containers"][0]
    return container


def test_a_node_pod_is_valid_for_the_api_and_named_by_its_node_and_incarnation() -> None:
    pod = node_pod(AGENT, OBJECTS, SETTINGS, env={"STEAD_CKPT_KEEP_LAST": "3"}, avoid_hosts=["host-b"])
    validate_builtin(pod)
    assert pod["metadata"]["name"] == "demo-node-3-2"
    labels = pod["metadata"]["labels"]
    assert labels[names.LABEL_JOB] == "demo" and labels[names.LABEL_NODE_ID] == "node-3"
    assert labels[names.LABEL_INCARNATION] == "2"
    assert labels[names.DLROVER_JOB] == "demo" and labels[names.DLROVER_REPLICA_TYPE] == "worker"
    assert labels[names.DLROVER_REPLICA_INDEX] == "3" and labels[names.DLROVER_RELAUNCH_COUNT] == "1"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    assert pod["spec"]["restartPolicy"] == "Never"


def test_a_node_pod_runs_the_images_python_against_the_masters_service_with_the_token_from_its_secret() -> None:
    pod = node_pod(AGENT, OBJECTS, SETTINGS)
    command = _container(pod)["command"]
    assert command[0] == "python"
    assert command[command.index("--master") + 1] == "demo-master.jobs.svc:50051"
    assert command[command.index("--token-file") + 1] == TOKEN_FILE
    token = next(v for v in pod["spec"]["volumes"] if v["name"] == "token")
    assert token["secret"]["secretName"] == names.secret_name("demo")
    assert not any("token" in str(e.get("value", "")).lower() for e in _container(pod)["env"])


def test_a_node_pod_has_a_memory_dev_shm_the_checkpoint_claim_and_its_host_in_the_environment() -> None:
    pod = node_pod(AGENT, OBJECTS, SETTINGS)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpts"}
    mounts = {m["mountPath"] for m in _container(pod)["volumeMounts"]}
    assert {"/dev/shm", "/stead/checkpoints"} <= mounts
    env = {e["name"]: e for e in _container(pod)["env"]}
    assert env[HOST_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["STEAD_CKPT_DIR"]["value"] == "/stead/checkpoints"
    assert env["STEAD_RUN_SPEC"]["value"] == '{"job_name": "demo"}'
    assert _container(pod)["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"},
                                            "limits": {"cpu": "4", "memory": "8Gi"}}
    assert _container(pod)["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]


def test_excluded_hosts_become_node_anti_affinity_and_more_memory_overrides_the_setting() -> None:
    pod = node_pod(AGENT, OBJECTS, SETTINGS, avoid_hosts=["host-c", "host-a"], memory="12Gi")
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["host-a", "host-c"]}]}]
    assert _container(pod)["resources"]["limits"]["memory"] == "12Gi"


@pytest.mark.parametrize(("settings", "message"), [
    (K8sSettings(), "k8s.image"),
    (K8sSettings(image="x", memory="lots"), "k8s.memory 'lots' is not a Kubernetes quantity"),
    (K8sSettings(image="x", shm_size="1 GB"), "k8s.shm_size"),
    (K8sSettings(image="x", node_selector="pool"), "k8s.node_selector item 'pool' must be key=value"),
    (K8sSettings(image="x", env="{"), "k8s.env is not JSON"),
    (K8sSettings(image="x", tolerations='{"key": 1}'), "k8s.tolerations must be a JSON list"),
])
def test_a_setting_kubernetes_would_refuse_is_a_clear_error_before_anything_is_made(settings: K8sSettings,
                                                                                    message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        node_pod(AGENT, OBJECTS, settings)


def test_the_master_pod_its_service_and_the_token_secret_are_valid_and_keep_the_token_out_of_the_spec() -> None:
    pod = master_pod(OBJECTS, SETTINGS, name="demo-master-1", store_url="etcd://etcd:2379",
                     run_args=["--nnodes", "2", "train.py"])
    service = master_service(OBJECTS, SETTINGS)
    secret = token_secret("demo", "jobs", "t" * 43, owner=OWNER)
    for obj in (pod, service, secret):
        validate_builtin(obj)
    command = _container(pod)["command"]
    assert command[command.index("--") + 1:] == ["--nnodes", "2", "train.py"]
    assert command[command.index("--host") + 1] == "$(POD_IP)"
    token_env = next(e for e in _container(pod)["env"] if e["name"] == "STEAD_JOB_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"] == {"name": "demo-token", "key": "token"}
    assert service["spec"]["selector"] == {names.LABEL_JOB: "demo", names.LABEL_ROLE: names.ROLE_MASTER}
    assert pod["metadata"]["labels"][names.DLROVER_REPLICA_TYPE] == "dlrover-master"


def test_only_settings_of_the_masters_environment_reach_the_pods() -> None:
    env = {"STEAD_HEARTBEAT_TIMEOUT_S": "10", "STEAD_CKPT_KEEP_LAST": "3", "STEAD_JOB_TOKEN": "secret",
           "STEAD_LOCAL_NODE": "a/b/1", "HOME": "/home/me", "STEAD_K8S_IMAGE": "x",
           # the master's own credentials: its pod's files, mounted anew where a pod needs them
           "STEAD_METRICS_HOST": "10.0.0.7", "STEAD_METRICS_TOKEN_FILE": "/var/run/stead-metrics/token",
           "STEAD_ETCD_PASSWORD_FILE": "/var/run/stead-etcd/auth/password"}
    assert passed_env(env, Settings(), ["ckpt", "scaler"]) == {"STEAD_HEARTBEAT_TIMEOUT_S": "10",
                                                               "STEAD_CKPT_KEEP_LAST": "3"}


def _pod(phase: str, *, terminated: dict[str, Any] | None = None, waiting: dict[str, Any] | None = None,
         reason: str = "", message: str = "", scheduled: dict[str, Any] | None = None,
         running: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if terminated is not None:
        state["terminated"] = terminated
    if waiting is not None:
        state["waiting"] = waiting
    if running:
        state["running"] = {"startedAt": "2026-11-25T10:00:00Z"}
    status: dict[str, Any] = {"phase": phase, "containerStatuses": [{"name": "agent", "state": state}] if state else []}
    if reason:
        status["reason"], status["message"] = reason, message
    if scheduled is not None:
        status["conditions"] = [{"type": "PodScheduled", **scheduled}]
    return {"metadata": {"name": "demo-node-0-1", "creationTimestamp": "2026-11-25T10:00:00Z",
                         "labels": {names.LABEL_NODE_ID: "node-0", names.LABEL_INCARNATION: "1"}},
            "spec": {"nodeName": "host-a"}, "status": status}


@pytest.mark.parametrize(("pod", "ended"), [
    (_pod("Succeeded", terminated={"exitCode": 0, "reason": "Completed"}), Ended(0, None, "")),
    (_pod("Failed", terminated={"exitCode": 3, "reason": "Error"}), Ended(3, None, "")),
    (_pod("Failed", terminated={"exitCode": 137, "reason": "OOMKilled"}),
     Ended(None, signal.SIGKILL, "OOMKilled", oom=True)),
    (_pod("Failed", terminated={"exitCode": 137, "reason": "Error"}), Ended(None, signal.SIGKILL, "")),
    (_pod("Failed", terminated={"exitCode": 143, "reason": "Error"}), Ended(None, signal.SIGTERM, "")),
    (_pod("Failed", terminated={"exitCode": 137}, reason="Evicted", message="The node was low on memory."),
     Ended(None, signal.SIGKILL, "Evicted: The node was low on memory.")),
    (_pod("Failed", reason="NodeLost", message="node host-a is not responding"),
     Ended(None, None, "NodeLost: node host-a is not responding")),
    (_pod("Running", running=True), None),
])
def test_how_a_pod_ended_is_read_from_its_status(pod: dict[str, Any], ended: Ended | None) -> None:
    found = view(pod)
    assert found is not None and found.ended == ended
    assert found.host == "host-a" and (found.node_id, found.incarnation) == ("node-0", 1)


def test_a_pod_that_can_never_start_or_is_not_scheduled_says_why() -> None:
    pulling = view(_pod("Pending", waiting={"reason": "ErrImagePull", "message": "pull access denied for nope"}))
    assert pulling is not None and pulling.cannot_start == "ErrImagePull: pull access denied for nope"
    creating = view(_pod("Pending", waiting={"reason": "ContainerCreating"}))
    assert creating is not None and creating.cannot_start == "" and not creating.running
    pending = view(_pod("Pending", scheduled={"status": "False", "reason": "Unschedulable",
                                              "message": "0/3 nodes are available"}))
    assert pending is not None and pending.unschedulable == "Unschedulable: 0/3 nodes are available"
    assert view({"metadata": {"name": "x", "labels": {}}}) is None


def test_the_master_pod_gets_the_run_arguments_without_this_machines_flags() -> None:
    argv = ["--platform", "k8s", "--store=etcd://e:2379", "--job-name", "demo", "--nnodes", "2",
            "--set", "k8s.api_url=http://127.0.0.1:1", "--set=k8s.kubeconfig=/home/me/.kube/config",
            "--set", "k8s.image=img", "--set= k8s.pending_timeout_s=5", "--set", "ckpt.keep_last=3", "train.py",
            "--lr", "0.1"]
    # every k8s setting reaches the master once, from master_args as this command resolved it (5 -> 5.0): the
    # master refuses a setting given twice with two values
    assert run_arguments(argv) == ("--nnodes", "2", "--set", "ckpt.keep_last=3", "train.py", "--lr", "0.1")
    spec = MasterSpec(job="demo", store_url="etcd://e:2379", run_args=("train.py",),
                      settings=K8sSettings(image="img", memory="4Gi", api_url="http://laptop", ptrace=True,
                                           pod_api_url="http://in-cluster"))
    assert spec.master_args() == ["--set=k8s.image=img", "--set=k8s.memory=4Gi", "--set=k8s.ptrace=true",
                                  "--set=k8s.api_url=http://in-cluster", "train.py"]


def test_a_steadjob_becomes_the_same_master_stead_run_would_start() -> None:
    job = next(o for o in example_job("jobs") if o["kind"] == "SteadJob")
    validate_custom(job, custom_resource_definition())
    made = master_spec("example", job["spec"], K8sSettings())
    assert made.store_url == job["spec"]["store"]
    assert made.run_args[:2] == ("--nnodes", job["spec"]["nnodes"])
    assert made.run_args[-len(job["spec"]["command"]):] == tuple(job["spec"]["command"])
    assert made.settings.image == job["spec"]["image"]
    assert made.settings.checkpoint_claim == job["spec"]["checkpointVolume"]["claimName"]
    pod = master_pod(JobObjects(job="example", namespace="jobs", master_address="x:1"), made.settings,
                     name="example-master-1", store_url=made.store_url, run_args=made.master_args())
    validate_builtin(pod)
    assert json.dumps(pod).count("--nnodes") == 1
