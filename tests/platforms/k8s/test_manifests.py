"""The Kubernetes manifests: valid for the API server, least-privilege RBAC, and deploy/ in step with the code."""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from stead.cli.run_args import build_parser
from stead.core.errors import ConfigError
from stead.platforms.k8s import manifests
from stead.platforms.k8s.isolation import store_ports
from stead.platforms.k8s.names import API_GROUP, LABEL_JOB
from tests.support.kube_validate import (
    KUBERNETES_VERSION,
    ManifestInvalid,
    json_schema,
    validate_builtin,
    validate_custom,
)

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
IMAGE = "registry.example.com/team/stead:1.0"
EVERYTHING = manifests.render(image=IMAGE, with_etcd=True, with_example=True, with_node_cordon=True)
CRD = manifests.custom_resource_definition()
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
BUILTIN = [obj for obj in EVERYTHING if not obj["apiVersion"].startswith(f"{API_GROUP}/")]


def _job() -> dict[str, Any]:
    (job,) = [obj for obj in EVERYTHING if obj["kind"] == "SteadJob"]
    return copy.deepcopy(job)


def _rules(obj: Mapping[str, Any]) -> dict[tuple[str, str], list[str]]:
    return {(group, resource): rule["verbs"] for rule in obj["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]}


def _one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [obj for obj in EVERYTHING if obj["kind"] == kind and obj["metadata"]["name"] == name]
    return found


# -- every object is what the API server accepts ----------------------------------------------------------------------


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, "1.37"])
@pytest.mark.parametrize("obj", BUILTIN, ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_builtin_object_is_valid_for_kubernetes(obj: dict[str, Any], version: str) -> None:
    validate_builtin(obj, version)


def test_the_cluster_wide_operator_is_valid_and_serves_every_namespace() -> None:
    deployment = manifests.operator_deployment("jobs", IMAGE, all_namespaces=True)
    validate_builtin(deployment)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "stead", "k8s", "operator", "--all-namespaces"]


