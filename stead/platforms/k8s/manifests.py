"""What a cluster needs to run stead jobs, as Kubernetes objects: ``stead k8s manifests``.

The CRD, the operator's RBAC and Deployment, an optional single-member etcd
(served with client TLS and authentication, see :mod:`.etcd`), an example job
and a Prometheus scrape configuration are built here as plain dicts, in the order they must be applied,
and rendered as one multi-document YAML. ``deploy/`` in the repository is this
module's output (``python -m stead.platforms.k8s.manifests --write deploy``); a
test fails when the two differ, so the files people ``kubectl apply`` are always
the ones the code describes.

Every RBAC rule names its verbs. The operator gets what it does, in the namespace
it serves (a Role) or, serving every namespace, cluster-wide (a ClusterRole);
kopf runs standalone (no peering) and without watching CRDs or namespaces, so
nothing cluster-wide is needed for one namespace. Each job master gets a Role of
its own, made with the job (:mod:`.isolation`). Every pod passes the "restricted"
Pod Security Standard.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from stead.core.errors import ConfigError
from stead.platforms.k8s import etcd as store
from stead.platforms.k8s._crd import JOB_NAME_MAX, JOB_NAME_PATTERN, MASTER_ACCOUNT, custom_resource_definition
from stead.platforms.k8s.etcd import ETCD_IMAGE, ETCD_PORT, ETCD_SERVICE
from stead.platforms.k8s.isolation import job_rbac, master_rules, network_policies, network_policy_name, rule
from stead.platforms.k8s.names import API_GROUP, API_VERSION, JOB_KIND, JOB_PLURAL, master_name
from stead.platforms.k8s.pods import METRICS_PORT_NAME, container_security, etcd_client, pod_security
from stead.platforms.k8s.settings import K8sSettings

__all__ = [
    "ETCD_IMAGE",
    "ETCD_PORT",
    "ETCD_SERVICE",
    "EXAMPLE_CHECKPOINT_CLAIM",
    "EXAMPLE_JOB",
    "IMAGE_REPOSITORY",
    "MASTER_ACCOUNT",
    "OPERATOR_ACCOUNT",
    "OPERATOR_HEALTH_PATH",
    "OPERATOR_HEALTH_PORT",
    "Manifest",
    "add_arguments",
    "check_job_name",
    "custom_resource_definition",
    "default_image",
    "deploy_files",
    "example_job",
    "job_rbac",
    "main",
    "prometheus_scrape_config",
    "master_rules",
    "network_policies",
    "network_policy_name",
    "node_cordon_rbac",
    "operator_deployment",
    "operator_rbac",
    "operator_rules",
    "render",
    "to_yaml",
    "write_deploy",
]

Manifest = dict[str, Any]

#: the operator's ServiceAccount, ClusterRole and Deployment
OPERATOR_ACCOUNT = "stead-operator"
#: the operator's liveness endpoint; this assumes `stead k8s operator` passes kopf
#: ``liveness_endpoint="http://0.0.0.0:8080/healthz"`` (kopf's ``--liveness``): kopf binds ``localhost`` when the
#: URL names no host, which the kubelet's probe cannot reach
OPERATOR_HEALTH_PATH = "/healthz"
OPERATOR_HEALTH_PORT = 8080
EXAMPLE_JOB = "example"
EXAMPLE_CHECKPOINT_CLAIM = "stead-checkpoints"
#: where the Prometheus of prometheus_scrape_config reads the masters' metrics token (a Secret mounted there)
PROMETHEUS_TOKEN_FILE = "/etc/prometheus/secrets/stead-metrics/token"
#: where stead's images are published: the operator's default image is ``<repository>:<stead version>``
IMAGE_REPOSITORY = "ghcr.io/stead-dev/stead"

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_JOB_NAME = re.compile(JOB_NAME_PATTERN)
#: an unprivileged uid and gid for stead's own containers (the images need not declare a user)
_NON_ROOT_ID = 65532
_PART_OF = {"app.kubernetes.io/part-of": "stead"}
_THIS_COMMAND = "python -m stead.platforms.k8s.manifests"


# -- RBAC ----------------------------------------------------------------------------------------------------------


def operator_rules() -> list[Manifest]:
    """What the operator (kopf: standalone, no peering; no CRD or namespace watch) does with the API."""
    return [
        # kopf lists and watches the jobs and patches them (its progress annotations) and their status subresource;
        # the operator reads one job when its master pod changes
        rule(API_GROUP, [JOB_PLURAL], ["get", "list", "watch", "patch"]),
        rule(API_GROUP, [f"{JOB_PLURAL}/status"], ["get", "patch"]),
        # a job's master pod (watched: a deleted one is replaced), its Service, NetworkPolicies and token Secret;
        # a suspended job's pods are deleted; what a failed creation made is deleted again; an object of a job's
        # name that is already there is read, to take it only if the job owns it (jobs._owned)
        rule("", ["pods"], ["list", "watch", "create", "delete"]),
        rule("", ["services"], ["get", "create", "delete"]),
        rule("networking.k8s.io", ["networkpolicies"], ["get", "create", "delete"]),
        rule("", ["secrets"], ["get", "create", "delete"]),
        # each job's master gets a ServiceAccount and a Role of its own (isolation.job_rbac); Kubernetes lets the
        # operator create that Role and bind it only because it holds every permission the Role grants
        rule("", ["serviceaccounts"], ["get", "create", "delete"]),
        rule("rbac.authorization.k8s.io", ["roles", "rolebindings"], ["get", "create", "delete"]),
        # kopf posts its handlers' outcomes (a refused job's reason) as core/v1 events
        rule("", ["events"], ["create"]),
    ]


def _meta(name: str, namespace: str | None = None, labels: Mapping[str, str] | None = None,
          annotations: Mapping[str, str] | None = None) -> Manifest:
    meta: Manifest = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = {**(labels or {}), **_PART_OF}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _account(name: str, namespace: str) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, namespace)}


def _binding(kind: str, name: str, namespace: str | None, role_kind: str, role: str, account: str,
             account_namespace: str) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": _meta(name, namespace),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": account_namespace}],
    }


def operator_rbac(namespace: str, *, all_namespaces: bool = False) -> list[Manifest]:
    """The operator's ServiceAccount (in ``namespace``) and its rights: a Role and RoleBinding in ``namespace``
    when it serves that namespace only, a ClusterRole and ClusterRoleBinding when it serves every namespace."""
    _check_namespace(namespace)
    if not all_namespaces:
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": _meta(OPERATOR_ACCOUNT, namespace), "rules": operator_rules()}
        binding = _binding("RoleBinding", OPERATOR_ACCOUNT, namespace, "Role", OPERATOR_ACCOUNT, OPERATOR_ACCOUNT,
                           namespace)
        return [_account(OPERATOR_ACCOUNT, namespace), role, binding]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": _meta(OPERATOR_ACCOUNT), "rules": operator_rules()}
    # the binding names the namespace: operators installed in two namespaces must not overwrite each other's
    binding = _binding("ClusterRoleBinding", f"{OPERATOR_ACCOUNT}-{namespace}", None, "ClusterRole", OPERATOR_ACCOUNT,
                       OPERATOR_ACCOUNT, namespace)
    return [_account(OPERATOR_ACCOUNT, namespace), role, binding]


def node_cordon_rbac(namespace: str) -> list[Manifest]:
    """Optional: a ServiceAccount ``stead-master`` in ``namespace`` that may cordon a Kubernetes node whose host
    failed its health check.

    Only needed for ``--set k8s.cordon_bad_hosts=true``; without it a bad host is only avoided by this job. Nodes are
    cluster-wide, so this takes a ClusterRoleBinding, which a job's own ServiceAccount cannot get from a namespaced
    operator: a job that cordons runs its master as this shared account (``serviceAccountName: stead-master``, in
    the operator's ``k8s.allowed_service_accounts``), which then holds the Role of every job that does.
    """
    _check_namespace(namespace)
    note = {"stead.dev/note": "only needed for --set k8s.cordon_bad_hosts=true"}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": _meta("stead-node-cordon", annotations=note),
            "rules": [rule("", ["nodes"], ["get", "patch"])]}
    binding = _binding("ClusterRoleBinding", f"stead-node-cordon-{namespace}", None, "ClusterRole",
                       "stead-node-cordon", MASTER_ACCOUNT, namespace)
    binding["metadata"]["annotations"] = dict(note)
    account = _account(MASTER_ACCOUNT, namespace)
    account["metadata"]["annotations"] = dict(note)
    return [account, role, binding]


# -- the operator ---------------------------------------------------------------------------------------------------


def default_image() -> str:
    """stead's published image for the installed version: ``ghcr.io/stead-dev/stead:<version>``."""
    try:
        version = importlib.metadata.version("stead")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("stead's version is unknown (the package is not installed, so its image tag is not "
                          "known); pass --image IMAGE") from None
    return f"{IMAGE_REPOSITORY}:{version}"


def operator_deployment(namespace: str, image: str | None = None, *, all_namespaces: bool = False,
                        with_etcd: bool = False) -> Manifest:
    """The operator: one replica (two kopf operators on the same jobs would collide), replaced, never rolled.

    It lets jobs mount the example's checkpoint claim (``k8s.allowed_claims``; nothing else escalating: see
    :mod:`.policy`) and runs their masters with its own ``image`` (``k8s.master_image``). ``with_etcd``: it and
    the masters it starts talk to the optional etcd with its client certificate and the password of its user
    ``stead``.
    """
    _check_namespace(namespace)
    image = _check_image(image) if image is not None else default_image()
    scope = ["--all-namespaces"] if all_namespaces else ["--namespace", namespace]
    labels = {"app.kubernetes.io/name": OPERATOR_ACCOUNT, "app.kubernetes.io/component": "operator"}
    container: Manifest = {
        "name": "operator",
        "image": image,
        "command": ["stead", "k8s", "operator", *scope],
        "env": [
            # kopf names itself after POD_ID in the events it posts
            {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "STEAD_K8S_ALLOWED_CLAIMS", "value": EXAMPLE_CHECKPOINT_CLAIM},
            # the masters it starts run stead's image, its own, never a job's: a master's account may create pods
            {"name": "STEAD_K8S_MASTER_IMAGE", "value": image},
        ],
        "ports": [{"name": "health", "containerPort": OPERATOR_HEALTH_PORT, "protocol": "TCP"}],
        "livenessProbe": {"httpGet": {"path": OPERATOR_HEALTH_PATH, "port": "health"},
                          "initialDelaySeconds": 30, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    volumes: list[Manifest] = [{"name": "tmp", "emptyDir": {}}]
    if with_etcd:
        client = K8sSettings(etcd_client_secret=store.CLIENT_SECRET, etcd_user=store.ETCD_USER,
                             etcd_auth_secret=store.AUTH_SECRET)
        env, mounts, secrets = etcd_client(client)  # its own (it reads each job's status from the store) ...
        container["env"] += [*env, *({"name": f"STEAD_K8S_{name.upper()}", "value": getattr(client, name)}
                                     for name in ("etcd_client_secret", "etcd_user", "etcd_auth_secret"))]
        container["volumeMounts"] += mounts  # ... and what it gives the masters
        volumes += secrets
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(OPERATOR_ACCOUNT, namespace, labels),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app.kubernetes.io/name": OPERATOR_ACCOUNT}},
            "template": {
                "metadata": {"labels": {**labels, **_PART_OF}},
                "spec": {
                    "serviceAccountName": OPERATOR_ACCOUNT,
                    "securityContext": pod_security(_NON_ROOT_ID),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


# -- trying it out: etcd and an example job -------------------------------------------------------------------------


def example_job(namespace: str, image: str | None = None) -> list[Manifest]:
    """A SteadJob ``example`` on 2 to 4 nodes and the ReadWriteMany claim its checkpoints persist to."""
    _check_namespace(namespace)
    image = _check_image(image) if image is not None else default_image()
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(EXAMPLE_CHECKPOINT_CLAIM, namespace),
        # every node mounts it at once: the cluster needs a StorageClass that offers ReadWriteMany (NFS, CephFS,
        # Filestore, EFS, Azure Files ...); name it in storageClassName when it is not the default one
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}},
    }
    job = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": JOB_KIND,
        "metadata": _meta(EXAMPLE_JOB, namespace),
        "spec": {
            "nnodes": "2:4",
            "nprocPerNode": 2,
            "image": image,
            "command": ["examples/train.py"],
            "store": f"etcd://{ETCD_SERVICE}:{ETCD_PORT}",
            "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
            "checkpointVolume": {"claimName": EXAMPLE_CHECKPOINT_CLAIM, "mountPath": "/stead/checkpoints"},
        },
    }
    return [claim, job]


# -- all of it ------------------------------------------------------------------------------------------------------


def prometheus_scrape_config(namespace: str, *, all_namespaces: bool = False) -> dict[str, Any]:
    """A Prometheus scrape job for the masters that serve metrics (``k8s.metrics_port`` with
    ``k8s.metrics_token_secret``): pods labelled ``stead.dev/role=master``, their port named ``metrics``, the
    bearer token read from the file Prometheus has the Secret's ``token`` key mounted at."""
    discovery: dict[str, Any] = {"role": "pod"}
    if not all_namespaces:
        discovery["namespaces"] = {"names": [namespace]}
    return {"scrape_configs": [{
        "job_name": "stead-masters",
        "kubernetes_sd_configs": [discovery],
        "authorization": {"type": "Bearer", "credentials_file": PROMETHEUS_TOKEN_FILE},
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_label_stead_dev_role"], "regex": "master", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": METRICS_PORT_NAME,
             "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_label_stead_dev_job"], "target_label": "stead_job"},
        ],
    }]}


