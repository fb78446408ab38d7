"""What stead asks Kubernetes for: the pods of a job's nodes and of its master, as plain objects.

Pure functions (no IO), so the objects can be validated offline and read in a
test. A pod carries what stead's features need and a container runtime does
not give by default:

- ``/dev/shm`` as a memory ``emptyDir`` sized ``k8s.shm_size`` (a container's
  default 64 MiB cannot hold a flash checkpoint's two slots);
- the job token from its Secret, mounted read-only as a file (never a plain
  environment value in the pod spec), mode 0440 with the pod's ``fsGroup`` so
  that the agent reads it as its non-root user;
- the "restricted" Pod Security Standard: a non-root user (``k8s.run_as_user``),
  no privilege escalation, every capability dropped, the runtime's seccomp
  profile, a read-only root filesystem with writable ``emptyDir`` volumes at
  ``/tmp`` and where stead writes (``CAP_SYS_PTRACE`` on request is the one
  exception: see ``k8s.ptrace``);
- a ReadWriteMany claim for persisted checkpoints (``k8s.checkpoint_claim``), so
  that a node relaunched on another host restores from disk;
- ``terminationGracePeriodSeconds`` for the persist an agent does on SIGTERM;
- ``restartPolicy: Never``: a failed node is relaunched by the master, as a new
  pod with a new name, never restarted in place by the kubelet;
- node anti-affinity for hosts excluded as faulty, ``CAP_SYS_PTRACE`` on request;
- labels naming the job, node, incarnation and replica type (the reference
  system's ``elasticjob.dlrover/*`` ones too) and an owner reference to the job's
  resource, so deleting the job deletes everything.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stead.core.config import Settings, env_name
from stead.core.errors import ConfigError
from stead.core.master import JOB_TOKEN_ENV
from stead.core.platform import HOST_ENV, NodeSpec
from stead.core.quantity import QuantityError, parse_quantity
from stead.platforms.k8s import names
from stead.platforms.k8s.settings import K8sSettings

__all__ = ["AGENT_CONTAINER", "ETCD_AUTH_MOUNT", "ETCD_PASSWORD_KEY", "ETCD_TLS_KEYS", "ETCD_TLS_MOUNT",
           "METRICS_PORT_NAME", "SHM_MOUNT", "TMP_MOUNT", "TOKEN_FILE", "TOKEN_KEY", "TOKEN_MOUNT", "JobObjects",
           "Owner", "check_quantity", "container_security", "etcd_client", "master_account", "master_pod",
           "master_service", "node_pod", "passed_env", "pod_labels", "pod_security", "token_secret"]

JsonObject = dict[str, Any]

AGENT_CONTAINER = "agent"
MASTER_CONTAINER = "master"
SHM_MOUNT = "/dev/shm"
#: where the job token's Secret is mounted, and the file agents read
TOKEN_MOUNT = "/var/run/stead"
TOKEN_KEY = "token"
TOKEN_FILE = f"{TOKEN_MOUNT}/{TOKEN_KEY}"
#: the master's environment variable holding the token (from the Secret: the master stores it as the job's token)
MASTER_TOKEN_ENV = JOB_TOKEN_ENV
#: a writable emptyDir under a read-only root filesystem (HOME too: the non-root user has no home in the image)
TMP_MOUNT = "/tmp"
CKPT_DIR_ENV = "STEAD_CKPT_DIR"
#: the token Secret's files: read-only, readable by the pod's group (its fsGroup), nobody else
TOKEN_MODE = 0o440
#: where the master writes the token file (an emptyDir: agents of a pod read the Secret's at the same path)
MASTER_TOKEN_FILE = TOKEN_FILE
#: the port name Prometheus' scrape config keeps (k8s.metrics_port)
METRICS_PORT_NAME = "metrics"
METRICS_TOKEN_MOUNT = "/var/run/stead-metrics"
#: the store's client credentials in the pods that talk to etcd (masters, the operator)
ETCD_TLS_MOUNT = "/var/run/stead-etcd/tls"
ETCD_TLS_KEYS = ("ca.crt", "tls.crt", "tls.key")
ETCD_AUTH_MOUNT = "/var/run/stead-etcd/auth"
ETCD_PASSWORD_KEY = "password"
#: the settings that name a process's own credentials (the etcd_* client settings, metrics_host/_token_file)
_OWN_CREDENTIALS = ("STEAD_ETCD_", "STEAD_METRICS_HOST", "STEAD_METRICS_TOKEN_FILE")
#: what every container of a job's pod runs with, unless more is allowed and asked (see container_security)
_PYTHON_ENV = ({"name": "HOME", "value": TMP_MOUNT}, {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"})



@dataclasses.dataclass(frozen=True)
class Owner:
    """The object a job's pods belong to (its SteadJob, or its token Secret when it runs without the CRD):
    deleting it has Kubernetes delete them all."""

    api_version: str
    kind: str
    name: str
    uid: str

    def reference(self) -> JsonObject:
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


@dataclasses.dataclass(frozen=True)
class JobObjects:
    """Where a job's objects are: its namespace, its owner, and the address agents dial for its master."""

    job: str
    namespace: str
    master_address: str
    owner: Owner | None = None


