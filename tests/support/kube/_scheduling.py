"""Where a pod may run: the fake scheduler's filters, as pure functions of the pod and the nodes.

The same filters a default kube-scheduler applies to stead's pods, with its wording for
what does not fit (``0/3 nodes are available: 1 Too many pods, 2 node(s) didn't match
Pod's node affinity/selector. preemption: ...``): ``spec.nodeSelector``; required node
affinity (``In``, ``NotIn``, ``Exists``, ``DoesNotExist``, ``Gt``, ``Lt`` on node labels,
``matchFields`` on ``metadata.name``); taints with effect NoSchedule/NoExecute against the
pod's tolerations (a cordoned node and a node that is not Ready carry the taints the
node controllers give them); ``spec.unschedulable``; the number of pods; cpu and memory
requests against what is allocatable.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from stead.core.quantity import QuantityError, parse_quantity

__all__ = ["NodeUsage", "node_rejection", "pod_requests", "unschedulable_message"]

Obj = Mapping[str, Any]

AFFINITY = "node(s) didn't match Pod's node affinity/selector"
UNSCHEDULABLE = "node(s) were unschedulable"
TOO_MANY_PODS = "Too many pods"


class NodeUsage:
    """What is placed on a node so far: pods and their cpu/memory requests."""

    def __init__(self) -> None:
        self.pods = 0
        self.requests: collections.Counter[str] = collections.Counter()

    def add(self, requests: Mapping[str, Decimal]) -> None:
        """Count one more pod, with its requests (:func:`pod_requests`)."""
        self.pods += 1
        for resource, amount in requests.items():
            self.requests[resource] += amount  # type: ignore[assignment]


def pod_requests(pod: Obj) -> dict[str, Decimal]:
    """The pod's cpu and memory requests (the containers' sum; init containers take their maximum)."""
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        for resource, value in ((container.get("resources") or {}).get("requests") or {}).items():
            if resource in ("cpu", "memory"):
                total[resource] = total.get(resource, Decimal(0)) + _quantity(value)
    for container in spec.get("initContainers") or []:
        for resource, value in ((container.get("resources") or {}).get("requests") or {}).items():
            if resource in ("cpu", "memory"):
                total[resource] = max(total.get(resource, Decimal(0)), _quantity(value))
    return total


def _quantity(value: Any) -> Decimal:
    try:
        return parse_quantity(value)
    except QuantityError:
        return Decimal(0)


def _expression_holds(expression: Obj, labels: Mapping[str, str]) -> bool:
    key, operator, values = expression.get("key", ""), expression.get("operator"), expression.get("values") or []
    match operator:
        case "In":
            return labels.get(key) in values
        case "NotIn":
            return labels.get(key) not in values
        case "Exists":
            return key in labels
        case "DoesNotExist":
            return key not in labels
        case "Gt" | "Lt":
            try:
                have, bound = int(labels[key]), int(values[0])
            except (KeyError, IndexError, ValueError):
                return False
            return have > bound if operator == "Gt" else have < bound
    return False


def _affinity_matches(pod: Obj, node: Obj) -> bool:
    spec = pod.get("spec") or {}
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms")
    if not terms:
        return True
    fields = {"metadata.name": meta.get("name", "")}
    return any(  # terms are ORed, the expressions of a term ANDed
        all(_expression_holds(e, labels) for e in term.get("matchExpressions") or [])
        and all(_expression_holds(e, fields) for e in term.get("matchFields") or [])
        and (term.get("matchExpressions") or term.get("matchFields"))
        for term in terms)


def _tolerated(taint: Obj, tolerations: Iterable[Obj]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("operator") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def _effective_taints(node: Obj) -> list[Obj]:
    """The node's taints plus the ones the node controllers would have added for its state."""
    spec, status = node.get("spec") or {}, node.get("status") or {}
    taints = list(spec.get("taints") or [])
    if spec.get("unschedulable"):
        taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") == "False":
        taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"})
    elif ready.get("status") != "True":
        taints.append({"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"})
    return taints


def node_rejection(pod: Obj, node: Obj, usage: NodeUsage, max_pods: int) -> str | None:
    """Why ``pod`` cannot go to ``node`` now (the scheduler's wording), or None when it fits."""
    if not _affinity_matches(pod, node):
        return AFFINITY
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    for taint in _effective_taints(node):
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(taint, tolerations):
            if taint.get("key") == "node.kubernetes.io/unschedulable":
                return UNSCHEDULABLE
            value = taint.get("value", "")
            return f"node(s) had untolerated taint {{{taint.get('key')}: {value}}}"
    if usage.pods + 1 > max_pods:
        return TOO_MANY_PODS
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    for resource, amount in pod_requests(pod).items():
        if resource in allocatable and usage.requests[resource] + amount > _quantity(allocatable[resource]):
            return f"Insufficient {resource}"
    return None


def unschedulable_message(reasons: Mapping[str, int], nodes: int) -> str:
    """``0/3 nodes are available: 1 Too many pods, 2 node(s) ... . preemption: ...`` for the reasons counted."""
    parts = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    return (f"0/{nodes} nodes are available: {parts}. preemption: 0/{nodes} nodes are available: {nodes} "
            f"Preemption is not helpful for scheduling.")