def _groups(namespace: str, image: str | None, *, all_namespaces: bool, with_etcd: bool = False,
            generate_certs: bool = False) -> dict[str, list[Manifest]]:
    """Every object by the deploy/ file it goes to, in apply order (optional parts included). ``with_etcd``: the
    operator is configured for the optional etcd (whose file holds it so configured too)."""
    _check_namespace(namespace)
    image = _check_image(image) if image is not None else default_image()
    generated = store.generate_secrets(namespace) if generate_certs else []
    return {
        "crd.yaml": [custom_resource_definition()],
        "rbac.yaml": operator_rbac(namespace, all_namespaces=all_namespaces),
        "operator.yaml": [operator_deployment(namespace, image, all_namespaces=all_namespaces, with_etcd=with_etcd)],
        "etcd.yaml": [*generated, *store.etcd(namespace, image, all_namespaces=all_namespaces),
                      *([] if with_etcd else [operator_deployment(namespace, image, all_namespaces=all_namespaces,
                                                                  with_etcd=True)])],
        "example-job.yaml": example_job(namespace, image),
        "node-cordon.yaml": node_cordon_rbac(namespace),
    }


def render(namespace: str = "default", image: str | None = None, with_etcd: bool = False,
           with_example: bool = False, all_namespaces: bool = False, *, with_node_cordon: bool = False,
           generate_certs: bool = False) -> list[Manifest]:
    """Every object to apply, in apply order: CRD, RBAC, operator, [etcd], [example claim and job], [node cordon].

    ``image`` is the operator's, the etcd bootstrap Job's and the example job's image (default
    :func:`default_image`); with ``all_namespaces`` the operator serves jobs in every namespace, else only in
    ``namespace``. ``with_etcd`` adds the etcd (TLS and auth) and configures the operator for it; with
    ``generate_certs`` its Secrets too, made anew (private keys: see :func:`.etcd.generate_secrets`).
    Raises ConfigError for a namespace that is not a DNS label or an image that is not an image reference.
    """
    if generate_certs and not with_etcd:
        raise ConfigError("--etcd-generate-certs makes the Secrets of the optional etcd: add --with-etcd")
    groups = _groups(namespace, image, all_namespaces=all_namespaces, with_etcd=with_etcd,
                     generate_certs=generate_certs)
    optional = {"etcd.yaml": with_etcd, "example-job.yaml": with_example, "node-cordon.yaml": with_node_cordon}
    return [obj for name, objects in groups.items() if optional.get(name, True) for obj in objects]