def check_quantity(value: str, what: str) -> str:
    """``value`` if it is a Kubernetes quantity (8, 7500m, 64Gi, 1e3), else a ConfigError naming ``what``."""
    try:
        parse_quantity(value.strip())
    except QuantityError:
        raise ConfigError(f"{what} {value!r} is not a Kubernetes quantity; write it like 8, 500m, 64Gi or 1.5G") \
            from None
    return value.strip()


def pod_labels(job: str, role: str, *, node_id: str = "", incarnation: int | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "stead", "app.kubernetes.io/managed-by": names.MANAGED_BY,
              names.LABEL_JOB: job, names.LABEL_ROLE: role, names.DLROVER_JOB: job,
              names.DLROVER_REPLICA_TYPE: "worker" if role == names.ROLE_NODE else "dlrover-master"}
    if node_id:
        labels[names.LABEL_NODE_ID] = node_id
        index = names.node_index(node_id)
        if index is not None:
            labels[names.DLROVER_REPLICA_INDEX] = str(index)
            labels[names.DLROVER_RANK_INDEX] = str(index)
    if incarnation is not None:
        labels[names.LABEL_INCARNATION] = str(incarnation)
        labels[names.DLROVER_RELAUNCH_COUNT] = str(incarnation - 1)
    return labels


def passed_env(environ: Mapping[str, str], settings: Settings, plugins: Iterable[str]) -> dict[str, str]:
    """The settings in this process's environment (``STEAD_<NAME>``, ``STEAD_<PLUGIN>_<NAME>``) that a node's pod
    gets too: what a user exported for the job reaches its agents as it does on the local platform. Nothing else
    of the master's environment goes into a pod spec (a token, a path of this machine), nor its own credentials:
    the store's client certificate and password and the metrics token are files of its pod, which a pod made from
    this one mounts anew where it needs them (:func:`etcd_client`)."""
    own = {"STEAD_" + f.name.upper() for f in dataclasses.fields(settings) if f.name != "plugin_values"}
    prefixes = tuple(f"STEAD_{p.upper()}_" for p in plugins if p != "k8s")
    return {k: v for k, v in environ.items()
            if (k in own or (k.startswith(prefixes) and k != MASTER_TOKEN_ENV)) and not k.startswith(_OWN_CREDENTIALS)}


