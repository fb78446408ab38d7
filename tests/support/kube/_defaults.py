"""The fields the real API server fills in on write, and the pod spec changes it refuses.

Defaulting matters to clients that compare what they sent with what they read back, and
to the fake kubelet, which relies on ``restartPolicy`` and ``terminationGracePeriodSeconds``
being present. Only the defaults a client can observe and stead relies on are set; they
are listed per kind in :func:`apply_defaults`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
from typing import Any

from stead.core.quantity import parse_quantity
from tests.support.kube._resources import ResourceType
from tests.support.kube._validate import Causes

__all__ = ["DEFAULT_GRACE_S", "apply_defaults", "pod_update_causes", "qos_class"]

#: a pod's ``terminationGracePeriodSeconds`` when it sets none
DEFAULT_GRACE_S = 30

#: what ``kubectl`` shows for a refused pod update; the fields it names are the only ones that may change
_POD_UPDATE_FORBIDDEN = ("Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                         "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
                         "additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set "
                         "to 1 if it was previously negative)")


def apply_defaults(rt: ResourceType, obj: dict[str, Any], old: Mapping[str, Any] | None,
                   next_cluster_ip: Callable[[], str]) -> None:
    """Fill in what the real server defaults, in place: ``old`` is the stored object on an update."""
    if rt.group == "" and rt.plural == "pods":
        _default_pod_spec(obj.setdefault("spec", {}))
    elif rt.group == "apps" and rt.plural == "deployments":
        spec = obj.setdefault("spec", {})
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        spec.setdefault("strategy", {"type": "RollingUpdate",
                                     "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}})
        _default_pod_spec(spec.setdefault("template", {}).setdefault("spec", {}))
    elif rt.group == "" and rt.plural == "services":
        _default_service(obj, old, next_cluster_ip)
    elif rt.group == "" and rt.plural == "secrets":
        obj.setdefault("type", "Opaque")
        string_data = obj.pop("stringData", None) or {}
        if string_data:
            data = obj.setdefault("data", {})
            for key, value in string_data.items():
                data[key] = base64.b64encode(str(value).encode()).decode()
    elif rt.group == "" and rt.plural == "namespaces":
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])


def _default_pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    if "serviceAccountName" not in spec:
        spec["serviceAccountName"] = spec.get("serviceAccount") or "default"
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    if not spec.get("tolerations"):
        spec["tolerations"] = [
            {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 300} for taint in ("not-ready", "unreachable")]
    for section in ("initContainers", "containers"):
        for container in spec.get(section) or []:
            if not isinstance(container, dict):
                continue
            image = str(container.get("image") or "")
            tag = image.rsplit("/", 1)[-1]
            latest = "@" not in tag and (":" not in tag or tag.endswith(":latest"))
            container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("terminationMessagePolicy", "File")
            container.setdefault("resources", {})
            resources = container["resources"]
            if resources.get("limits") and not resources.get("requests"):
                resources["requests"] = dict(resources["limits"])  # requests default to limits
            elif resources.get("limits"):
                for key, value in resources["limits"].items():
                    resources["requests"].setdefault(key, value)
            for port in container.get("ports") or []:
                port.setdefault("protocol", "TCP")


def _default_service(obj: dict[str, Any], old: Mapping[str, Any] | None, next_cluster_ip: Callable[[], str]) -> None:
    spec = obj.setdefault("spec", {})
    old_spec = (old or {}).get("spec") or {}
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    if "clusterIP" not in spec:
        spec["clusterIP"] = old_spec.get("clusterIP") or next_cluster_ip()
    spec.setdefault("clusterIPs", [spec["clusterIP"]])
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))


def qos_class(spec: Mapping[str, Any]) -> str:
    """``Guaranteed``, ``Burstable`` or ``BestEffort``, as the real server computes ``status.qosClass``."""
    containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    any_set, guaranteed = False, True
    for container in containers:
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        if requests or limits:
            any_set = True
        for resource in ("cpu", "memory"):
            if resource not in limits or parse_quantity(requests.get(resource, limits[resource])) != \
                    parse_quantity(limits[resource]):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def pod_update_causes(old_spec: Mapping[str, Any], new_spec: Mapping[str, Any]) -> Causes:
    """The real server refuses a pod update that changes more than images, the deadline and added tolerations."""

    def comparable(spec: Mapping[str, Any]) -> str:
        copy = json.loads(json.dumps(spec))
        for section in ("containers", "initContainers"):
            for container in copy.get(section) or []:
                container.pop("image", None)
        for field in ("activeDeadlineSeconds", "tolerations", "schedulingGates"):
            copy.pop(field, None)
        return json.dumps(copy, sort_keys=True)

    causes: Causes = []
    if comparable(old_spec) != comparable(new_spec):
        causes.append(("spec", _POD_UPDATE_FORBIDDEN))
    old_tolerations = old_spec.get("tolerations") or []
    if any(t not in (new_spec.get("tolerations") or []) for t in old_tolerations):
        causes.append(("spec.tolerations", "Forbidden: existing toleration can not be modified except its "
                                           "tolerationSeconds"))
    return causes