def test_the_operator_serves_its_namespace_as_an_unprivileged_single_replica() -> None:
    deployment = _one("Deployment", manifests.OPERATOR_ACCOUNT)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert container["command"] == ["stead", "k8s", "operator", "--namespace", "default"]
    assert container["image"] == IMAGE and pod["serviceAccountName"] == manifests.OPERATOR_ACCOUNT
    # the masters it starts run its own image, never a job's (a master's account may create pods)
    assert {"name": "STEAD_K8S_MASTER_IMAGE", "value": IMAGE} in container["env"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_default_image_is_stead_s_published_image_of_this_version() -> None:
    import importlib.metadata

    assert manifests.default_image() == f"ghcr.io/stead-dev/stead:{importlib.metadata.version('stead')}"
    (deployment,) = [o for o in manifests.render() if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == manifests.default_image()


def test_a_misspelt_field_is_reported_with_its_path() -> None:
    deployment = manifests.operator_deployment("default", IMAGE)
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(ManifestInvalid, match="imagePullPolice") as caught:
        validate_builtin(deployment)
    assert caught.value.field == "spec.template.spec.containers[0]"


def test_a_custom_resource_is_not_taken_for_a_builtin_one() -> None:
    with pytest.raises(ConfigError, match="validate_custom"):
        validate_builtin(_job())


def test_a_kubernetes_version_without_schemas_is_refused_with_the_shipped_ones() -> None:
    with pytest.raises(ConfigError, match=r"no schemas for Kubernetes 1\.2;.*1\.33"):
        validate_builtin(BUILTIN[0], "1.2")


def test_missing_validators_say_how_to_install_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes_validate", None)
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(ConfigError, match=r"pip install 'stead\[dev\]'"):
        validate_builtin(BUILTIN[0])
    with pytest.raises(ConfigError, match=r"pip install 'stead\[dev\]'"):
        validate_custom(_job(), CRD)


# -- the CRD --------------------------------------------------------------------------------------------------------


def test_the_crd_names_a_namespaced_resource_with_one_stored_version_and_a_status() -> None:
    assert CRD["metadata"]["name"] == "steadjobs.stead.dev"
    spec = CRD["spec"]
    assert spec["scope"] == "Namespaced" and spec["names"]["shortNames"] == ["sj"]
    (version,) = spec["versions"]
    assert version["name"] == "v1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase", "Nodes", "Target", "Step", "Restarts", "Goodput", "Age"]


def test_every_printer_column_shows_a_declared_field() -> None:
    for column in CRD["spec"]["versions"][0]["additionalPrinterColumns"]:
        section, field = column["jsonPath"].lstrip(".").split(".")
        if section == "status":
            assert field in SCHEMA["properties"]["status"]["properties"], column
        else:
            assert (section, field) == ("metadata", "creationTimestamp")


def _nodes(node: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every schema node that describes a value (not the branches of anyOf/allOf/oneOf/not), with its path."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), Mapping):
            yield from _nodes(node[key], f"{path}[{key}]")


def test_the_crd_schema_is_structural() -> None:
    """The rules the API server checks (apiextensions "structural schema"), on every node of the schema."""
    for path, node in _nodes(SCHEMA, "openAPIV3Schema"):
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields") or int_or_string, \
            f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), f"{path}: both properties and a map"
        for junctor in ("allOf", "anyOf", "oneOf", "not"):
            branches = node.get(junctor, [])
            branches = [branches] if isinstance(branches, Mapping) else branches
            if int_or_string and junctor == "anyOf":
                assert branches == [{"type": "integer"}, {"type": "string"}], path
                continue
            for branch in branches:
                forbidden = {"type", "description", "default", "additionalProperties", "nullable"} & set(branch)
                assert not forbidden, f"{path}.{junctor} sets {forbidden}"
    # a CRD may restrict only metadata.name and metadata.generateName
    assert set(SCHEMA["properties"]["metadata"].get("properties", {})) <= {"name", "generateName"}


def test_every_field_is_documented() -> None:
    for path, node in _nodes(SCHEMA, "openAPIV3Schema"):
        if re.search(r"\[(items|additionalProperties)\]$", path) and "properties" not in node:
            continue  # a list's or map's values: described by the field that holds them
        assert node.get("description"), f"{path} has no description"


def test_the_crd_schema_is_a_valid_json_schema_and_its_defaults_obey_it() -> None:
    converted = json_schema(CRD, "v1")
    jsonschema.Draft7Validator.check_schema(converted)
    for _, node in _nodes(SCHEMA, "openAPIV3Schema"):
        if "default" in node:
            single = {"spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": node}}]}}
            jsonschema.Draft7Validator(json_schema(single, "v1")).validate(node["default"])


def test_the_spec_mirrors_stead_run_flags_and_their_defaults() -> None:
    parser = build_parser(environ={})
    options = {option: action for action in parser._actions for option in action.option_strings}
    spec = SCHEMA["properties"]["spec"]["properties"]
    for name, field in spec.items():
        for flag in re.findall(r"stead run (--[a-z-]+)", field["description"]):
            assert flag in options, f"spec.{name} names {flag}, which `stead run` does not have"
    assert spec["maxRestarts"]["default"] == options["--max-restarts"].default
    assert spec["maxNodeRelaunches"]["default"] == options["--max-node-relaunches"].default
    assert spec["nnodes"]["default"] == "1" and spec["nprocPerNode"]["default"] == 1
    assert SCHEMA["properties"]["spec"]["required"] == ["image", "command"]
    assert SCHEMA["properties"]["status"]["properties"]["phase"]["enum"] == [
        "Pending", "Running", "Recovering", "Succeeded", "Failed", "Stopped", "Suspended"]


# -- jobs against the CRD -------------------------------------------------------------------------------------------


