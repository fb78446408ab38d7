"""The optional etcd of ``stead k8s manifests --with-etcd``: one member, served with client TLS and authentication.

Every job's event log is in the store, so it is not served to whoever reaches
it: clients present a certificate signed by the store's CA (``--client-cert-auth``)
and authenticate as the etcd user ``stead``, whose role reads and writes only
``/stead/``; a NetworkPolicy admits on its client port only the masters of stead
jobs, the operator and the bootstrap Job. etcd listens on its pod IP and on
loopback (the probes read ``/health`` on a plain-HTTP metrics port of the pod IP,
which serves no keys).

Three Secrets hold what it needs (their keys are :data:`SERVER_KEYS`,
:data:`CLIENT_KEYS` and :data:`AUTH_KEYS`): the user makes them (README, "Running
on Kubernetes", shows the commands), or ``--etcd-generate-certs`` writes them into
the output (a new CA, server and client certificates and passwords: the output then
holds private keys). The Job ``stead-etcd-auth`` (stead's image,
:mod:`.etcd_auth`) creates the root and ``stead`` users and turns authentication
on, once; it does nothing when it is on already.

One user for every job: a job's master can read another job's log. A tenant whose
jobs must not see each other's runs an etcd of its own.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping
from typing import Any

from stead.platforms.k8s.isolation import namespace_peer
from stead.platforms.k8s.names import LABEL_ROLE, ROLE_MASTER
from stead.platforms.k8s.pods import ETCD_PASSWORD_KEY, ETCD_TLS_KEYS, container_security, pod_security

__all__ = ["AUTH_KEYS", "AUTH_SECRET", "BOOTSTRAP_JOB", "CLIENT_KEYS", "CLIENT_SECRET", "ETCD_IMAGE", "ETCD_PORT",
           "ETCD_SERVICE", "ETCD_USER", "METRICS_PORT", "PREFIX", "SERVER_KEYS", "SERVER_SECRET", "etcd",
           "generate_secrets", "server_names"]

Manifest = dict[str, Any]

#: jobs use ``etcd://stead-etcd:2379``
ETCD_SERVICE = "stead-etcd"
ETCD_PORT = 2379
#: /health and /metrics, plain HTTP on the pod IP: what the kubelet's probes read (no keys are served there)
METRICS_PORT = 2381
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.21"
#: the server's certificate and key, and the CA its clients must be signed by
SERVER_SECRET = "stead-etcd-server"
SERVER_KEYS = ("ca.crt", "tls.crt", "tls.key")
#: the certificate the masters, the operator and the bootstrap Job present (the keys pods.etcd_client mounts)
CLIENT_SECRET = "stead-etcd-client"
CLIENT_KEYS = ETCD_TLS_KEYS
#: the passwords of etcd's root user (the bootstrap Job only) and of ETCD_USER (every client)
AUTH_SECRET = "stead-etcd-auth"
ROOT_PASSWORD_KEY = "root-password"
AUTH_KEYS = (ROOT_PASSWORD_KEY, ETCD_PASSWORD_KEY)
ETCD_USER = "stead"
#: every key stead writes is under it (the events, snapshots and plugin keys of /stead/jobs/<job>/)
PREFIX = "/stead/"
BOOTSTRAP_JOB = "stead-etcd-auth"
#: the operator's pods (its Deployment's label), admitted to etcd: it reads each job's status from the store
OPERATOR_LABELS = {"app.kubernetes.io/name": "stead-operator"}
_LABELS = {"app.kubernetes.io/name": ETCD_SERVICE, "app.kubernetes.io/component": "store",
           "app.kubernetes.io/part-of": "stead"}
_BOOTSTRAP_LABELS = {"app.kubernetes.io/name": BOOTSTRAP_JOB, "app.kubernetes.io/component": "store",
                     "app.kubernetes.io/part-of": "stead"}
_TLS_DIR = "/etc/etcd/tls"
#: the generated certificates' lifetime: long, for a store to try stead with (the README says how to renew)
_VALID_DAYS = 825
_NON_ROOT_ID = 65532


def _meta(name: str, namespace: str, labels: Mapping[str, str], annotations: Mapping[str, str] | None = None,
          ) -> Manifest:
    meta: Manifest = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def server_names(namespace: str) -> list[str]:
    """The names the server certificate must carry: how clients in and out of the namespace dial it."""
    return [ETCD_SERVICE, f"{ETCD_SERVICE}.{namespace}", f"{ETCD_SERVICE}.{namespace}.svc",
            f"{ETCD_SERVICE}.{namespace}.svc.cluster.local", "localhost"]


def etcd(namespace: str, image: str, *, all_namespaces: bool = False) -> list[Manifest]:
    """The Service, StatefulSet, NetworkPolicy and bootstrap Job of a single-member etcd with client TLS and
    authentication; the Secrets they read are :func:`generate_secrets`' or the user's. ``image`` is stead's
    (the bootstrap Job runs it); ``all_namespaces`` admits the masters of every namespace."""
    note = {"stead.dev/note": "for trying stead out: one member, no backups; client TLS and auth on"}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(ETCD_SERVICE, namespace, _LABELS, note),
        "spec": {"selector": {"app.kubernetes.io/name": ETCD_SERVICE},
                 "ports": [{"name": "client", "port": ETCD_PORT, "targetPort": "client", "protocol": "TCP"}]},
    }
    container = {
        "name": "etcd",
        "image": ETCD_IMAGE,
        "command": ["/usr/local/bin/etcd"],
        "args": [
            "--data-dir=/var/lib/etcd/data",
            # the pod's own address and loopback: nothing else of the pod's network (a pod has no other)
            f"--listen-client-urls=https://$(POD_IP):{ETCD_PORT},https://127.0.0.1:{ETCD_PORT}",
            f"--advertise-client-urls=https://{ETCD_SERVICE}.{namespace}.svc:{ETCD_PORT}",
            f"--listen-metrics-urls=http://$(POD_IP):{METRICS_PORT}",
            f"--cert-file={_TLS_DIR}/tls.crt", f"--key-file={_TLS_DIR}/tls.key",
            f"--trusted-ca-file={_TLS_DIR}/ca.crt", "--client-cert-auth=true",
        ],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "client", "containerPort": ETCD_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        # /health fails while the member has no leader or raised an alarm: not ready, but not restarted for it
        "readinessProbe": {"httpGet": {"path": "/health", "port": "metrics"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "client"}, "initialDelaySeconds": 10, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"},
                         {"name": "tls", "mountPath": _TLS_DIR, "readOnly": True}],
    }
    stateful_set = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(ETCD_SERVICE, namespace, _LABELS, note),
        "spec": {
            "serviceName": ETCD_SERVICE,
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": ETCD_SERVICE}},
            "template": {
                "metadata": {"labels": dict(_LABELS)},
                "spec": {"securityContext": pod_security(_NON_ROOT_ID), "automountServiceAccountToken": False,
                         "containers": [container],
                         "volumes": [_secret_volume("tls", SERVER_SECRET, SERVER_KEYS)]},
            },
            "volumeClaimTemplates": [{
                "metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
            }],
        },
    }
    return [service, stateful_set, _network_policy(namespace, all_namespaces=all_namespaces),
            _bootstrap_job(namespace, image)]


def _secret_volume(name: str, secret: str, keys: tuple[str, ...]) -> Manifest:
    return {"name": name, "secret": {"secretName": secret, "defaultMode": 0o440,
                                     "items": [{"key": key, "path": key} for key in keys]}}


def _network_policy(namespace: str, *, all_namespaces: bool) -> Manifest:
    """In: the client port from the masters of stead jobs, the operator and the bootstrap Job; out: nothing."""
    masters = namespace_peer(None if all_namespaces else namespace, {LABEL_ROLE: ROLE_MASTER})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(ETCD_SERVICE, namespace, _LABELS),
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": ETCD_SERVICE}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [masters, namespace_peer(namespace, OPERATOR_LABELS),
                                  namespace_peer(namespace, {"app.kubernetes.io/name": BOOTSTRAP_JOB})],
                         "ports": [{"protocol": "TCP", "port": ETCD_PORT}]}],
            "egress": [],
        },
    }


def _bootstrap_job(namespace: str, image: str) -> Manifest:
    """Creates the root and ``stead`` users (``stead`` may read and write :data:`PREFIX` only) and turns
    authentication on; run again (the Job is retried until etcd answers), it finds auth on and stops."""
    mount = "/var/run/stead-etcd"
    container = {
        "name": "auth",
        "image": image,
        "command": ["python", "-m", "stead.platforms.k8s.etcd_auth",
                    "--endpoint", f"https://{ETCD_SERVICE}.{namespace}.svc:{ETCD_PORT}",
                    "--ca-file", f"{mount}/tls/ca.crt", "--cert-file", f"{mount}/tls/tls.crt",
                    "--key-file", f"{mount}/tls/tls.key", "--root-password-file", f"{mount}/auth/{ROOT_PASSWORD_KEY}",
                    "--user", ETCD_USER, "--password-file", f"{mount}/auth/{ETCD_PASSWORD_KEY}", "--prefix", PREFIX],
        "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}, {"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tls", "mountPath": f"{mount}/tls", "readOnly": True},
                         {"name": "auth", "mountPath": f"{mount}/auth", "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(BOOTSTRAP_JOB, namespace, _BOOTSTRAP_LABELS),
        "spec": {
            "backoffLimit": 20,  # until etcd answers (its volume bound, its pod ready): a minute or a few
            "template": {
                "metadata": {"labels": dict(_BOOTSTRAP_LABELS)},
                "spec": {"restartPolicy": "OnFailure", "securityContext": pod_security(_NON_ROOT_ID),
                         "automountServiceAccountToken": False, "containers": [container],
                         "volumes": [_secret_volume("tls", CLIENT_SECRET, CLIENT_KEYS),
                                     _secret_volume("auth", AUTH_SECRET, AUTH_KEYS),
                                     {"name": "tmp", "emptyDir": {}}]},
            },
        },
    }


# -- generated certificates and passwords ---------------------------------------------------------------------------


def generate_secrets(namespace: str) -> list[Manifest]:
    """The three Secrets etcd and its clients read, made anew: a CA (EC P-256), the server's certificate for
    :func:`server_names`, a client certificate (no common name: see below) and two random passwords. They hold private
    keys."""
    from stead.core.certs import Authority

    authority = Authority("stead-etcd", valid=datetime.timedelta(days=_VALID_DAYS))
    ca = authority.own.cert_pem.decode()
    server = authority.issue(ETCD_SERVICE, server=True, client=True, hosts=[*server_names(namespace), "127.0.0.1"])
    # no common name: etcd would take it as the user when no password is given (the certificate alone would then
    # be a login), and its JSON gateway refuses a certificate that has one once authentication is on
    client = authority.issue("", server=False, client=True, hosts=())
    note = {"stead.dev/note": "generated by stead k8s manifests --etcd-generate-certs: private keys"}

    def secret(secret_name: str, data: dict[str, str], kind: str = "Opaque") -> Manifest:
        return {"apiVersion": "v1", "kind": "Secret", "type": kind,
                "metadata": _meta(secret_name, namespace, _LABELS, note), "stringData": data}

    return [
        secret(SERVER_SECRET, {"ca.crt": ca, "tls.crt": server.cert_pem.decode(), "tls.key": server.key_pem.decode()}),
        secret(CLIENT_SECRET, {"ca.crt": ca, "tls.crt": client.cert_pem.decode(), "tls.key": client.key_pem.decode()}),
        secret(AUTH_SECRET, {ROOT_PASSWORD_KEY: secrets.token_urlsafe(32),
                             ETCD_PASSWORD_KEY: secrets.token_urlsafe(32)}),
    ]