def pod_security(user: int) -> JsonObject:
    """A pod's securityContext for the "restricted" Pod Security Standard: ``user`` (not root) as uid, gid and
    fsGroup (so that mounted Secrets of mode 0440 are readable), and the container runtime's seccomp profile."""
    if user <= 0:
        raise ConfigError(f"k8s.run_as_user={user}: a job's pods run as a non-root user; give a uid above 0")
    return {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user, "fsGroup": user,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security(*, read_only: bool = True, ptrace: bool = False) -> JsonObject:
    """A container's securityContext: no privilege, every capability dropped, the root filesystem read-only.

    ``ptrace`` adds CAP_SYS_PTRACE and lets file capabilities apply (allowPrivilegeEscalation), so that a py-spy
    carrying that capability works as the non-root user: the pod then passes only the "privileged" level.
    """
    capabilities: JsonObject = {"drop": ["ALL"]}
    if ptrace:
        capabilities["add"] = ["SYS_PTRACE"]
    return {"allowPrivilegeEscalation": ptrace, "privileged": False, "readOnlyRootFilesystem": read_only,
            "capabilities": capabilities}


def node_pod(spec: NodeSpec, objects: JobObjects, settings: K8sSettings, *, env: Mapping[str, str] | None = None,
             avoid_hosts: Sequence[str] = (), memory: str = "") -> JsonObject:
    """The pod of one node incarnation. ``memory`` overrides ``k8s.memory`` (a node relaunched after an
    out-of-memory kill gets more)."""
    command = _agent_argv(spec.command, objects.master_address)
    container_env: list[JsonObject] = [{"name": k, "value": v}
                                       for k, v in sorted({**dict(env or {}), **dict(spec.env)}.items())]
    container_env += [
        {"name": HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "STEAD_CKPT_SHM_DIR", "value": SHM_MOUNT},
        *_PYTHON_ENV,
        *_json_list(settings.env, "k8s.env", "EnvVar"),
    ]
    if not any(item["name"] == CKPT_DIR_ENV for item in container_env):
        # persisted checkpoints: on the claim, or (none given) on the pod's own disk, not its read-only image
        container_env.append({"name": CKPT_DIR_ENV, "value": settings.checkpoint_mount})
    mounts: list[JsonObject] = [{"name": "shm", "mountPath": SHM_MOUNT},
                                {"name": "token", "mountPath": TOKEN_MOUNT, "readOnly": True},
                                {"name": "tmp", "mountPath": TMP_MOUNT},
                                {"name": "checkpoints", "mountPath": settings.checkpoint_mount}]
    volumes: list[JsonObject] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": check_quantity(settings.shm_size,
                                                                                      "k8s.shm_size")}},
        _token_volume(objects.job),
        {"name": "tmp", "emptyDir": {}},
        {"name": "checkpoints", **({"persistentVolumeClaim": {"claimName": settings.checkpoint_claim}}
                                   if settings.checkpoint_claim else {"emptyDir": {}})},
    ]
    container: JsonObject = {
        "name": AGENT_CONTAINER, "image": _image(settings), "imagePullPolicy": settings.image_pull_policy,
        "command": list(command), "env": container_env, "volumeMounts": mounts,
        "resources": _resources(settings, memory=memory),
        "securityContext": container_security(read_only=settings.read_only_root_fs, ptrace=settings.ptrace),
    }
    if settings.working_dir:
        container["workingDir"] = settings.working_dir
    pod_spec: JsonObject = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": settings.grace_period_s,
        "automountServiceAccountToken": False,  # an agent never calls the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": pod_security(settings.run_as_user),
        "containers": [container],
        "volumes": volumes,
    }
    selector = _node_selector(settings.node_selector)
    if selector:
        pod_spec["nodeSelector"] = selector
    tolerations = _json_list(settings.tolerations, "k8s.tolerations", "Toleration")
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if avoid_hosts:
        pod_spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": sorted(avoid_hosts)}]}]}}}
    metadata: JsonObject = {
        "name": names.pod_name(objects.job, spec.node_id, spec.incarnation),
        "namespace": objects.namespace,
        "labels": pod_labels(objects.job, names.ROLE_NODE, node_id=spec.node_id, incarnation=spec.incarnation),
    }
    if objects.owner is not None:
        metadata["ownerReferences"] = [objects.owner.reference()]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def master_pod(objects: JobObjects, settings: K8sSettings, *, name: str, store_url: str, run_args: Sequence[str],
               env: Mapping[str, str] | None = None, log_format: str = "json") -> JsonObject:
    """The master's pod: ``stead master --platform k8s`` with the job's ``stead run`` arguments, listening on its
    pod IP at ``k8s.master_port`` (its Service's target), the token from the job's Secret, running as the job's
    own ServiceAccount (:func:`master_account`); with ``k8s.etcd_*`` the store's client certificate and password
    from their Secrets, with ``k8s.metrics_port`` its metrics behind the token of ``k8s.metrics_token_secret``."""
    command = ["python", "-m", "stead", "master", "--job", objects.job, "--store", store_url, "--platform", "k8s",
               "--host", "$(POD_IP)", "--port", str(settings.master_port), "--token-file", MASTER_TOKEN_FILE,
               "--metrics-port", str(settings.metrics_port), "--log-format", log_format, "--", *run_args]
    container_env: list[JsonObject] = [{"name": k, "value": v} for k, v in sorted(dict(env or {}).items())]
    container_env += [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": MASTER_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": names.secret_name(objects.job),
                                                                  "key": TOKEN_KEY}}},
        *_PYTHON_ENV,
    ]
    mounts: list[JsonObject] = [{"name": "tmp", "mountPath": TMP_MOUNT}, {"name": "run", "mountPath": TOKEN_MOUNT}]
    volumes: list[JsonObject] = [{"name": "tmp", "emptyDir": {}}, {"name": "run", "emptyDir": {}}]
    ports: list[JsonObject] = [{"name": "rpc", "containerPort": settings.master_port}]
    if settings.metrics_port > 0:
        if not settings.metrics_token_secret:
            raise ConfigError(f"k8s.metrics_port={settings.metrics_port} serves the master's metrics on its pod IP: "
                              "give k8s.metrics_token_secret, a Secret whose key 'token' Prometheus must send "
                              "(see `stead k8s manifests`' prometheus-scrape.yaml)")
        ports.append({"name": METRICS_PORT_NAME, "containerPort": settings.metrics_port})
        container_env += [{"name": env_name("", "metrics_host"), "value": "$(POD_IP)"},
                          {"name": env_name("", "metrics_token_file"), "value": f"{METRICS_TOKEN_MOUNT}/{TOKEN_KEY}"}]
        mounts.append({"name": "metrics-token", "mountPath": METRICS_TOKEN_MOUNT, "readOnly": True})
        volumes.append(_secret_volume("metrics-token", settings.metrics_token_secret, (TOKEN_KEY,)))
    etcd_env, etcd_mounts, etcd_volumes = etcd_client(settings)
    container: JsonObject = {
        "name": MASTER_CONTAINER, "image": settings.master_image or _image(settings),
        "imagePullPolicy": settings.image_pull_policy,
        "command": command, "env": [*container_env, *etcd_env], "ports": ports,
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [*mounts, *etcd_mounts],
    }
    if settings.working_dir:
        container["workingDir"] = settings.working_dir
    metadata: JsonObject = {"name": name, "namespace": objects.namespace,
                            "labels": pod_labels(objects.job, names.ROLE_MASTER)}
    if objects.owner is not None:
        metadata["ownerReferences"] = [objects.owner.reference()]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {
        "restartPolicy": "Never", "serviceAccountName": master_account(objects.job, settings),
        "terminationGracePeriodSeconds": 30, "enableServiceLinks": False,
        "securityContext": pod_security(settings.run_as_user), "containers": [container],
        "volumes": [*volumes, *etcd_volumes]}}