def test_the_example_job_is_a_valid_steadjob() -> None:
    job = _job()
    validate_custom(job, CRD)
    assert job["metadata"]["name"] == "example"
    assert job["spec"]["nnodes"] == "2:4" and job["spec"]["nprocPerNode"] == 2
    assert job["spec"]["store"] == "etcd://stead-etcd:2379"
    claim = _one("PersistentVolumeClaim", job["spec"]["checkpointVolume"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize(("change", "field", "words"), [
    (lambda spec: spec.pop("image"), "spec", "'image' is a required property"),
    (lambda spec: spec.pop("command"), "spec", "'command' is a required property"),
    (lambda spec: spec.update(nnodes="4:2x"), "spec.nnodes", "'4:2x' does not match"),
    (lambda spec: spec.update(nnodes="0"), "spec.nnodes", "does not match"),
    (lambda spec: spec.update(nprocPerNode=0), "spec.nprocPerNode", "less than the minimum of 1"),
    (lambda spec: spec.update(maxRestarts=-1), "spec.maxRestarts", "less than the minimum of 0"),
    (lambda spec: spec.update(shmSize="lots"), "spec.shmSize", "does not match"),
    (lambda spec: spec.update(store="sqlite:///x.db"), "spec.store", "does not match"),
    # the store's credentials are the operator's: a user or a query would have it send them where the job says
    (lambda spec: spec.update(store="etcd://x@evil:2379"), "spec.store", "does not match"),
    (lambda spec: spec.update(store="etcd://evil:2379?password_file=%2Fvar%2Frun%2Fsecrets%2Ftoken"), "spec.store",
     "does not match"),
    (lambda spec: spec.update(store="etcd://a:2379,evil:2379/?ca_file=/x"), "spec.store", "does not match"),
    (lambda spec: spec.update(command=[]), "spec.command", "should be non-empty"),
    (lambda spec: spec.update(imagePullPolicy="Sometimes"), "spec.imagePullPolicy", "is not one of"),
    (lambda spec: spec.update(settings={"heartbeat_timeout_s": 10}), "spec.settings.heartbeat_timeout_s",
     "is not of type 'string'"),
    (lambda spec: spec.update(nproc_per_node=2), "spec", "'nproc_per_node' was unexpected"),
    (lambda spec: spec.update(env=[{"name": "X", "valueFrom": {"hostPath": {"path": "/"}}}]), "spec.env[0].valueFrom",
     "'hostPath' was unexpected"),
    (lambda spec: spec.update(env=[{"name": "X", "valueFrom": {}}]), "spec.env[0].valueFrom",
     "should be non-empty"),
])
def test_a_wrong_job_is_refused_naming_the_field(change: Any, field: str, words: str) -> None:
    job = _job()
    change(job["spec"])
    with pytest.raises(ManifestInvalid) as caught:
        validate_custom(job, CRD)
    assert caught.value.field == field
    assert f"{field}: " in str(caught.value) and words in str(caught.value)


def test_a_job_name_that_cannot_name_its_master_service_is_refused() -> None:
    job = _job()
    job["metadata"]["name"] = "1st-job"  # a Service name starts with a letter
    with pytest.raises(ManifestInvalid, match=r"metadata\.name"):
        validate_custom(job, CRD)


def test_a_job_name_whose_master_account_is_the_shared_one_is_refused() -> None:
    manifests.check_job_name("steady")
    with pytest.raises(ConfigError, match="job name 'stead' would make its master's account stead-master, the "
                                          "ServiceAccount that jobs allowed to cordon hosts share"):
        manifests.check_job_name("stead")


def test_the_crd_takes_a_store_of_endpoints_only() -> None:
    for store in ("etcd://stead-etcd:2379", "etcd://a:2379,b,c.ns.svc:32379", "etcd://[fd00::1]:2379,10.0.0.7"):
        job = _job()
        job["spec"]["store"] = store
        validate_custom(job, CRD)


def test_resources_take_quantities_as_numbers_or_strings() -> None:
    job = _job()
    job["spec"]["resources"] = {"requests": {"cpu": 4, "memory": "16Gi", "nvidia.com/gpu": 8},
                                "limits": {"nvidia.com/gpu": "8"}}
    validate_custom(job, CRD)
    job["spec"]["resources"]["limits"]["memory"] = "16 GB"
    with pytest.raises(ManifestInvalid, match=r"spec\.resources\.limits\.memory"):
        validate_custom(job, CRD)


def test_an_object_of_another_kind_is_not_checked_against_the_crd() -> None:
    with pytest.raises(ConfigError, match=r"not a SteadJob of stead\.dev"):
        validate_custom(BUILTIN[1], CRD)
    job = _job()
    job["apiVersion"] = "stead.dev/v9"
    with pytest.raises(ConfigError, match="no version 'v9'"):
        validate_custom(job, CRD)


# -- RBAC -----------------------------------------------------------------------------------------------------------


def test_no_rbac_rule_uses_a_wildcard() -> None:
    for obj in EVERYTHING:
        for rule in obj.get("rules", []):
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{obj['kind']}/{obj['metadata']['name']}: {rule}"


def test_a_job_s_master_role_reads_only_its_own_secret_and_job() -> None:
    sa, role, binding = manifests.job_rbac("train-7", "jobs")
    for obj in (sa, role, binding):
        validate_builtin(obj)
        assert obj["metadata"]["name"] == "train-7-master" and obj["metadata"]["namespace"] == "jobs"
    assert sa["kind"] == "ServiceAccount" and role["kind"] == "Role"
    assert _rules(role) == {
        ("", "pods"): ["list", "watch", "create", "delete"],
        ("stead.dev", "steadjobs"): ["get"],
        ("", "secrets"): ["get"],
    }
    named = {resource: rule.get("resourceNames") for rule in role["rules"] for resource in rule["resources"]}
    assert named == {"pods": None, "steadjobs": ["train-7"], "secrets": ["train-7-token"]}
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "train-7-master"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "train-7-master", "namespace": "jobs"}]