def to_yaml(objects: Iterable[Mapping[str, Any]]) -> str:
    """Multi-document YAML, keys in the order the objects were built (kind and metadata first)."""
    text: str = yaml.safe_dump_all([dict(obj) for obj in objects], sort_keys=False, explicit_start=True,
                                   default_flow_style=False, width=120)
    return text


#: deploy/ file -> what it holds (its header line, and its line in deploy/README.md)
_FILES = {
    "crd.yaml": "the SteadJob custom resource definition (steadjobs.stead.dev, short name sj)",
    "rbac.yaml": "the operator's ServiceAccount, Role and RoleBinding (each job's master gets a ServiceAccount and "
                 "a Role of its own, made with the job)",
    "operator.yaml": "the operator's Deployment (one replica, kopf, liveness on :8080/healthz)",
    "etcd.yaml": "optional: a single-member etcd (Service stead-etcd) serving client TLS and authentication, its "
                 "NetworkPolicy, the Job that turns its authentication on, and the operator configured for it; "
                 "needs the Secrets stead-etcd-server, stead-etcd-client and stead-etcd-auth (README: Running on "
                 "Kubernetes)",
    "prometheus-scrape.yaml": "optional: a Prometheus scrape job for masters that serve metrics "
                              "(k8s.metrics_port, k8s.metrics_token_secret), with the bearer token from a file",
    "example-job.yaml": "optional: a SteadJob `example` (2 to 4 nodes, 2 workers each, examples/train.py) and the "
                        "ReadWriteMany claim its checkpoints persist to",
    "node-cordon.yaml": "optional: lets the masters cordon a node whose host failed its health check; only needed "
                        "for --set k8s.cordon_bad_hosts=true",
}