def master_account(job: str, settings: K8sSettings) -> str:
    """The ServiceAccount a job's master runs as: ``k8s.service_account`` when given (it must be allowed, see
    :mod:`.policy`), else the job's own (``<job>-master``), whose Role reads only this job's Secret."""
    return settings.service_account or names.master_name(job)


def etcd_client(settings: K8sSettings) -> tuple[list[JsonObject], list[JsonObject], list[JsonObject]]:
    """The environment, mounts and volumes that give a pod the store's client credentials: the TLS Secret of
    ``k8s.etcd_client_secret`` (``ca.crt``, ``tls.crt``, ``tls.key``) and the password of ``k8s.etcd_user`` in
    ``k8s.etcd_auth_secret`` (key ``password``), as the files the ``etcd_*`` settings name."""
    env: list[JsonObject] = []
    mounts: list[JsonObject] = []
    volumes: list[JsonObject] = []
    if settings.etcd_client_secret:
        mounts.append({"name": "etcd-tls", "mountPath": ETCD_TLS_MOUNT, "readOnly": True})
        volumes.append(_secret_volume("etcd-tls", settings.etcd_client_secret, ETCD_TLS_KEYS))
        env += [{"name": env_name("", setting), "value": f"{ETCD_TLS_MOUNT}/{key}"}
                for setting, key in (("etcd_ca_file", "ca.crt"), ("etcd_cert_file", "tls.crt"),
                                     ("etcd_key_file", "tls.key"))]
    if settings.etcd_user:
        if not settings.etcd_auth_secret:
            raise ConfigError(f"k8s.etcd_user={settings.etcd_user} needs its password: give k8s.etcd_auth_secret, a "
                              "Secret whose key 'password' holds it (`stead k8s manifests --with-etcd` names "
                              "stead-etcd-auth)")
        mounts.append({"name": "etcd-auth", "mountPath": ETCD_AUTH_MOUNT, "readOnly": True})
        volumes.append(_secret_volume("etcd-auth", settings.etcd_auth_secret, (ETCD_PASSWORD_KEY,)))
        env += [{"name": env_name("", "etcd_user"), "value": settings.etcd_user},
                {"name": env_name("", "etcd_password_file"), "value": f"{ETCD_AUTH_MOUNT}/{ETCD_PASSWORD_KEY}"}]
    return env, mounts, volumes