def test_a_job_that_runs_as_an_allowed_account_binds_its_own_role_to_it_and_makes_no_account() -> None:
    role, binding = manifests.job_rbac("train-7", "jobs", "stead-master")
    assert role["kind"] == "Role" and _rules(role)[("", "secrets")] == ["get"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "stead-master", "namespace": "jobs"}]


def test_no_shared_master_role_is_installed() -> None:
    assert not [o for o in EVERYTHING if o["kind"] in ("Role", "ClusterRole") and "secrets" in str(o["rules"])
                and o["metadata"]["name"] != manifests.OPERATOR_ACCOUNT]


def test_a_namespaced_operator_gets_a_role_in_its_namespace_and_nothing_cluster_wide() -> None:
    objects = manifests.operator_rbac("jobs")
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding"]
    for obj in objects:
        validate_builtin(obj)
        assert obj["metadata"]["namespace"] == "jobs"
    assert objects[2]["roleRef"]["kind"] == "Role"
    assert objects[2]["subjects"] == [{"kind": "ServiceAccount", "name": "stead-operator", "namespace": "jobs"}]
    cluster_wide = [o["kind"] for o in manifests.render("jobs", IMAGE) if "namespace" not in o["metadata"]]
    assert cluster_wide == ["CustomResourceDefinition"]


def test_an_operator_of_every_namespace_gets_a_cluster_role_bound_to_its_account() -> None:
    account, role, binding = manifests.operator_rbac("jobs", all_namespaces=True)
    assert account["metadata"]["namespace"] == "jobs"
    assert (role["kind"], binding["kind"]) == ("ClusterRole", "ClusterRoleBinding")
    assert binding["metadata"]["name"] == "stead-operator-jobs"  # two installations do not overwrite each other
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "stead-operator", "namespace": "jobs"}]
    rendered = manifests.render("jobs", IMAGE, all_namespaces=True)
    assert [o["kind"] for o in rendered][1:4] == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]


def test_the_operator_role_holds_exactly_what_it_and_kopf_use() -> None:
    role = _one("Role", manifests.OPERATOR_ACCOUNT)
    assert _rules(role) == {
        ("stead.dev", "steadjobs"): ["get", "list", "watch", "patch"],
        ("stead.dev", "steadjobs/status"): ["get", "patch"],
        ("", "pods"): ["list", "watch", "create", "delete"],
        ("", "services"): ["get", "create", "delete"],
        ("networking.k8s.io", "networkpolicies"): ["get", "create", "delete"],
        ("", "secrets"): ["get", "create", "delete"],
        ("", "serviceaccounts"): ["get", "create", "delete"],
        ("rbac.authorization.k8s.io", "roles"): ["get", "create", "delete"],
        ("rbac.authorization.k8s.io", "rolebindings"): ["get", "create", "delete"],
        ("", "events"): ["create"],
    }  # kopf standalone, without CRD or namespace watches: no peering, nothing cluster-wide


def test_the_operator_holds_every_permission_a_master_role_grants() -> None:
    """Kubernetes' escalation check: an account may create a Role (and bind it) only if it holds all it grants,
    and stead gives the operator neither `escalate` nor `bind`."""
    held = _rules(_one("Role", manifests.OPERATOR_ACCOUNT))
    for rule in manifests.master_rules("any-job"):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= set(held.get((group, resource), [])), (group, resource)
    assert not {verb for verbs in held.values() for verb in verbs} & {"escalate", "bind", "impersonate", "*"}


