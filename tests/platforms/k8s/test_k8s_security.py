"""Least privilege on Kubernetes, checked offline: every pod stead makes passes the "restricted" Pod Security
Standard, reads its Secrets as a non-root user, and a job gets nothing escalating that its configuration does not
allow."""

from __future__ import annotations

import dataclasses
import json
import re
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from stead.core.errors import ConfigError, PlatformRejected, PlatformUnavailable
from stead.core.platform import NodeSpec
from stead.platforms.k8s import NODES, PODS, ROLES, SERVICE_ACCOUNTS, Kube, Resource, manifests, operator
from stead.platforms.k8s.etcd import generate_secrets
from stead.platforms.k8s.pods import JobObjects, master_pod, node_pod
from stead.platforms.k8s.policy import (
    OPERATOR_FIELDS,
    JobRefused,
    check_allowed,
    check_run_args,
    check_store,
    refusals,
)
from stead.platforms.k8s.settings import K8sSettings
from tests.support.kube import FakeKubeApi
from tests.support.kube_validate import pod_security_violations, validate_builtin

pytestmark = pytest.mark.anyio

IMAGE = "registry.example.com/team/stead:1.0"
OBJECTS = JobObjects(job="demo", namespace="jobs", master_address="demo-master.jobs.svc:50051")
AGENT = NodeSpec(job="demo", node_id="node-0", incarnation=1, command=("python", "-m", "stead", "agent", "--master",
                                                                       "x:1", "--token-file", "/t"))
PLAIN = K8sSettings(image=IMAGE)
EVERYTHING_ON = K8sSettings(image=IMAGE, checkpoint_claim="ckpts", memory="8Gi", gpus=8, metrics_port=9400,
                            metrics_token_secret="stead-metrics", etcd_client_secret="stead-etcd-client",
                            etcd_user="stead", etcd_auth_secret="stead-etcd-auth",
                            env='[{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", '
                                '"key": "key"}}}]')


def _master(settings: K8sSettings) -> dict[str, Any]:
    return master_pod(OBJECTS, settings, name="demo-master-1", store_url="etcd://stead-etcd:2379",
                      run_args=["train.py"])


def _every_pod() -> list[tuple[str, dict[str, Any]]]:
    rendered = manifests.render("jobs", IMAGE, with_etcd=True, with_example=True, with_node_cordon=True)
    workloads = [(f"{o['kind']}/{o['metadata']['name']}", o) for o in rendered if "template" in o.get("spec", {})]
    assert {name.split("/")[0] for name, _ in workloads} >= {"Deployment", "StatefulSet"}
    return [("node pod", node_pod(AGENT, OBJECTS, PLAIN)), ("node pod, every option", node_pod(AGENT, OBJECTS,
                                                                                               EVERYTHING_ON)),
            ("master pod", _master(PLAIN)), ("master pod, every option", _master(EVERYTHING_ON)), *workloads]


@pytest.mark.parametrize(("what", "obj"), _every_pod(), ids=[name for name, _ in _every_pod()])
def test_every_pod_stead_makes_passes_the_restricted_pod_security_standard(what: str, obj: dict[str, Any]) -> None:
    validate_builtin(obj)
    assert pod_security_violations(obj, "restricted") == [], what


