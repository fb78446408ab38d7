"""The fake API server's object store: every write, its resourceVersion, its history and its watchers.

All state lives here and changes only in synchronous methods, so each request is atomic
with respect to every other (one event loop, no await inside a write). Objects are kept
per kind (``(group, plural)``) in dicts keyed by ``(namespace, name)``; a stored object is
never mutated (a write stores a new dict), so history and watch events share them.

Semantics follow the real server (the module docs of :mod:`tests.support.kube.apiserver`
list where they depart): one global resourceVersion counter; ``generation`` counts
changes outside ``metadata`` and ``status``; the status subresource; a no-op write
changes nothing and sends nothing; finalizers hold a deleted object until an update
empties them; pods bound to a node are deleted gracefully (left to the kubelet); owner
references are garbage-collected when the owner goes; deleting a namespace deletes what
it holds.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.support.kube import _errors as errors
from tests.support.kube._defaults import DEFAULT_GRACE_S, apply_defaults, pod_update_causes, qos_class
from tests.support.kube._errors import KubeStatusError
from tests.support.kube._patch import (
    PatchApplyError,
    PatchFormatError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from tests.support.kube._resources import Registry, ResourceType, types_from_crd
from tests.support.kube._selectors import FieldSelector, LabelSelector
from tests.support.kube._validate import undecodable, validate
from tests.support.kube._watch import Change, Watcher, bookmark_line, encode, event_line

__all__ = ["DeleteOptions", "ListResult", "Store", "now_rfc3339"]

Obj = dict[str, Any]
Key = tuple[str, str]
#: where an object lives: kind key, namespace ("" for cluster-scoped kinds), name
Location = tuple[Key, str, str]

#: namespaces every cluster starts with
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_GENERATE_CHARS = "bcdfghjklmnpqrstvwxz2456789"
_MODIFIED_MESSAGE = "the object has been modified; please apply your changes to the latest version and try again"


def now_rfc3339(offset_s: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=offset_s)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clone(obj: Obj) -> Obj:
    """A deep copy; objects are plain JSON, and a JSON round trip copies them faster than copy.deepcopy."""
    copied: Obj = json.loads(json.dumps(obj))
    return copied


def _revise(obj: Obj, **parts: Any) -> Obj:
    """A new version of a stored object that shares what it does not change (stored objects are never modified):
    the top level and ``metadata`` are copied, ``parts`` replace top-level fields."""
    new = dict(obj)
    new["metadata"] = dict(obj["metadata"])
    new.update(parts)
    return new


@dataclass(frozen=True)
class DeleteOptions:
    grace_period_s: int | None = None
    propagation: str | None = None  # Background (default), Foreground, Orphan
    uid: str | None = None  # preconditions
    resource_version: str | None = None


@dataclass(frozen=True)
class ListResult:
    items: list[Obj]
    resource_version: int
    continue_token: str
    remaining: int | None


class Store:
    def __init__(self, registry: Registry, *, history: int, strict_namespaces: bool) -> None:
        self.registry = registry
        self.strict_namespaces = strict_namespaces
        self._objects: dict[Key, dict[tuple[str, str], Obj]] = collections.defaultdict(dict)
        self._rv = 0
        self._history: collections.deque[Change] = collections.deque()
        self._history_size = history
        #: every change at or below this version is gone from history: a watch from there is 410 Expired
        self._compacted = 0
        self._watchers: dict[Key, set[Watcher]] = collections.defaultdict(set)
        self._by_uid: dict[str, Location] = {}
        self._dependents: dict[str, set[Location]] = collections.defaultdict(set)
        self._cluster_ips = 0
        self._last_change: Change | None = None
        self.changed = asyncio.Event()
        for name in INITIAL_NAMESPACES:
            self.create(self._type("", "namespaces"), None, {"metadata": {"name": name}})

    # ----- reading

    @property
    def resource_version(self) -> int:
        return self._rv

    def _type(self, group: str, plural: str) -> ResourceType:
        rt = self.registry.by_key((group, plural))
        assert rt is not None
        return rt

    def find(self, rt: ResourceType, namespace: str | None, name: str) -> Obj | None:
        return self._objects[rt.key].get((namespace or "" if rt.namespaced else "", name))

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self.find(rt, namespace, name)
        if obj is None:
            raise errors.not_found(rt.group, rt.plural, name)
        return obj

    def select(self, rt: ResourceType, namespace: str | None, labels: LabelSelector, fields: FieldSelector, *,
             limit: int | None = None, continue_after: tuple[str, str] | None = None) -> ListResult:
        """Matching objects sorted by namespace and name (etcd's key order), ``limit`` at a time after the
        ``continue_after`` key; the continue token the caller builds from the last item."""
        store = self._objects[rt.key]
        keys = sorted(k for k in store if (namespace is None or k[0] == namespace)
                      and (continue_after is None or k > continue_after))
        items: list[Obj] = []
        remaining = 0
        for k in keys:
            obj = store[k]
            meta = obj["metadata"]
            if not (labels.matches(meta.get("labels")) and fields.matches(obj)):
                continue
            if limit and len(items) >= limit:
                remaining += 1
                continue
            items.append(obj)
        token = ""
        if remaining:
            last = items[-1]["metadata"]
            token = f"{last.get('namespace', '')}/{last['name']}"
        return ListResult(items, self._rv, token, remaining if remaining else None)

    # ----- history and watches

    def encoded(self, obj: Obj) -> bytes:
        """``obj`` as JSON: the bytes its watch events carry when it is what the last write stored."""
        last = self._last_change
        return last.encoded if last is not None and last.obj is obj else encode(obj)

    def check_version(self, version: int) -> None:
        """Refuse a resourceVersion that history no longer covers (410) or that the server never issued."""
        if version < self._compacted:
            raise errors.expired(f"too old resource version: {version} ({self._compacted + 1})")
        if version > self._rv:
            raise errors.too_large_resource_version(version, self._rv)

    def watch(self, rt: ResourceType, namespace: str | None, labels: LabelSelector, fields: FieldSelector, *,
              since: int | None, send_initial_events: bool, initial_end_bookmark: bool) -> Watcher:
        """A registered watcher, its queue primed: synthetic ADDED events of the current objects (no ``since``, or
        ``send_initial_events``) or the retained changes after ``since``. Raises 410 Expired / 504 for versions
        outside history, which the caller sends as an ERROR event."""
        watcher = Watcher(rt.key, rt.kind, rt.api_version, namespace if rt.namespaced else None, labels, fields)
        if since is not None:
            self.check_version(since)
        if since is None or send_initial_events:
            for obj in self.select(rt, namespace if rt.namespaced else None, labels, fields).items:
                watcher.queue.put_nowait(event_line("ADDED", obj))
            if initial_end_bookmark:
                watcher.queue.put_nowait(bookmark_line(rt.kind, rt.api_version, self._rv, initial_events_end=True))
        else:
            for change in self._history:
                if change.rv > since and change.key == rt.key:
                    watcher.offer(change)
        self._watchers[rt.key].add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers[watcher.key].discard(watcher)

    def close_watchers(self, key: Key | None = None) -> None:
        for k, watchers in self._watchers.items():
            if key is None or k == key:
                for watcher in watchers:
                    watcher.close()
                watchers.clear()

    def compact(self) -> None:
        """Drop all history: a watch from any version before now gets 410 Expired."""
        self._history.clear()
        self._compacted = self._rv

    def _commit(self, rt: ResourceType, kind: str, obj: Obj, old: Obj | None) -> Obj:
        self._rv += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self._rv)
        location = (rt.key, meta.get("namespace", ""), meta["name"])
        if old is not None:
            self._unindex(old, location)
        if kind == "DELETED":
            self._objects[rt.key].pop(location[1:], None)
        else:
            self._objects[rt.key][location[1:]] = obj
            self._index(obj, location)
        change = self._last_change = Change(self._rv, rt.key, kind, obj, old)
        if self._history_size > 0:
            if len(self._history) >= self._history_size:
                self._compacted = self._history.popleft().rv
            self._history.append(change)
        else:
            self._compacted = self._rv
        for watcher in self._watchers.get(rt.key, ()):
            watcher.offer(change)
        self.changed.set()
        self.changed = asyncio.Event()
        return obj

    def _index(self, obj: Obj, location: Location) -> None:
        meta = obj["metadata"]
        self._by_uid[meta["uid"]] = location
        for ref in meta.get("ownerReferences") or []:
            if ref.get("uid"):
                self._dependents[ref["uid"]].add(location)

    def _unindex(self, obj: Obj, location: Location) -> None:
        meta = obj["metadata"]
        self._by_uid.pop(meta["uid"], None)
        for ref in meta.get("ownerReferences") or []:
            dependents = self._dependents.get(ref.get("uid", ""))
            if dependents is not None:
                dependents.discard(location)
                if not dependents:
                    del self._dependents[ref["uid"]]

    # ----- writes

    def _next_cluster_ip(self) -> str:
        self._cluster_ips += 1
        return f"10.96.{self._cluster_ips // 250}.{self._cluster_ips % 250 + 1}"

    def _check_body(self, rt: ResourceType, namespace: str | None, obj: Obj) -> Obj:
        if not isinstance(obj, dict):
            raise errors.bad_request(f"the request body must be a JSON object (a {rt.kind}), not {type(obj).__name__}")
        if obj.get("kind") not in (None, "", rt.kind):
            raise errors.bad_request(f"the kind in the body ({obj['kind']}) does not match the resource of the URL "
                                     f"({rt.qualified}, kind {rt.kind})")
        if obj.get("apiVersion") not in (None, "", rt.api_version) and not rt.custom:
            raise errors.bad_request(f"the API version in the data ({obj['apiVersion']}) does not match the expected "
                                     f"API version ({rt.api_version})")
        obj.setdefault("kind", rt.kind)
        obj.setdefault("apiVersion", rt.api_version)
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise errors.bad_request("metadata must be a JSON object")
        if rt.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise errors.bad_request("the namespace of the provided object does not match the namespace sent on "
                                         "the request")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        reason = undecodable(rt, obj)
        if reason is not None:
            raise errors.bad_request(reason)
        return meta

    def create(self, rt: ResourceType, namespace: str | None, body: Obj) -> Obj:
        obj = _clone(body)
        meta = self._check_body(rt, namespace, obj)
        if rt.namespaced:
            self._check_namespace(rt, namespace or "")
        if not meta.get("name") and meta.get("generateName"):
            for _ in range(100):
                meta["name"] = meta["generateName"] + "".join(random.choices(_GENERATE_CHARS, k=5))
                if self.find(rt, namespace, meta["name"]) is None:
                    break
        name = meta.get("name") or ""
        if not name:
            raise errors.invalid(rt.group, rt.kind, "", [("metadata.name", "Required value: name or generateName is "
                                                                           "required")])
        for field in ("uid", "resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields",
                      "selfLink"):
            meta.pop(field, None)
        apply_defaults(rt, obj, None, self._next_cluster_ip)
        causes = validate(rt, obj)
        if causes:
            raise errors.invalid(rt.group, rt.kind, name, causes)
        self._initial_status(rt, obj)
        if self.find(rt, namespace, name) is not None:
            raise errors.already_exists(rt.group, rt.plural, name)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        if rt.plural == "customresourcedefinitions":
            self.registry.register_crd(name, types_from_crd(obj))
        return self._commit(rt, "ADDED", obj, None)

    def _check_namespace(self, rt: ResourceType, namespace: str) -> None:
        ns = self.find(self._type("", "namespaces"), None, namespace)
        if ns is None and self.strict_namespaces:
            raise errors.not_found("", "namespaces", namespace)
        if ns is not None and ns["metadata"].get("deletionTimestamp"):
            raise errors.forbidden(rt.group, rt.plural, None,
                                   f"{rt.qualified} is forbidden: unable to create new content in namespace "
                                   f"{namespace} because it is being terminated")

    def _initial_status(self, rt: ResourceType, obj: Obj) -> None:
        if not rt.has_status or (rt.group, rt.plural) == ("", "nodes"):
            return  # no status subresource: the body's status is kept; nodes register with theirs
        obj.pop("status", None)
        if rt.key == ("", "pods"):
            obj["status"] = {"phase": "Pending", "qosClass": qos_class(obj["spec"])}
        elif rt.key == ("", "namespaces"):
            obj["status"] = {"phase": "Active"}
        elif rt.key == ("", "persistentvolumeclaims"):
            obj["status"] = {"phase": "Pending"}
        elif rt.key == ("", "services"):
            obj["status"] = {"loadBalancer": {}}
        elif rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            now = now_rfc3339()
            obj["status"] = {"acceptedNames": obj["spec"]["names"], "storedVersions": [
                v["name"] for v in obj["spec"]["versions"] if v.get("storage")], "conditions": [
                {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
                for kind, reason, message in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                              ("Established", "InitialNamesAccepted",
                                               "the initial names have been accepted"))]}
        elif not rt.custom:
            obj["status"] = {}

    def update(self, rt: ResourceType, namespace: str | None, name: str, body: Obj, *,
               subresource: str | None = None) -> Obj:
        """PUT: replace the object (or only its status); a stale ``metadata.resourceVersion`` is 409 Conflict."""
        old = self.get(rt, namespace, name)
        new = _clone(body)
        self._check_body(rt, namespace, new)
        if new["metadata"].get("name") != name:
            raise errors.bad_request(f"the name of the object ({new['metadata'].get('name')}) does not match the name "
                                     f"on the URL ({name})")
        return self._write(rt, old, new, subresource=subresource)

    def patch(self, rt: ResourceType, namespace: str | None, name: str, content_type: str, patch: Any, *,
              subresource: str | None = None) -> Obj:
        old = self.get(rt, namespace, name)
        try:
            match content_type:
                case "application/json-patch+json":
                    new = json_patch(old, patch)
                case "application/merge-patch+json":  # both build new maps, never modify the old object
                    new = merge_patch(old, patch)
                case _:
                    new = strategic_merge_patch(old, patch)
        except PatchFormatError as exc:
            raise errors.bad_request(str(exc)) from None
        except PatchApplyError as exc:
            raise KubeStatusError(422, "Invalid", str(exc)) from None
        if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
            raise errors.bad_request("the patch leaves no object with metadata; patch fields of the object instead")
        if subresource != "status":
            new = _clone(new)  # defaulting below fills in nested fields: nothing may be shared with the old object
        new["metadata"] = dict(new["metadata"], name=name)
        self._check_body(rt, namespace, new)
        return self._write(rt, old, new, subresource=subresource)

    def _write(self, rt: ResourceType, old: Obj, new: Obj, *, subresource: str | None) -> Obj:
        old_meta, meta = old["metadata"], new["metadata"]
        asked = meta.get("resourceVersion")
        if asked not in (None, "") and asked != old_meta["resourceVersion"]:
            raise errors.conflict(rt.group, rt.plural, old_meta["name"], _MODIFIED_MESSAGE)
        if subresource == "status":
            status = new.get("status")
            new = _revise(old, status=status if status is not None else {})
        else:
            for field in ("uid", "creationTimestamp", "namespace", "deletionTimestamp", "deletionGracePeriodSeconds",
                          "generation"):
                if field in old_meta:
                    meta[field] = old_meta[field]
                else:
                    meta.pop(field, None)
            if rt.has_status:
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            apply_defaults(rt, new, old, self._next_cluster_ip)
            causes = validate(rt, new)
            if rt.key == ("", "pods"):
                causes += pod_update_causes(old.get("spec") or {}, new.get("spec") or {})
            if old_meta.get("deletionTimestamp"):
                added = [f for f in meta.get("finalizers") or [] if f not in (old_meta.get("finalizers") or [])]
                if added:
                    causes.append(("metadata.finalizers", f"Forbidden: no new finalizers can be added if the object "
                                                          f"is being deleted, found new finalizers {added}"))
            if causes:
                raise errors.invalid(rt.group, rt.kind, old_meta["name"], causes)
            if _content(new) != _content(old):
                meta["generation"] = int(old_meta.get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = old_meta["resourceVersion"]
        if new == old:
            return old  # a no-op write: no new version, no event
        if rt.plural == "customresourcedefinitions":
            self.registry.register_crd(old_meta["name"], types_from_crd(new))
        if self._finalized(rt, new):
            return self._remove(rt, new, propagation=None)
        return self._commit(rt, "MODIFIED", new, old)

    @staticmethod
    def _finalized(rt: ResourceType, obj: Obj) -> bool:
        """A deleted object whose last finalizer is gone (and, for a pod, whose grace period is over)."""
        meta = obj["metadata"]
        if not meta.get("deletionTimestamp") or meta.get("finalizers"):
            return False
        return rt.key != ("", "pods") or not meta.get("deletionGracePeriodSeconds")

    def bind(self, namespace: str, name: str, body: Obj) -> None:
        """``pods/{name}/binding``: set ``spec.nodeName`` and the PodScheduled condition, as the scheduler does."""
        rt = self._type("", "pods")
        old = self.get(rt, namespace, name)
        target = (body.get("target") or {}).get("name") if isinstance(body, dict) else None
        if not target:
            raise errors.invalid("", "Binding", name, [("target.name", "Required value")])
        if old["spec"].get("nodeName"):
            raise errors.conflict("", "pods/binding", name,
                                  f'pod {name} is already assigned to node "{old["spec"]["nodeName"]}"')
        if old["metadata"].get("deletionTimestamp"):
            raise errors.conflict("", "pods/binding", name,
                                  f"pod {name} is being deleted, cannot be assigned to a host")
        conditions = [c for c in old["status"].get("conditions") or [] if c.get("type") != "PodScheduled"]
        conditions.append({"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                           "lastTransitionTime": now_rfc3339()})
        new = _revise(old, spec=dict(old["spec"], nodeName=target), status=dict(old["status"], conditions=conditions))
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        if annotations:
            new["metadata"]["annotations"] = {**(old["metadata"].get("annotations") or {}), **annotations}
        self._commit(rt, "MODIFIED", new, old)

    # ----- deletion

    def delete(self, rt: ResourceType, namespace: str | None, name: str, options: DeleteOptions) -> tuple[Obj, bool]:
        """DELETE: the object as it now is, and whether it is gone (False: it waits for finalizers or a kubelet)."""
        obj = self.get(rt, namespace, name)
        meta = obj["metadata"]
        if options.uid is not None and options.uid != meta["uid"]:
            raise errors.conflict(rt.group, rt.plural, name, f"Precondition failed: UID in precondition: {options.uid}"
                                                             f", UID in object meta: {meta['uid']}")
        if options.resource_version is not None and options.resource_version != meta["resourceVersion"]:
            raise errors.conflict(rt.group, rt.plural, name,
                                  f"Precondition failed: ResourceVersion in precondition: {options.resource_version}, "
                                  f"ResourceVersion in object meta: {meta['resourceVersion']}")
        grace = self._grace_period(rt, obj, options.grace_period_s)
        if options.propagation == "Orphan":
            self._orphan(meta["uid"])
        if rt.key == ("", "namespaces"):
            return self._delete_namespace(rt, obj)
        if meta.get("deletionTimestamp"):
            current = meta.get("deletionGracePeriodSeconds") or 0
            if rt.key != ("", "pods") or grace >= current:
                return obj, False  # already being deleted, nothing shortened
        if grace > 0 or meta.get("finalizers"):
            new = _revise(obj)
            new["metadata"]["deletionTimestamp"] = now_rfc3339(grace)
            new["metadata"]["deletionGracePeriodSeconds"] = grace
            if not self._finalized(rt, new):
                return self._commit(rt, "MODIFIED", new, obj), False
            obj = new
        return self._remove(rt, obj, propagation=options.propagation), True

    @staticmethod
    def _grace_period(rt: ResourceType, obj: Obj, asked: int | None) -> int:
        """Pods bound to a node and not yet terminal get a grace period (left to their kubelet); nothing else."""
        if rt.key != ("", "pods"):
            return 0
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
            return 0
        grace = int(spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S) if asked is None else asked)
        return grace if grace >= 0 else 1  # the real server turns a negative grace period into one second

    def _remove(self, rt: ResourceType, obj: Obj, *, propagation: str | None) -> Obj:
        """The object leaves the store (DELETED); its dependents are collected unless orphaned."""
        final = _revise(obj)
        previous = self.find(rt, final["metadata"].get("namespace"), final["metadata"]["name"])
        uid = final["metadata"]["uid"]
        if propagation == "Foreground":
            self._collect(uid, "Foreground")
        self._commit(rt, "DELETED", final, previous)
        if rt.plural == "customresourcedefinitions":
            self._drop_crd(final["metadata"]["name"])
        if propagation not in ("Orphan", "Foreground"):
            self._collect(uid, "Background")
        namespace = final["metadata"].get("namespace")
        if namespace:
            self._namespace_emptied(namespace)
        return final

    def _collect(self, owner_uid: str, propagation: str) -> None:
        """Garbage collection: dependents of a removed owner go too, unless another owner of theirs remains."""
        for key, namespace, name in sorted(self._dependents.get(owner_uid, ())):
            rt = self.registry.by_key(key)
            dependent = self._objects[key].get((namespace, name))
            if rt is None or dependent is None:
                continue
            refs = dependent["metadata"].get("ownerReferences") or []
            if any(r.get("uid") != owner_uid and r.get("uid") in self._by_uid for r in refs):
                self._strip_owner(rt, dependent, owner_uid)
            else:
                self.delete(rt, namespace or None, name, DeleteOptions(propagation=propagation))

    def _orphan(self, owner_uid: str) -> None:
        for key, namespace, name in sorted(self._dependents.get(owner_uid, ())):
            rt = self.registry.by_key(key)
            dependent = self._objects[key].get((namespace, name))
            if rt is not None and dependent is not None:
                self._strip_owner(rt, dependent, owner_uid)

    def _strip_owner(self, rt: ResourceType, obj: Obj, owner_uid: str) -> None:
        new = _revise(obj)
        refs = [r for r in new["metadata"].get("ownerReferences") or [] if r.get("uid") != owner_uid]
        if refs:
            new["metadata"]["ownerReferences"] = refs
        else:
            new["metadata"].pop("ownerReferences", None)
        self._commit(rt, "MODIFIED", new, obj)

    def _delete_namespace(self, rt: ResourceType, ns: Obj) -> tuple[Obj, bool]:
        name = ns["metadata"]["name"]
        if not ns["metadata"].get("deletionTimestamp"):
            new = _revise(ns, status={"phase": "Terminating"})
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            ns = self._commit(rt, "MODIFIED", new, ns)
            for key, objects in list(self._objects.items()):
                kind = self.registry.by_key(key)
                if kind is None or not kind.namespaced:
                    continue
                for ns_name, obj_name in sorted(k for k in objects if k[0] == name):
                    if (ns_name, obj_name) in objects:
                        self.delete(kind, ns_name, obj_name, DeleteOptions())
        gone = self._namespace_emptied(name)
        return (self.find(rt, None, name) or ns), gone

    def _namespace_emptied(self, namespace: str) -> bool:
        """Remove a terminating namespace once nothing is left in it; True when it is gone."""
        rt = self._type("", "namespaces")
        ns = self.find(rt, None, namespace)
        if ns is None:
            return True
        if not ns["metadata"].get("deletionTimestamp") or ns["metadata"].get("finalizers"):
            return False
        if any(k[0] == namespace for key, objects in self._objects.items() for k in objects
               if (kind := self.registry.by_key(key)) is not None and kind.namespaced):
            return False
        self._remove(rt, ns, propagation=None)
        return True

    def _drop_crd(self, name: str) -> None:
        """A deleted CRD takes its objects with it and ends the watches of its kind."""
        for rt in self.registry.unregister_crd(name)[:1]:  # every version of a CRD shares one store
            for _, obj in sorted(self._objects.get(rt.key, {}).items()):
                self._commit(rt, "DELETED", _revise(obj), obj)
                self._collect(obj["metadata"]["uid"], "Background")
            self._objects.pop(rt.key, None)
            self.close_watchers(rt.key)

    def delete_collection(self, rt: ResourceType, namespace: str | None, labels: LabelSelector,
                          fields: FieldSelector, options: DeleteOptions) -> list[Obj]:
        deleted = []
        for obj in list(self.select(rt, namespace, labels, fields).items):
            meta = obj["metadata"]
            if self.find(rt, meta.get("namespace"), meta["name"]) is not None:
                deleted.append(self.delete(rt, meta.get("namespace"), meta["name"], options)[0])
        return deleted

    # ----- test inspection

    def snapshot(self, rt: ResourceType, namespace: str | None) -> list[Obj]:
        return [_clone(o) for o in self.select(rt, namespace, LabelSelector(), FieldSelector()).items]


def _content(obj: Obj) -> Obj:
    """What ``generation`` counts: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}