def test_the_node_cordon_role_is_optional_and_only_gets_and_patches_nodes() -> None:
    assert not [o for o in manifests.render() if "cordon" in o["metadata"]["name"]]
    account, role, binding = manifests.node_cordon_rbac("jobs")
    assert account["kind"] == "ServiceAccount" and account["metadata"]["name"] == "stead-master"
    assert _rules(role) == {("", "nodes"): ["get", "patch"]}
    assert "k8s.cordon_bad_hosts=true" in role["metadata"]["annotations"]["stead.dev/note"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "stead-master", "namespace": "jobs"}]


# -- the per-job NetworkPolicies ------------------------------------------------------------------------------------


def test_a_job_s_pods_reach_only_each_other_and_dns_and_its_master_the_api_and_the_store() -> None:
    isolation, master = manifests.network_policies("train-7", "jobs", store_url="etcd://etcd-a:2379,etcd-b:32379")
    for policy in (isolation, master):
        validate_builtin(policy)
        assert policy["metadata"]["namespace"] == "jobs"
    own = [{"podSelector": {"matchLabels": {LABEL_JOB: "train-7"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "jobs"}}}]
    assert isolation["spec"]["podSelector"] == {"matchLabels": {LABEL_JOB: "train-7"}}
    assert isolation["spec"]["policyTypes"] == ["Ingress", "Egress"]  # default deny both ways
    assert isolation["spec"]["ingress"] == [{"from": own}]  # any port: gloo and NCCL pick theirs
    assert isolation["spec"]["egress"] == [
        {"to": own}, {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]
    assert master["spec"]["podSelector"] == {"matchLabels": {LABEL_JOB: "train-7", "stead.dev/role": "master"}}
    assert master["spec"]["policyTypes"] == ["Egress"]
    ports = [sorted(p["port"] for p in rule["ports"]) for rule in master["spec"]["egress"]]
    assert ports == [[443, 6443], [2379, 32379]]
    # read as the store reads its URL: a user and a query of TLS files are not part of the port
    assert store_ports("etcd://stead@etcd:32379?ca_file=/etc/stead/ca.pem") == [32379]
    assert store_ports("etcd://stead@etcd?ca_file=/etc/stead/ca.pem:1") == [2379]


def test_node_egress_cidrs_and_master_metrics_are_let_through_only_when_asked() -> None:
    isolation, master = manifests.network_policies("train-7", "jobs", store_url="etcd://e", metrics_port=9400,
                                                    egress_cidrs="10.0.0.0/8, 0.0.0.0/0")
    validate_builtin(isolation)
    validate_builtin(master)
    assert isolation["spec"]["egress"][-1] == {"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}},
                                                      {"ipBlock": {"cidr": "0.0.0.0/0"}}]}
    assert master["spec"]["ingress"] == [{"from": [{"namespaceSelector": {}}],
                                          "ports": [{"protocol": "TCP", "port": 9400}]}]
    with pytest.raises(ConfigError, match=r"k8s\.node_egress_cidrs item '10\.0\.0\.1' is not a CIDR"):
        manifests.network_policies("train-7", "jobs", store_url="etcd://e", egress_cidrs="10.0.0.1")


# -- etcd, render, YAML, deploy/ and the command line ---------------------------------------------------------------