def test_the_checker_finds_what_restricted_and_baseline_forbid() -> None:
    bare = {"kind": "Pod", "metadata": {"name": "bare"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    assert pod_security_violations(bare, "baseline") == []  # the default pod is baseline
    found = "\n".join(pod_security_violations(bare, "restricted"))
    for field in ("allowPrivilegeEscalation: must be false", "runAsNonRoot: must be true",
                  "seccompProfile.type: must be RuntimeDefault or Localhost", "capabilities.drop: must include ALL"):
        assert f"Pod/bare: spec.containers[0].securityContext.{field}" in found
    host = {"kind": "Pod", "metadata": {"name": "host"}, "spec": {
        "hostNetwork": True,
        "containers": [{"name": "c", "image": "x", "securityContext": {"privileged": True, "capabilities": {
            "add": ["SYS_ADMIN", "CHOWN"]}}, "ports": [{"containerPort": 80, "hostPort": 80}]}],
        "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}
    found = "\n".join(pod_security_violations(host, "baseline"))
    for words in ("spec.hostNetwork", "privileged: must be unset or false", "capabilities.add: SYS_ADMIN not allowed",
                  "ports[0].hostPort", "volumes[0].hostPath"):
        assert words in found
    assert pod_security_violations(host, "privileged") == []
    with pytest.raises(ConfigError, match="level 'strict' does not exist"):
        pod_security_violations(bare, "strict")


def test_ptrace_takes_a_node_pod_past_restricted_and_baseline() -> None:
    pod = node_pod(AGENT, OBJECTS, K8sSettings(image=IMAGE, ptrace=True))
    assert any("SYS_PTRACE not allowed (restricted" in v for v in pod_security_violations(pod, "restricted"))
    assert any("SYS_PTRACE not allowed (baseline" in v for v in pod_security_violations(pod, "baseline"))
    assert pod_security_violations(pod, "privileged") == []


def test_the_agent_reads_its_token_as_a_non_root_user_and_writes_only_to_its_volumes() -> None:
    pod = node_pod(AGENT, OBJECTS, PLAIN)
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] > 0
    assert security["fsGroup"] == security["runAsGroup"] == security["runAsUser"]  # the Secret's group is its own
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["token"]["secret"]["defaultMode"] == 0o440  # owner and group read; no one else, no write
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert set(writable) == {"/dev/shm", "/tmp", "/stead/checkpoints"}
    assert all("emptyDir" in v or "persistentVolumeClaim" in v for v in writable.values())
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HOME"] == "/tmp" and env["STEAD_CKPT_DIR"] == "/stead/checkpoints"
    assert node_pod(AGENT, OBJECTS, K8sSettings(image=IMAGE, read_only_root_fs=False))["spec"]["containers"][0][
        "securityContext"]["readOnlyRootFilesystem"] is False


def test_the_master_runs_as_its_job_s_own_account_and_writes_its_token_file_to_a_volume() -> None:
    pod = _master(PLAIN)
    assert pod["spec"]["serviceAccountName"] == "demo-master"
    assert _master(K8sSettings(image=IMAGE, service_account="shared"))["spec"]["serviceAccountName"] == "shared"
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    token_file = command[command.index("--token-file") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert token_file.rsplit("/", 1)[0] in mounts and container["securityContext"]["readOnlyRootFilesystem"]
    assert command[command.index("--metrics-port") + 1] == "-1"


def test_a_master_that_talks_to_etcd_gets_its_client_certificate_and_password_as_files() -> None:
    (container,) = _master(EVERYTHING_ON)["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["STEAD_ETCD_CA_FILE"] == "/var/run/stead-etcd/tls/ca.crt"
    assert env["STEAD_ETCD_CERT_FILE"] == "/var/run/stead-etcd/tls/tls.crt"
    assert env["STEAD_ETCD_KEY_FILE"] == "/var/run/stead-etcd/tls/tls.key"
    assert env["STEAD_ETCD_USER"] == "stead"
    assert env["STEAD_ETCD_PASSWORD_FILE"] == "/var/run/stead-etcd/auth/password"
    volumes = {v["name"]: v["secret"] for v in _master(EVERYTHING_ON)["spec"]["volumes"] if "secret" in v}
    assert volumes["etcd-auth"] == {"secretName": "stead-etcd-auth", "defaultMode": 0o440,
                                    "items": [{"key": "password", "path": "password"}]}  # not the root password
    assert volumes["etcd-tls"]["secretName"] == "stead-etcd-client"
    with pytest.raises(ConfigError, match=r"k8s\.etcd_user=stead needs its password: give k8s\.etcd_auth_secret"):
        _master(K8sSettings(image=IMAGE, etcd_user="stead"))


def test_master_metrics_are_served_on_the_pod_ip_only_behind_a_token() -> None:
    (container,) = _master(EVERYTHING_ON)["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["STEAD_METRICS_HOST"] == "$(POD_IP)"
    assert env["STEAD_METRICS_TOKEN_FILE"] == "/var/run/stead-metrics/token"
    assert {"name": "metrics", "containerPort": 9400} in container["ports"]
    with pytest.raises(ConfigError, match=r"give k8s\.metrics_token_secret"):
        _master(K8sSettings(image=IMAGE, metrics_port=9400))


# -- what a job may ask for -----------------------------------------------------------------------------------------

WANTS = K8sSettings(image=IMAGE, service_account="admin", checkpoint_claim="data", ptrace=True,
                    env=json.dumps([{"name": "A", "value": "1"},
                                    {"name": "B", "valueFrom": {"secretKeyRef": {"name": "other-token", "key": "t"}}},
                                    {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "c"}}},
                                    {"name": "D", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]))


def test_every_escalating_field_is_refused_naming_the_field_and_the_setting_that_allows_it() -> None:
    found = refusals(WANTS, K8sSettings(), fields=OPERATOR_FIELDS)
    assert [line.split(":", 1)[0] for line in found] == [
        "spec.serviceAccountName=admin", "spec.checkpointVolume.claimName=data",
        "spec.env[1].valueFrom.secretKeyRef.name=other-token", "spec.env[2].valueFrom.configMapKeyRef.name=cfg",
        "spec.ptrace=true"]
    for line, setting in zip(found, ("allowed_service_accounts", "allowed_claims", "allowed_env_secrets",
                                     "allowed_env_config_maps", "allow_ptrace"), strict=True):
        assert line.endswith(f"the operator allows it with k8s.{setting} (STEAD_K8S_{setting.upper()})")


def test_what_the_configuration_allows_is_let_through() -> None:
    allows = K8sSettings(allowed_service_accounts="stead-master, admin", allowed_claims="*",
                         allowed_env_secrets="other-token", allowed_env_config_maps="cfg", allow_ptrace=True)
    assert refusals(WANTS, allows) == []
    assert refusals(K8sSettings(image=IMAGE), K8sSettings()) == []  # the default job asks for nothing
    with pytest.raises(JobRefused, match=r"job 'demo' is refused: k8s\.service_account=admin"):
        check_allowed(WANTS, K8sSettings(allow_ptrace=True), job="demo")


def test_a_steadjob_sets_no_k8s_setting_through_settings_or_run_args() -> None:
    check_run_args({"ckpt.keep_last": "3"}, ["--set", "ckpt.keep_last=3"])
    for settings, args, field in (({"k8s.ptrace": "true"}, [], "spec.settings.k8s.ptrace"),
                                  ({}, ["--set", "k8s.service_account=admin"], "spec.runArgs[1]"),
                                  ({}, ["--set=k8s.env=[]"], "spec.runArgs[0]"),
                                  # the master strips a name before it reads it: spaces hide nothing
                                  ({" k8s.ptrace": "true"}, [], "spec.settings. k8s.ptrace"),
                                  ({}, ["--set", " k8s.ptrace=true"], "spec.runArgs[1]"),
                                  ({}, ["--set= k8s.ptrace=true"], "spec.runArgs[0]"),
                                  ({}, ["--set=\u00a0k8s.ptrace=true"], "spec.runArgs[0]")):
        with pytest.raises(JobRefused, match=re.escape(field)):
            check_run_args(settings, args)
    with pytest.raises(JobRefused, match=r"spec.settings 'K8S.ptrace': not a setting's name; a name is lowercase"):
        check_run_args({"K8S.ptrace": "true"}, [])


@pytest.mark.parametrize("store", ["etcd://x@evil:2379", "etcd://evil:2379?password_file=%2Fvar%2Frun%2Ftoken",
                                   "etcd://a:2379,evil:2379?ca_file=/etc/ssl/private/key.pem", "etcd://a:2379/"])
def test_a_steadjob_s_store_names_endpoints_and_no_credentials(store: str) -> None:
    check_store("etcd://stead-etcd:2379,10.0.0.7,[fd00::1]:32379")
    with pytest.raises(JobRefused, match=r"must be etcd://HOST\[:PORT\]\[,HOST\[:PORT\]\], with no user and no "
                                         r"query: the store's TLS files and login are the operator's") as caught:
        check_store(store)
    assert "password_file" not in str(caught.value) and "x@" not in str(caught.value)
    with pytest.raises(JobRefused, match=r"^spec\.store"):
        operator.master_spec("demo", {"image": IMAGE, "command": ["train.py"], "store": store}, PLAIN)


@pytest.mark.parametrize(("resource", "verb", "words"), [
    (ROLES, "create", "whoever makes a job's objects needs create, get and delete on serviceaccounts, roles and "
                      "rolebindings"),
    (SERVICE_ACCOUNTS, "create", "the operator's Role (deploy/rbac.yaml) has them; for `stead run --platform k8s`"),
    (NODES, "patch", "apply deploy/node-cordon.yaml (`stead k8s manifests --with-node-cordon`) and run the job's "
                     "master as the account it binds, stead-master"),
    (PODS, "create", "a job's master uses its own Role, <job>-master, made with the job"),
])
async def test_a_refused_request_names_whose_rules_to_change(kube_api: FakeKubeApi, resource: Resource, verb: str,
                                                             words: str) -> None:
    kube_api.deny(verb, resource.plural)
    body = {"apiVersion": "v1", "kind": "X", "metadata": {"name": "x"}}
    async with Kube(K8sSettings(api_url=kube_api.url, namespace="default"), pool=1) as kube:
        with pytest.raises(PlatformRejected) as caught:
            if verb == "patch":
                await kube.patch(resource, "host-1", {"spec": {"unschedulable": True}})
            else:
                await kube.create(resource, body)
    assert "the Kubernetes API server refused" in str(caught.value) and words in str(caught.value)


# -- TLS to the API server ----------------------------------------------------------------------------------------


@pytest.fixture
async def https_api(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """An HTTPS server with a certificate of its own CA that answers GET of one pod: (url, the CA's file)."""
    from aiohttp import web

    server, _, _ = generate_secrets("default")
    for key, text in server["stringData"].items():
        (tmp_path / key).write_text(text)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")

    async def pod(request: web.Request) -> web.Response:
        return web.json_response({"kind": "Pod", "metadata": {"name": request.match_info["name"]}})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/default/pods/{name}", pod)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"https://127.0.0.1:{port}", tmp_path / "ca.crt"
    finally:
        await runner.cleanup()


async def test_the_api_server_s_certificate_is_verified_unless_a_setting_says_otherwise(
        https_api: tuple[str, Path]) -> None:
    url, ca = https_api
    base = K8sSettings(api_url=url, namespace="default", request_timeout_s=10)
    async with Kube(base, pool=1) as kube:  # a certificate no CA of the system signed: refused
        with pytest.raises(PlatformUnavailable, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await kube.get(PODS, "p")
    async with Kube(dataclasses.replace(base, api_ca_file=str(ca)), pool=1) as kube:
        assert (await kube.get(PODS, "p") or {})["metadata"]["name"] == "p"
    async with Kube(dataclasses.replace(base, insecure_skip_tls_verify=True), pool=1) as kube:
        assert (await kube.get(PODS, "p") or {})["metadata"]["name"] == "p"


def _login(settings: K8sSettings) -> Any:
    (login,) = [h for h in operator.registry(settings)._activities.get_all_handlers() if h.id.endswith(".login")]
    return login.fn()


def test_the_operator_verifies_the_api_server_unless_told_not_to() -> None:
    verified = _login(K8sSettings(api_url="https://kube.example:6443", api_ca_file="/etc/ca.crt"))
    assert verified.insecure is False and verified.ca_path == "/etc/ca.crt"
    assert _login(K8sSettings(api_url="https://kube.example:6443", insecure_skip_tls_verify=True)).insecure is True
