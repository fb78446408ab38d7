"""What the real API server refuses, refused the same way: names, labels, pod specs, quantities, CRDs.

Each check returns ``(field, message)`` causes worded as the real server words them
(``metadata.name: Invalid value: "Bad_Name": a lowercase RFC 1123 subdomain must ...``);
the server turns a non-empty list into 422 Invalid. A quantity that does not parse is not
a validation failure on a real server but a decoding one (``Pod in version "v1" cannot be
handled as a Pod: quantities must match ...``, 400 BadRequest): :func:`undecodable` finds those.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from stead.core.quantity import QUANTITY_PATTERN, QuantityError, parse_quantity
from tests.support.kube._resources import NameRule, ResourceType

__all__ = ["Causes", "undecodable", "validate"]

Causes = list[tuple[str, str]]

_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_DATA_KEY = re.compile(r"[-._a-zA-Z0-9]+")

_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                  "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                  "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
              "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
              "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')")
_LABEL_1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                   "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
                   "regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
_LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                    "and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
                    "'12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
_QUALIFIED_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                  "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
                  "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")


def _quote(value: Any) -> str:
    return '"' + str(value).replace('"', '\\"') + '"'


def name_causes(name: str, rule: NameRule, field: str = "metadata.name") -> Causes:
    pattern, message, limit = {
        NameRule.SUBDOMAIN: (_SUBDOMAIN, _SUBDOMAIN_MSG, 253),
        NameRule.LABEL: (_LABEL, _LABEL_MSG, 63),
        NameRule.LABEL_1035: (_LABEL_1035, _LABEL_1035_MSG, 63),
    }[rule]
    causes = []
    if len(name) > limit:
        causes.append((field, f"Invalid value: {_quote(name)}: must be no more than {limit} characters"))
    if pattern.fullmatch(name) is None:
        causes.append((field, f"Invalid value: {_quote(name)}: {message}"))
    return causes


def _qualified_name_causes(key: str, field: str) -> Causes:
    prefix, _, name = key.rpartition("/")
    causes = []
    if prefix and (len(prefix) > 253 or _SUBDOMAIN.fullmatch(prefix) is None):
        causes.append((field, f"Invalid value: {_quote(key)}: prefix part {_SUBDOMAIN_MSG}"))
    if not name or len(name) > 63 or _QUALIFIED_NAME.fullmatch(name) is None:
        causes.append((field, f"Invalid value: {_quote(key)}: {_QUALIFIED_MSG}"))
    return causes


def _metadata_causes(meta: Mapping[str, Any]) -> Causes:
    causes: Causes = []
    labels = meta.get("labels") or {}
    if not isinstance(labels, Mapping):
        return [("metadata.labels", "Invalid value: labels must be a map of strings")]
    for key, value in labels.items():
        causes += _qualified_name_causes(key, "metadata.labels")
        if not isinstance(value, str) or len(value) > 63 or _LABEL_VALUE.fullmatch(value) is None:
            causes.append(("metadata.labels", f"Invalid value: {_quote(value)}: {_LABEL_VALUE_MSG}"))
    for key in meta.get("annotations") or {}:
        causes += _qualified_name_causes(key, "metadata.annotations")
    return causes


def undecodable(rt: ResourceType, obj: Mapping[str, Any]) -> str | None:
    """Why the real server could not even decode ``obj`` (400 BadRequest), or None."""
    for spec in _pod_specs(rt, obj):
        for container in _containers(spec):
            for section in ("requests", "limits"):
                for value in ((container.get("resources") or {}).get(section) or {}).values():
                    try:
                        parse_quantity(value)
                    except QuantityError:
                        return (f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: quantities '
                                f"must match the regular expression '{QUANTITY_PATTERN}'")
    if rt.plural == "secrets" and not rt.group:
        for key, value in (obj.get("data") or {}).items():
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, TypeError, ValueError):
                return (f'Secret in version "v1" cannot be handled as a Secret: illegal base64 data in data[{key}]: '
                        f"encode every value of data in base64, or put plain strings in stringData")
    return None


def validate(rt: ResourceType, obj: Mapping[str, Any]) -> Causes:
    """Every cause the real server would give for refusing ``obj`` (already defaulted)."""
    meta = obj.get("metadata") or {}
    causes = name_causes(str(meta.get("name", "")), rt.name_rule) + _metadata_causes(meta)
    for path, spec in _pod_spec_paths(rt, obj):
        causes += _pod_spec_causes(spec, path)
    if rt.kind == "Deployment" and rt.group == "apps":
        causes += _deployment_causes(obj)
    if rt.plural == "customresourcedefinitions":
        causes += _crd_causes(obj)
    if rt.plural in ("secrets", "configmaps") and not rt.group:
        for section in ("data", "stringData", "binaryData"):
            for key in obj.get(section) or {}:
                if _DATA_KEY.fullmatch(key) is None:
                    causes.append((f"{section}[{key}]", f"Invalid value: {_quote(key)}: a valid config key must "
                                                        f"consist of alphanumeric characters, '-', '_' or '.'"))
    return causes


def _pod_spec_paths(rt: ResourceType, obj: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    if rt.kind == "Pod" and not rt.group:
        return [("spec", obj.get("spec") or {})]
    if rt.kind == "Deployment" and rt.group == "apps":
        return [("spec.template.spec", ((obj.get("spec") or {}).get("template") or {}).get("spec") or {})]
    return []


def _pod_specs(rt: ResourceType, obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [spec for _, spec in _pod_spec_paths(rt, obj)]


def _containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [c for c in (spec.get("containers") or []) + (spec.get("initContainers") or []) if isinstance(c, Mapping)]


def _pod_spec_causes(spec: Mapping[str, Any], path: str) -> Causes:
    causes: Causes = []
    volumes = set()
    for i, volume in enumerate(spec.get("volumes") or []):
        name = volume.get("name", "")
        field = f"{path}.volumes[{i}].name"
        if not name:
            causes.append((field, "Required value"))
        elif name in volumes:
            causes.append((field, f"Duplicate value: {_quote(name)}"))
        else:
            causes += name_causes(name, NameRule.LABEL, field)
        volumes.add(name)
    containers = spec.get("containers") or []
    if not containers:
        causes.append((f"{path}.containers", "Required value"))
    policy = spec.get("restartPolicy", "Always")
    if policy not in ("Always", "OnFailure", "Never"):
        causes.append((f"{path}.restartPolicy", f'Unsupported value: {_quote(policy)}: supported values: "Always", '
                                                 f'"OnFailure", "Never"'))
    seen: set[str] = set()
    for section in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(section) or []):
            causes += _container_causes(container, f"{path}.{section}[{i}]", seen, volumes)
    return causes


def _container_causes(container: Mapping[str, Any], path: str, seen: set[str], volumes: set[str]) -> Causes:
    causes: Causes = []
    name = container.get("name") or ""
    if not name:
        causes.append((f"{path}.name", "Required value"))
    elif name in seen:
        causes.append((f"{path}.name", f"Duplicate value: {_quote(name)}"))
    else:
        causes += name_causes(name, NameRule.LABEL, f"{path}.name")
    seen.add(name)
    if not container.get("image"):
        causes.append((f"{path}.image", "Required value"))
    for j, env in enumerate(container.get("env") or []):
        env_name = env.get("name") or ""
        if not env_name:
            causes.append((f"{path}.env[{j}].name", "Required value"))
        elif _ENV_NAME.fullmatch(env_name) is None:
            causes.append((f"{path}.env[{j}].name", f"Invalid value: {_quote(env_name)}: a valid environment "
                                                    f"variable name must consist of alphabetic characters, digits, "
                                                    f"'_', '-', or '.', and must not start with a digit"))
    for j, mount in enumerate(container.get("volumeMounts") or []):
        if mount.get("name") not in volumes:
            causes.append((f"{path}.volumeMounts[{j}].name", f"Not found: {_quote(mount.get('name', ''))}"))
        if not mount.get("mountPath"):
            causes.append((f"{path}.volumeMounts[{j}].mountPath", "Required value"))
    resources = container.get("resources") or {}
    limits: dict[str, Decimal] = {}
    for section in ("limits", "requests"):
        for resource, value in (resources.get(section) or {}).items():
            quantity = parse_quantity(value)  # undecodable() has refused the ones that do not parse
            if quantity < 0:
                causes.append((f"{path}.resources.{section}[{resource}]",
                               f"Invalid value: {_quote(value)}: must be greater than or equal to 0"))
            if section == "limits":
                limits[resource] = quantity
            elif resource in limits and quantity > limits[resource]:
                limit = (resources.get("limits") or {})[resource]
                causes.append((f"{path}.resources.requests[{resource}]",
                               f"Invalid value: {_quote(value)}: must be less than or equal to {resource} limit of "
                               f"{limit}"))
    return causes


def _deployment_causes(obj: Mapping[str, Any]) -> Causes:
    spec = obj.get("spec") or {}
    selector = (spec.get("selector") or {}).get("matchLabels")
    if not spec.get("selector"):
        return [("spec.selector", "Required value")]
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    if selector and any(labels.get(k) != v for k, v in selector.items()):
        return [("spec.template.metadata.labels", f"Invalid value: {_quote(labels)}: `selector` does not match "
                                                   f"template `labels`")]
    return []


def _crd_causes(obj: Mapping[str, Any]) -> Causes:
    spec = obj.get("spec") or {}
    names = spec.get("names") or {}
    causes: Causes = []
    for field in ("plural", "kind"):
        if not names.get(field):
            causes.append((f"spec.names.{field}", "Required value"))
    if not spec.get("group"):
        causes.append(("spec.group", "Required value"))
    expected = f"{names.get('plural', '')}.{spec.get('group', '')}"
    name = (obj.get("metadata") or {}).get("name")
    if name != expected:
        causes.append(("metadata.name", f'Invalid value: {_quote(name)}: must be spec.names.plural+"."+spec.group'))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        causes.append(("spec.scope", f'Unsupported value: {_quote(spec.get("scope"))}: supported values: "Cluster", '
                                     f'"Namespaced"'))
    versions = spec.get("versions") or []
    if not versions:
        causes.append(("spec.versions", "Invalid value: []: must have exactly one version marked as storage version"))
    elif sum(1 for v in versions if v.get("storage")) != 1:
        causes.append(("spec.versions", "Invalid value: must have exactly one version marked as storage version"))
    return causes