def test_the_optional_etcd_serves_clients_on_its_service_name_and_the_operator_is_configured_for_it() -> None:
    rendered = manifests.render("jobs", IMAGE, with_etcd=True)
    service = next(o for o in rendered if o["kind"] == "Service")
    assert service["metadata"]["name"] == "stead-etcd" and service["spec"]["ports"][0]["port"] == 2379
    (container,) = next(o for o in rendered if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", container["image"])
    assert "--advertise-client-urls=https://stead-etcd.jobs.svc:2379" in container["args"]
    (deployment,) = [o for o in rendered if o["kind"] == "Deployment"]  # one operator, configured for the etcd
    (operator,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert env["STEAD_ETCD_USER"] == "stead" and env["STEAD_ETCD_CA_FILE"] == "/var/run/stead-etcd/tls/ca.crt"
    assert env["STEAD_K8S_ETCD_CLIENT_SECRET"] == "stead-etcd-client"  # what its masters are given
    assert env["STEAD_K8S_ETCD_AUTH_SECRET"] == "stead-etcd-auth" and env["STEAD_K8S_ETCD_USER"] == "stead"
    plain = manifests.render("jobs", IMAGE)[-1]["spec"]["template"]["spec"]["containers"][0]
    assert not [e for e in plain["env"] if "ETCD" in e["name"]]


def test_generated_etcd_secrets_come_first_and_only_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert not [o for o in manifests.render("jobs", IMAGE, with_etcd=True) if o["kind"] == "Secret"]
    with pytest.raises(ConfigError, match="--etcd-generate-certs makes the Secrets of the optional etcd"):
        manifests.render("jobs", IMAGE, generate_certs=True)
    assert manifests.main(["--namespace", "jobs", "--image", IMAGE, "--with-etcd", "--etcd-generate-certs"]) == 0
    out = capsys.readouterr()
    printed = list(yaml.safe_load_all(out.out))
    secrets = [o["metadata"]["name"] for o in printed if o["kind"] == "Secret"]
    assert secrets == ["stead-etcd-server", "stead-etcd-client", "stead-etcd-auth"]
    assert [o["kind"] for o in printed].index("Secret") < [o["kind"] for o in printed].index("StatefulSet")
    assert "holds the private keys" in out.err
    assert "PRIVATE KEY" not in "".join(manifests.deploy_files().values())  # nothing secret is committed


def test_the_example_job_asks_for_nothing_the_shipped_operator_does_not_allow() -> None:
    from stead.core.config import load_settings
    from stead.platforms.k8s.operator import master_spec
    from stead.platforms.k8s.policy import OPERATOR_FIELDS, refusals
    from stead.platforms.k8s.settings import K8sSettings

    (operator,) = _one("Deployment", manifests.OPERATOR_ACCOUNT)["spec"]["template"]["spec"]["containers"]
    environ = {e["name"]: e["value"] for e in operator["env"] if "value" in e}
    allowed = load_settings(K8sSettings, "k8s", environ=environ)
    wanted = master_spec("example", _job()["spec"], allowed).settings
    assert wanted.checkpoint_claim and refusals(wanted, allowed, fields=OPERATOR_FIELDS) == []


def test_prometheus_scrapes_the_masters_metrics_port_with_a_bearer_token_file() -> None:
    config = manifests.prometheus_scrape_config("jobs")
    (job,) = config["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": manifests.PROMETHEUS_TOKEN_FILE}
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["jobs"]}}]
    kept = {rule["source_labels"][0]: rule["regex"] for rule in job["relabel_configs"] if rule.get("action") == "keep"}
    assert kept == {"__meta_kubernetes_pod_label_stead_dev_role": "master",
                    "__meta_kubernetes_pod_container_port_name": "metrics"}
    deployed = yaml.safe_load(manifests.deploy_files()["prometheus-scrape.yaml"])
    assert deployed == manifests.prometheus_scrape_config("default")


def test_render_lists_objects_in_apply_order_and_adds_optional_parts_on_request() -> None:
    kinds = [o["kind"] for o in manifests.render("jobs", IMAGE)]
    assert kinds == ["CustomResourceDefinition", "ServiceAccount", "Role", "RoleBinding", "Deployment"]
    kinds = [o["kind"] for o in manifests.render("jobs", IMAGE, with_etcd=True, with_example=True)]
    assert kinds[5:] == ["Service", "StatefulSet", "NetworkPolicy", "Job", "PersistentVolumeClaim", "SteadJob"]
    for obj in manifests.render("jobs", IMAGE, with_etcd=True, with_example=True):
        assert obj["metadata"].get("namespace", "jobs") == "jobs"


@pytest.mark.parametrize("namespace", ["Bad_NS", "", "-x", "a" * 64])
def test_a_namespace_that_is_not_a_dns_label_is_a_config_error(namespace: str) -> None:
    with pytest.raises(ConfigError, match="lowercase letters, digits and '-'"):
        manifests.render(namespace)


def test_an_image_with_spaces_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not an image reference"):
        manifests.render(image="stead latest")


