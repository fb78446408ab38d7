"""The resource kinds the fake API server serves, and the discovery documents that describe them.

A :class:`ResourceType` says everything the generic handlers need about a kind: its group,
version, plural and kind, whether it is namespaced, its subresources and how its names are
validated. :class:`Registry` holds the built-in kinds and the ones custom resource
definitions add, and answers the discovery endpoints (``/api``, ``/apis``, ``/api/v1``,
``/apis/{group}/{version}``) that kubernetes_asyncio and kopf read.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUILTIN_TYPES", "NameRule", "Registry", "ResourceType", "types_from_crd"]

_ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


class NameRule(enum.Enum):
    """How ``metadata.name`` is validated: most kinds take a DNS-1123 subdomain, a few a DNS label."""

    SUBDOMAIN = "subdomain"  # RFC 1123 subdomain: up to 253 characters, dots allowed
    LABEL = "label"  # RFC 1123 label: up to 63 characters, no dots
    LABEL_1035 = "label-1035"  # RFC 1035 label: a label that starts with a letter (services)


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    subresources: frozenset[str] = frozenset()
    short_names: tuple[str, ...] = ()
    name_rule: NameRule = NameRule.SUBDOMAIN
    custom: bool = False
    #: a DELETE answers with the deleted object rather than a Status (pods, services, custom resources)
    returns_deleted_object: bool = False
    categories: tuple[str, ...] = field(default=())

    @property
    def key(self) -> tuple[str, str]:
        """Where objects are stored: one store per group and plural, whatever the version asked."""
        return self.group, self.plural

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``pods``, ``deployments.apps``: how error messages name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        """The collection or object URL path (no subresource)."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        return base + (f"/{name}" if name is not None else "")


def _core(plural: str, kind: str, namespaced: bool = True, **kw: Any) -> ResourceType:
    return ResourceType("", "v1", plural, kind, namespaced, singular=kind.lower(), **kw)


def _grouped(group: str, version: str, plural: str, kind: str, namespaced: bool = True,
             **kw: Any) -> ResourceType:
    return ResourceType(group, version, plural, kind, namespaced, singular=kind.lower(), **kw)


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    _core("pods", "Pod", subresources=frozenset({"status", "binding", "log", "eviction"}), short_names=("po",),
          returns_deleted_object=True, categories=("all",)),
    _core("services", "Service", subresources=frozenset({"status"}), short_names=("svc",),
          name_rule=NameRule.LABEL_1035, returns_deleted_object=True, categories=("all",)),
    _core("secrets", "Secret"),
    _core("configmaps", "ConfigMap", short_names=("cm",)),
    _core("events", "Event", short_names=("ev",)),
    _core("persistentvolumeclaims", "PersistentVolumeClaim", subresources=frozenset({"status"}),
          short_names=("pvc",)),
    _core("serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _core("endpoints", "Endpoints", short_names=("ep",)),
    _core("namespaces", "Namespace", namespaced=False, subresources=frozenset({"status"}), short_names=("ns",),
          name_rule=NameRule.LABEL),
    _core("nodes", "Node", namespaced=False, subresources=frozenset({"status"}), short_names=("no",)),
    _grouped("apps", "v1", "deployments", "Deployment", subresources=frozenset({"status"}),
             short_names=("deploy",), categories=("all",)),
    _grouped("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)),
    _grouped("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _grouped("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _grouped("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    _grouped("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
    _grouped("coordination.k8s.io", "v1", "leases", "Lease"),
    _grouped("events.k8s.io", "v1", "events", "Event", short_names=("ev",)),
    _grouped("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
             namespaced=False, subresources=frozenset({"status"}), short_names=("crd", "crds")),
)


def types_from_crd(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The resource types a CustomResourceDefinition declares: one per served version."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    types = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        subresources = frozenset(name for name in ("status",) if name in (version.get("subresources") or {}))
        types.append(ResourceType(
            spec["group"], version["name"], names["plural"], names["kind"], spec.get("scope") != "Cluster",
            singular=names.get("singular") or names["kind"].lower(), subresources=subresources,
            short_names=tuple(names.get("shortNames") or ()), custom=True, returns_deleted_object=True,
            categories=tuple(names.get("categories") or ())))
    return types


class Registry:
    """The kinds served now, found by ``(group, version, plural)``."""

    def __init__(self, types: Iterable[ResourceType] = BUILTIN_TYPES) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        #: the CRD (by name) that registered each custom type, so that deleting it unregisters them
        self._by_crd: dict[str, list[ResourceType]] = {}
        for rt in types:
            self._types[(rt.group, rt.version, rt.plural)] = rt

    def find(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self._types.get((group, version, plural))

    def by_key(self, key: tuple[str, str]) -> ResourceType | None:
        """The first registered version of the kind stored under ``key``."""
        return next((rt for rt in self._types.values() if rt.key == key), None)

    def by_plural(self, plural: str, group: str | None = None) -> ResourceType | None:
        """The preferred (first registered) type of a plural, optionally in one group: for test helpers."""
        for rt in self._types.values():
            if rt.plural == plural and (group is None or rt.group == group):
                return rt
        return None

    def register_crd(self, name: str, types: list[ResourceType]) -> None:
        self.unregister_crd(name)
        for rt in types:
            self._types[(rt.group, rt.version, rt.plural)] = rt
        self._by_crd[name] = types

    def unregister_crd(self, name: str) -> list[ResourceType]:
        types = self._by_crd.pop(name, [])
        for rt in types:
            self._types.pop((rt.group, rt.version, rt.plural), None)
        return types

    def group_versions(self) -> dict[str, list[str]]:
        """Each named group and its versions (the core group ``""`` excluded), in registration order."""
        groups: dict[str, list[str]] = {}
        for rt in self._types.values():
            if rt.group and rt.version not in groups.setdefault(rt.group, []):
                groups[rt.group].append(rt.version)
        return groups

    def has_group_version(self, group: str, version: str) -> bool:
        return any(rt.group == group and rt.version == version for rt in self._types.values())

    # ----- discovery documents

    def api_group(self, group: str) -> dict[str, Any]:
        versions = [{"groupVersion": f"{group}/{v}", "version": v} for v in self.group_versions().get(group, [])]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": versions,
                "preferredVersion": versions[0]}

    def api_group_list(self) -> dict[str, Any]:
        return {"kind": "APIGroupList", "apiVersion": "v1",
                "groups": [self.api_group(group) for group in self.group_versions()]}

    def resource_list(self, group: str, version: str) -> dict[str, Any]:
        resources: list[dict[str, Any]] = []
        for rt in self._types.values():
            if rt.group != group or rt.version != version:
                continue
            entry: dict[str, Any] = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced,
                                     "kind": rt.kind, "verbs": list(_ALL_VERBS)}
            if rt.short_names:
                entry["shortNames"] = list(rt.short_names)
            if rt.categories:
                entry["categories"] = list(rt.categories)
            resources.append(entry)
            for sub in sorted(rt.subresources):
                resources.append({"name": f"{rt.plural}/{sub}", "singularName": "", "namespaced": rt.namespaced,
                                  "kind": _SUBRESOURCE_KINDS.get(sub, rt.kind), "verbs": list(_SUBRESOURCE_VERBS[sub])})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": resources}


_SUBRESOURCE_KINDS = {"binding": "Binding", "eviction": "Eviction", "log": "Pod"}
_SUBRESOURCE_VERBS: dict[str, tuple[str, ...]] = {
    "status": ("get", "patch", "update"), "binding": ("create",), "eviction": ("create",), "log": ("get",)
}
