"""What keeps one job apart from the rest of its namespace: its master's RBAC and its NetworkPolicies.

**RBAC, per job.** A Role naming one Secret (``resourceNames``) cannot serve every
job of a namespace, so each job gets its own: a ServiceAccount ``<job>-master``,
a Role ``<job>-master`` that reads only that job's token Secret and SteadJob and
manages pods, and their RoleBinding, all owned by the job (deleted with it). They
are made where the job's other objects are made (:mod:`.jobs`): by the operator
for a SteadJob, by ``stead run --platform k8s`` otherwise. Kubernetes lets an
account create a Role, or bind one, only when it holds every permission the Role
grants (or the ``escalate`` / ``bind`` verbs, which stead never asks for): the
operator's own Role holds a superset (pods; secrets and steadjobs ``get``), so
it needs only ``create`` and ``delete`` on serviceaccounts, roles and
rolebindings in the namespaces it serves. RBAC cannot say what a pod its holder
creates may look like: the master can create pods, so :mod:`.policy` checks what
a job asks for before its master exists.

**NetworkPolicies, per job.** Default deny, then what a job needs: every pod of
the job reaches every other (the master's RPC port, the workers' gloo/NCCL ports,
which are dynamic), DNS, and for the master the Kubernetes API and its store. A
NetworkPolicy selects pods by label within a namespace: whoever may create pods
with the label ``stead.dev/job=<job>`` in that namespace is inside. That is why
every RPC carries the job's token and the store speaks TLS: the policy narrows who
can try, the token and the certificates decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stead.core.errors import ConfigError
from stead.core.store.etcd import parse_etcd_url
from stead.platforms.k8s.names import API_GROUP, JOB_PLURAL, LABEL_JOB, LABEL_ROLE, MANAGED_BY, ROLE_MASTER, master_name
from stead.platforms.k8s.names import secret_name as token_secret_name

__all__ = ["API_SERVER_PORTS", "DNS_PORT", "job_rbac", "master_rules", "namespace_peer", "network_policies",
           "network_policy_name", "rule", "store_ports"]

Manifest = dict[str, Any]

#: where pods reach the Kubernetes API: the ``kubernetes`` Service's port, and the port its endpoints listen on
#: (a NetworkPolicy sees the connection after the Service's address was translated to an endpoint's)
API_SERVER_PORTS = (443, 6443)
DNS_PORT = 53
_RBAC = "rbac.authorization.k8s.io"


def rule(group: str, resources: Sequence[str], verbs: Sequence[str], *, names: Sequence[str] = ()) -> Manifest:
    """One RBAC rule; ``names`` restricts it to those objects (``resourceNames``)."""
    found: Manifest = {"apiGroups": [group], "resources": list(resources), "verbs": list(verbs)}
    if names:
        found["resourceNames"] = list(names)
    return found


def master_rules(job: str) -> list[Manifest]:
    """What the master of ``job`` does with the API: exactly these verbs, in its own namespace."""
    return [
        # its nodes: launched, watched (exits, evictions, pending), relaunched, deleted; a pod's name is made per
        # incarnation and list/watch/create take no resourceNames, so pods cannot be narrowed to one job's
        rule("", ["pods"], ["list", "watch", "create", "delete"]),
        # its job's owner, which its pods name: the SteadJob, or the token Secret of a job run without the CRD
        rule(API_GROUP, [JOB_PLURAL], ["get"], names=[job]),
        rule("", ["secrets"], ["get"], names=[token_secret_name(job)]),
    ]


def _labels(job: str) -> dict[str, str]:
    return {"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/part-of": "stead", LABEL_JOB: job}


def _meta(name: str, namespace: str, job: str) -> Manifest:
    return {"name": name, "namespace": namespace, "labels": _labels(job)}


def job_rbac(job: str, namespace: str, account: str = "") -> list[Manifest]:
    """The job's master RBAC: its ServiceAccount (unless ``account`` names an existing one it runs as), its Role
    and the RoleBinding of the two. A shared ``account`` gathers the Roles of every job that runs as it."""
    name = master_name(job)
    subject = account or name
    objects: list[Manifest] = []
    if not account:
        objects.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, namespace, job)})
    objects.append({"apiVersion": f"{_RBAC}/v1", "kind": "Role", "metadata": _meta(name, namespace, job),
                    "rules": master_rules(job)})
    objects.append({"apiVersion": f"{_RBAC}/v1", "kind": "RoleBinding", "metadata": _meta(name, namespace, job),
                    "roleRef": {"apiGroup": _RBAC, "kind": "Role", "name": name},
                    "subjects": [{"kind": "ServiceAccount", "name": subject, "namespace": namespace}]})
    return objects


def network_policy_name(job: str) -> str:
    """The NetworkPolicy that isolates a job's pods (another, ``<job>-master``, lets its master out)."""
    return f"{job}-isolation"