def test_yaml_reads_back_as_the_objects_with_keys_in_build_order() -> None:
    text = manifests.to_yaml(EVERYTHING)
    assert list(yaml.safe_load_all(text)) == EVERYTHING
    assert text.count("\n---\n") + text.startswith("---\n") == len(EVERYTHING)
    assert text.startswith("---\napiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n")
    assert "nnodes: '2:4'" in text  # quoted: YAML 1.1 would read 2:4 as the sexagesimal number 124


def test_deploy_is_up_to_date() -> None:
    expected = manifests.deploy_files()
    stale = [name for name, text in expected.items()
             if not (DEPLOY / name).is_file() or (DEPLOY / name).read_text(encoding="utf-8") != text]
    extra = sorted({p.name for p in DEPLOY.iterdir()} - set(expected)) if DEPLOY.is_dir() else []
    assert not stale and not extra, (f"deploy/ is stale ({', '.join(stale + extra)}): run "
                                     "`python -m stead.platforms.k8s.manifests --write deploy` and commit the result")


def test_deploy_lists_every_file_in_its_readme() -> None:
    readme = manifests.deploy_files()["README.md"]
    for name in manifests.deploy_files():
        if name != "README.md":
            assert f"- `{name}`: " in readme


def test_write_puts_every_file_in_the_directory(tmp_path: Path) -> None:
    written = manifests.write_deploy(tmp_path / "out", "jobs", IMAGE)
    assert sorted(p.name for p in written) == sorted(manifests.deploy_files("jobs", IMAGE))
    assert "namespace: jobs" in (tmp_path / "out" / "rbac.yaml").read_text()


def test_main_prints_yaml_of_what_render_returns(capsys: pytest.CaptureFixture[str]) -> None:
    assert manifests.main(["--namespace", "jobs", "--image", IMAGE, "--with-etcd", "--with-example"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert printed == manifests.render("jobs", IMAGE, with_etcd=True, with_example=True)


def test_main_refuses_a_bad_namespace_in_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert manifests.main(["--namespace", "Bad_NS"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "error: namespace 'Bad_NS' is not a valid Kubernetes namespace name" in line


def test_the_readmes_steadjob_is_valid_against_the_crd() -> None:
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    job = yaml.safe_load(block)
    job["metadata"]["namespace"] = "default"
    validate_custom(job, CRD)
    assert job["spec"]["store"].startswith("etcd://")


def _cel_pattern(rule: str) -> re.Pattern[str]:
    """The RE2 expression of a CEL rule's ``matches()``, as Python's re (the same language for these); CEL
    matches anywhere in the string, as re.search does."""
    (pattern,) = re.findall(r"matches\('([^']*)'\)", rule)
    return re.compile(pattern)


def test_the_crd_refuses_k8s_settings_in_settings_and_run_args_with_cel_rules() -> None:
    spec = SCHEMA["properties"]["spec"]["properties"]
    (keys,) = spec["settings"]["x-kubernetes-validations"]
    (args,) = spec["runArgs"]["x-kubernetes-validations"]
    for rule in (keys, args):
        assert "operator checks" in rule["message"]
    assert keys["rule"].startswith("self.all(k, k.matches(") and "&& !k.startsWith('k8s.'))" in keys["rule"]
    key = _cel_pattern(keys["rule"])  # a key is a setting's name, so spaces cannot hide a k8s.* one
    assert all(key.search(k) for k in ("ckpt.keep_last", "heartbeat_timeout_s"))
    assert not any(key.search(k) for k in (" k8s.ptrace", "k8s.ptrace ", "K8S.ptrace", "ckpt keep_last", ""))
    assert args["rule"].startswith("self.all(a, !a.matches(")
    arg = _cel_pattern(args["rule"])  # however the master's stripping of a name would read it
    for refused in ("k8s.ptrace=true", "--set=k8s.ptrace=true", " k8s.ptrace=true", "--set= k8s.ptrace=true",
                    "\tk8s.env=[]", "\u00a0k8s.env=[]", "--set=\u2003k8s.env=[]"):
        assert arg.search(refused), refused
    for allowed in ("--set", "ckpt.keep_last=3", "--set=ckpt.keep_last=3", "--max-restarts", "--set=x.k8s.y=1"):
        assert not arg.search(allowed), allowed
    assert "default" not in spec["serviceAccountName"]  # a job's master runs as its own account
