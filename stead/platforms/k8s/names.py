"""The names stead gives its Kubernetes objects: labels, the job resource, object names.

One module so that the platform, the operator, the manifests and the tests agree.
The reference system's ``elasticjob.dlrover/*`` labels are set too where they
mean the same thing, so dashboards and selectors written for it keep working.
"""

from __future__ import annotations

import re

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "DLROVER_JOB",
    "DLROVER_RANK_INDEX",
    "DLROVER_RELAUNCH_COUNT",
    "DLROVER_REPLICA_INDEX",
    "DLROVER_REPLICA_TYPE",
    "JOB_KIND",
    "JOB_PLURAL",
    "LABEL_INCARNATION",
    "LABEL_JOB",
    "LABEL_NODE_ID",
    "LABEL_ROLE",
    "MANAGED_BY",
    "ROLE_MASTER",
    "ROLE_NODE",
    "master_name",
    "node_index",
    "pod_name",
    "secret_name",
]

#: the job resource (CRD): ``stead.dev/v1`` ``SteadJob``
API_GROUP = "stead.dev"
API_VERSION = "v1"
JOB_KIND = "SteadJob"
JOB_PLURAL = "steadjobs"

#: stead's own labels
LABEL_JOB = "stead.dev/job"
LABEL_ROLE = "stead.dev/role"
LABEL_NODE_ID = "stead.dev/node-id"
LABEL_INCARNATION = "stead.dev/incarnation"
ROLE_MASTER = "master"
ROLE_NODE = "node"
#: ``app.kubernetes.io/managed-by`` on everything stead creates
MANAGED_BY = "stead"

#: the reference system's labels, where they mean the same
DLROVER_JOB = "elasticjob.dlrover/name"
DLROVER_REPLICA_TYPE = "elasticjob.dlrover/replica-type"  # "worker" for a node, "dlrover-master" for the master
DLROVER_REPLICA_INDEX = "elasticjob.dlrover/replica-index"
DLROVER_RANK_INDEX = "elasticjob.dlrover/rank-index"
DLROVER_RELAUNCH_COUNT = "elasticjob.dlrover/relaunch-count"

_TRAILING_NUMBER = re.compile(r"(\d+)$")


def node_index(node_id: str) -> int | None:
    """The number at the end of a node id (``node-3`` -> 3), which the reference system's index labels carry."""
    found = _TRAILING_NUMBER.search(node_id)
    return int(found.group(1)) if found else None


def pod_name(job: str, node_id: str, incarnation: int) -> str:
    """A node incarnation's pod: a relaunched node gets a new name (``<job>-<node>-<incarnation>``)."""
    return f"{job}-{node_id}-{incarnation}"


def master_name(job: str) -> str:
    """The master's pod and Service."""
    return f"{job}-master"


def secret_name(job: str) -> str:
    """The Secret holding the job token."""
    return f"{job}-token"