def _secret_volume(name: str, secret: str, keys: Sequence[str]) -> JsonObject:
    """Only ``keys`` of the Secret, readable by the pod's group (its fsGroup) and nobody else."""
    return {"name": name, "secret": {"secretName": secret, "defaultMode": TOKEN_MODE,
                                     "items": [{"key": key, "path": key} for key in keys]}}


def _token_volume(job: str) -> JsonObject:
    return _secret_volume("token", names.secret_name(job), (TOKEN_KEY,))


def master_service(objects: JobObjects, settings: K8sSettings) -> JsonObject:
    """The Service agents dial: a stable name for whichever pod is the job's master now."""
    metadata: JsonObject = {"name": names.master_name(objects.job), "namespace": objects.namespace,
                            "labels": pod_labels(objects.job, names.ROLE_MASTER)}
    if objects.owner is not None:
        metadata["ownerReferences"] = [objects.owner.reference()]
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": {
        "selector": {names.LABEL_JOB: objects.job, names.LABEL_ROLE: names.ROLE_MASTER},
        "ports": [{"name": "rpc", "port": settings.master_port, "targetPort": settings.master_port}]}}


def token_secret(job: str, namespace: str, token: str, *, owner: Owner | None = None) -> JsonObject:
    metadata: JsonObject = {"name": names.secret_name(job), "namespace": namespace,
                            "labels": {names.LABEL_JOB: job, "app.kubernetes.io/managed-by": names.MANAGED_BY}}
    if owner is not None:
        metadata["ownerReferences"] = [owner.reference()]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "stringData": {TOKEN_KEY: token}}


def _image(settings: K8sSettings) -> str:
    if not settings.image:
        raise ConfigError("the Kubernetes platform needs a container image with stead and the training script: "
                          "--set k8s.image=IMAGE (or the SteadJob's spec.image)")
    return settings.image


def _agent_argv(command: Sequence[str], master_address: str) -> tuple[str, ...]:
    """The agent's argv in a pod: the image's ``python`` (the master's interpreter path means nothing there), the
    master's address as pods reach it, and the token from the mounted Secret."""
    if not command:
        raise ConfigError("a node's agent command is empty; give the agent's argv")
    argv = list(command)
    if os.path.isabs(argv[0]) and os.path.basename(argv[0]).startswith("python"):
        argv[0] = "python"
    for flag, value in (("--master", master_address), ("--token-file", TOKEN_FILE)):
        if flag in argv[:-1]:
            argv[argv.index(flag) + 1] = value
    return tuple(argv)


def _resources(settings: K8sSettings, *, memory: str) -> JsonObject:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if settings.cpu:
        requests["cpu"] = limits["cpu"] = check_quantity(settings.cpu, "k8s.cpu")
    memory = memory or settings.memory
    if memory:
        requests["memory"] = limits["memory"] = check_quantity(memory, "k8s.memory")
    if settings.gpus:
        limits["nvidia.com/gpu"] = requests["nvidia.com/gpu"] = str(settings.gpus)
    found: JsonObject = {}
    if requests:
        found["requests"] = requests
    if limits:
        found["limits"] = limits
    return found


def _node_selector(text: str) -> dict[str, str]:
    selector: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"k8s.node_selector item {item!r} must be key=value (comma-separated)")
        selector[key.strip()] = value.strip()
    return selector


def _json_list(text: str, what: str, kind: str) -> list[JsonObject]:
    if not text.strip():
        return []
    try:
        found = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{what} is not JSON ({exc}); give a JSON list of Kubernetes {kind} objects") from None
    if not isinstance(found, list) or not all(isinstance(item, dict) for item in found):
        raise ConfigError(f"{what} must be a JSON list of Kubernetes {kind} objects, got {text[:80]!r}")
    return found
