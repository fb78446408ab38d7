"""The three patch formats the API server accepts, applied to plain JSON objects.

- ``application/merge-patch+json``: RFC 7386 (maps merge recursively, ``null`` removes a
  key, lists are replaced whole).
- ``application/strategic-merge-patch+json``: a merge patch, except that lists of named
  items are merged item by item on their merge key, as the real server does for the
  built-in kinds: the key is chosen by the list's field name wherever it occurs
  (``containers``, ``initContainers``, ``env``, ``volumes``, ``imagePullSecrets``,
  ``containerStatuses`` by ``name``; ``conditions`` and node ``addresses`` by ``type``;
  ``volumeMounts`` by ``mountPath``; ``ownerReferences`` by ``uid``; ``ports`` by
  ``containerPort`` or ``port``; ``taints`` by ``key``; ``podIPs``/``hostIPs`` by ``ip``),
  ``finalizers`` is merged as a set, and the directives ``$patch: replace``,
  ``$patch: delete`` and ``$deleteFromPrimitiveList/<field>`` are honoured
  (``$setElementOrder`` and ``$retainKeys`` are accepted and ignored). The real server
  reads merge keys from the Go types by path; choosing them by field name gives the
  same result for every kind stead writes.
- ``application/json-patch+json``: RFC 6902 (add, remove, replace, move, copy, test).

A patch that is not well formed raises :class:`PatchFormatError` (400 BadRequest); one
that cannot be applied, a failed ``test`` included, raises :class:`PatchApplyError`
(422, as the real server answers kopf's resourceVersion tests).
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["PatchApplyError", "PatchFormatError", "json_patch", "merge_patch", "strategic_merge_patch"]

_MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "ephemeralContainers": ("name",), "env": ("name",),
    "volumes": ("name",), "imagePullSecrets": ("name",), "containerStatuses": ("name",),
    "initContainerStatuses": ("name",), "ephemeralContainerStatuses": ("name",), "resourceClaims": ("name",),
    "conditions": ("type",), "addresses": ("type",), "volumeMounts": ("mountPath",), "volumeDevices": ("devicePath",),
    "ownerReferences": ("uid",), "ports": ("containerPort", "port"), "taints": ("key",), "podIPs": ("ip",),
    "hostIPs": ("ip",), "hostAliases": ("ip",), "topologySpreadConstraints": ("topologyKey",),
}
_SET_LISTS = frozenset({"finalizers"})


class PatchFormatError(ValueError):
    """The patch document itself is malformed."""


class PatchApplyError(ValueError):
    """A well-formed patch that does not apply to this object."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; returns a new document, ``target`` is left alone."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch as described in the module docstring; returns a new document."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if not isinstance(value, list):
                raise PatchFormatError(f"{key} must be a list of the values to remove")
            result[name] = [v for v in result.get(name) or [] if v not in value]
            continue
        if value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
            result.pop(key, None)
        elif isinstance(value, list) and key in _MERGE_KEYS:
            result[key] = _merge_keyed_list(result.get(key), value, _MERGE_KEYS[key])
        elif isinstance(value, list) and key in _SET_LISTS:
            old = list(result.get(key) or [])
            result[key] = old + [v for v in value if v not in old]
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _merge_keyed_list(old: Any, patch: list[Any], candidates: tuple[str, ...]) -> list[Any]:
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and i.get("$patch") == "replace")]
    if not isinstance(old, list) or not all(isinstance(i, dict) for i in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and i.get("$patch") == "delete")]
    key = next((k for k in candidates if all(k in i for i in patch)), None)
    if key is None:
        raise PatchFormatError(f"every item of a strategic merge list must carry its merge key "
                               f"({' or '.join(candidates)}); send a merge patch to replace the list instead")
    merged = list(old)
    for item in patch:
        at = next((n for n, o in enumerate(merged) if isinstance(o, dict) and o.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del merged[at]
        elif at is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[at] = strategic_merge_patch(merged[at], item)
    return merged


# ----- RFC 6902


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise PatchFormatError(f"JSON patch path {path!r} is not a JSON pointer (it must be empty or start with '/')")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]] if path else []


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            raise PatchApplyError(f"JSON patch path {path!r} does not exist in the object")
    return doc


def _index(container: list[Any], part: str, path: str, *, insert: bool) -> int:
    if insert and part == "-":
        return len(container)
    if not part.isdigit() or int(part) > len(container) - (0 if insert else 1):
        raise PatchApplyError(f"JSON patch path {path!r}: index {part!r} is out of range for a list of "
                              f"{len(container)} items")
    return int(part)


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, path, insert=True), value)
    else:
        raise PatchApplyError(f"JSON patch path {path!r}: the parent is neither an object nor a list")
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    parts = _pointer(path)
    if not parts:
        raise PatchApplyError("JSON patch cannot remove the whole document")
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, path, insert=False))
    raise PatchApplyError(f"JSON patch path {path!r} does not exist in the object")


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch; returns a new document, ``target`` is left alone."""
    if not isinstance(operations, list):
        raise PatchFormatError("a JSON patch must be a list of operations; to merge a map into the object send "
                               "Content-Type application/merge-patch+json (kubernetes_asyncio: "
                               "_content_type='application/merge-patch+json')")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchFormatError(f"JSON patch operation {op!r} needs 'op' and 'path'")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchFormatError(f"JSON patch operation {op!r} needs a 'value'")
        if kind in ("move", "copy") and "from" not in op:
            raise PatchFormatError(f"JSON patch operation {op!r} needs a 'from'")
        match kind:
            case "add":
                doc = _add(doc, path, copy.deepcopy(op["value"]))
            case "remove":
                doc, _ = _remove(doc, path)
            case "replace":
                _walk(doc, _pointer(path), path)
                if not _pointer(path):
                    doc = copy.deepcopy(op["value"])
                else:
                    doc, _ = _remove(doc, path)
                    doc = _add(doc, path, copy.deepcopy(op["value"]))
            case "move":
                doc, value = _remove(doc, op["from"])
                doc = _add(doc, path, value)
            case "copy":
                doc = _add(doc, path, copy.deepcopy(_walk(doc, _pointer(op["from"]), op["from"])))
            case "test":
                if _walk(doc, _pointer(path), path) != op["value"]:
                    raise PatchApplyError(f"JSON patch test failed: the value at {path!r} is not {op['value']!r}")
            case _:
                raise PatchFormatError(f"unknown JSON patch operation {kind!r}: use add, remove, replace, move, "
                                       f"copy or test")
    return doc