def namespace_peer(namespace: str | None, labels: dict[str, str]) -> Manifest:
    """Pods with ``labels`` in ``namespace`` (every namespace when None), as one NetworkPolicy peer."""
    peer: Manifest = {"podSelector": {"matchLabels": dict(labels)}}
    peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}} if namespace else {}
    return peer


def store_ports(store_url: str) -> list[int]:
    """The TCP ports of an ``etcd://`` store URL (2379 where none is given), read as the store reads it (a user,
    a query of TLS files); none for another store."""
    if not store_url.startswith("etcd://"):
        return []
    return sorted({port for _, port in parse_etcd_url(store_url)})


def network_policies(job: str, namespace: str, *, store_url: str, metrics_port: int = -1,
                     egress_cidrs: str = "") -> list[Manifest]:
    """Default deny for the job's pods, and what they need:

    - ``<job>-isolation`` (every pod of the job): in from and out to the job's own pods, any port; out to DNS;
      out to ``egress_cidrs`` (``k8s.node_egress_cidrs``: a data store, the internet) when given;
    - ``<job>-master`` (its master): out to the Kubernetes API and to the store's ports; in on ``metrics_port``
      from any namespace (a Prometheus; the scrape must carry the metrics token) when the master serves metrics.
    """
    own = [namespace_peer(namespace, {LABEL_JOB: job})]
    cidrs = [c.strip() for c in egress_cidrs.split(",") if c.strip()]
    for cidr in cidrs:
        if "/" not in cidr:
            raise ConfigError(f"k8s.node_egress_cidrs item {cidr!r} is not a CIDR; write it like 10.0.0.0/8 "
                              "(0.0.0.0/0 for anywhere)")
    egress: list[Manifest] = [
        {"to": own},
        {"ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]},
    ]
    if cidrs:
        egress.append({"to": [{"ipBlock": {"cidr": cidr}} for cidr in cidrs]})
    isolation = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(network_policy_name(job), namespace, job),
        "spec": {"podSelector": {"matchLabels": {LABEL_JOB: job}}, "policyTypes": ["Ingress", "Egress"],
                 "ingress": [{"from": own}], "egress": egress},
    }
    master_egress = [{"ports": [{"protocol": "TCP", "port": port} for port in API_SERVER_PORTS]}]
    ports = store_ports(store_url)
    if ports:
        master_egress.append({"ports": [{"protocol": "TCP", "port": port} for port in ports]})
    master_spec: Manifest = {"podSelector": {"matchLabels": {LABEL_JOB: job, LABEL_ROLE: ROLE_MASTER}},
                             "policyTypes": ["Egress"], "egress": master_egress}
    if metrics_port > 0:
        master_spec["policyTypes"] = ["Ingress", "Egress"]
        master_spec["ingress"] = [{"from": [{"namespaceSelector": {}}],
                                   "ports": [{"protocol": "TCP", "port": metrics_port}]}]
    master = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": _meta(master_name(job), namespace, job), "spec": master_spec}
    return [isolation, master]