def deploy_files(namespace: str = "default", image: str | None = None, *, all_namespaces: bool = False,
                 ) -> dict[str, str]:
    """The contents of ``deploy/`` by file name: one YAML file per part, and a README listing them."""
    groups = _groups(namespace, image, all_namespaces=all_namespaces)
    files = {}
    for name, objects in groups.items():
        header = f"# {_FILES[name]}\n# generated by `{_THIS_COMMAND} --write deploy`: do not edit\n"
        files[name] = header + to_yaml(objects)
    scrape = "prometheus-scrape.yaml"
    files[scrape] = (f"# {_FILES[scrape]}\n# generated by `{_THIS_COMMAND} --write deploy`: do not edit; add it to "
                     f"Prometheus' configuration and mount the Secret's token at {PROMETHEUS_TOKEN_FILE}\n"
                     + yaml.safe_dump(prometheus_scrape_config(namespace, all_namespaces=all_namespaces),
                                      sort_keys=False, default_flow_style=False, width=120))
    lines = [f"- `{name}`: {_FILES[name]}" for name in [*groups, scrape]]
    files["README.md"] = (
        "# Kubernetes manifests of stead\n\n"
        f"Generated for namespace `{namespace}` by `{_THIS_COMMAND} --write deploy` (or `stead k8s manifests`, "
        "which prints them; `--namespace NS` for another namespace): do not edit, change "
        "`stead/platforms/k8s/manifests.py` and regenerate.\n\n"
        + "\n".join(lines) + "\n\n"
        "Apply the CRD first and wait until the API server serves it, then the rest:\n\n"
        "    kubectl apply -f deploy/crd.yaml\n"
        f"    kubectl wait --for condition=established crd/{JOB_PLURAL}.{API_GROUP}\n"
        "    kubectl apply -f deploy/rbac.yaml -f deploy/operator.yaml\n\n"
        "To try it out with the etcd (it configures the operator for it), make its Secrets first (README, "
        "\"Running on Kubernetes\", or `stead k8s manifests --with-etcd --etcd-generate-certs`, whose output holds "
        "new ones):\n\n"
        "    kubectl apply -f deploy/etcd.yaml -f deploy/example-job.yaml\n")
    return files


def write_deploy(directory: Path, namespace: str = "default", image: str | None = None, *,
                 all_namespaces: bool = False) -> list[Path]:
    """Write :func:`deploy_files` into ``directory`` (created if missing); returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in deploy_files(namespace, image, all_namespaces=all_namespaces).items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


# -- command line ---------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``stead k8s manifests`` (and of ``python -m stead.platforms.k8s.manifests``)."""
    parser.add_argument("--namespace", default="default",
                        help="namespace of the operator, the masters' RBAC and the optional parts (default: default)")
    parser.add_argument("--image", default=None,
                        help=f"image of the operator and the example job (default: {IMAGE_REPOSITORY}:<version>)")
    parser.add_argument("--all-namespaces", action="store_true",
                        help="the operator serves jobs in every namespace (default: only in --namespace)")
    parser.add_argument("--with-etcd", action="store_true",
                        help="add a single-member etcd (Service stead-etcd) with client TLS and authentication, and "
                             "configure the operator for it; its Secrets are yours to make (README) unless "
                             "--etcd-generate-certs")
    parser.add_argument("--etcd-generate-certs", action="store_true",
                        help="with --with-etcd: add its Secrets, made anew (a CA, certificates, passwords); the "
                             "output then holds private keys")
    parser.add_argument("--with-example", action="store_true", help="add an example job and its checkpoint claim")
    parser.add_argument("--with-node-cordon", action="store_true",
                        help="add the ClusterRole masters need for --set k8s.cordon_bad_hosts=true")
    parser.add_argument("--write", default=None, metavar="DIR", type=Path,
                        help="write the deploy/ files (every part, one file each, and a README) into DIR instead "
                             "of printing YAML")


def main(argv: Sequence[str] | None = None, *, prog: str = _THIS_COMMAND) -> int:
    """Print the manifests as YAML, or write them as files with ``--write DIR``; 2 on bad input."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if args.write is not None:
            for path in write_deploy(args.write, args.namespace, args.image, all_namespaces=args.all_namespaces):
                print(path)
        else:
            objects = render(args.namespace, args.image, args.with_etcd, args.with_example, args.all_namespaces,
                             with_node_cordon=args.with_node_cordon, generate_certs=args.etcd_generate_certs)
            if args.etcd_generate_certs:
                print(f"{parser.prog}: warning: this output holds the private keys and passwords of the etcd's "
                      "Secrets: apply it and do not keep it (the Secrets are in the cluster)", file=sys.stderr)
            sys.stdout.write(to_yaml(objects))
    except ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _check_namespace(namespace: str) -> None:
    if not _DNS_LABEL.fullmatch(namespace):
        raise ConfigError(f"namespace {namespace!r} is not a valid Kubernetes namespace name: use at most 63 "
                          "lowercase letters, digits and '-', starting and ending with a letter or digit "
                          "(e.g. stead-jobs)")


def check_job_name(job: str) -> None:
    """A job name that can name its Kubernetes objects (its master's Service is ``<job>-master``) and whose
    objects are not shared ones (``stead-master``, the ServiceAccount of :func:`node_cordon_rbac`)."""
    if len(job) > JOB_NAME_MAX or not _JOB_NAME.fullmatch(job):
        raise ConfigError(f"job name {job!r} cannot name Kubernetes objects: use at most {JOB_NAME_MAX} lowercase "
                          "letters, digits and '-', starting with a letter and ending with a letter or digit "
                          "(its master's Service is <job>-master)")
    if master_name(job) == MASTER_ACCOUNT:
        raise ConfigError(f"job name {job!r} would make its master's account {MASTER_ACCOUNT}, the ServiceAccount "
                          "that jobs allowed to cordon hosts share; choose another name")


def _check_image(image: str) -> str:
    if not image or any(c.isspace() for c in image):
        raise ConfigError(f"--image {image!r} is not an image reference; give one like "
                          f"{IMAGE_REPOSITORY}:TAG or registry.example.com/team/stead:TAG")
    return image


if __name__ == "__main__":
    sys.exit(main())
