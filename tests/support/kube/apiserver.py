"""A fake Kubernetes API server on loopback that speaks the real REST and watch protocol.

stead's Kubernetes platform and operator are tested against this instead of a cluster:
kubernetes_asyncio and kopf talk to it over HTTP exactly as they would to a real API
server, and :class:`~tests.support.kube.kubelet.FakeKubelet` (a client like any other)
schedules and runs its pods. Every kind is handled by the same generic code (list,
watch, get, create, replace, the three patch formats, delete, deletecollection, the
status subresource), with the semantics the clients rely on: one global
resourceVersion, generation, finalizers, graceful pod deletion, owner-reference garbage
collection, label and field selectors, 410 Expired for a watch older than the retained
history, bookmarks, validation with the real messages, and errors as ``Status`` bodies.

Where it departs from a real API server, and why (nothing here is needed by stead):

- no authentication; authorization is all-or-nothing plus the rules of :meth:`FakeKubeApi.deny`;
- no server-side apply (``application/apply-patch+yaml`` is 415), no ``dryRun``, no
  ``managedFields``, no admission webhooks, no schema validation of custom resources,
  no conversion between the versions of a multi-version CRD (objects keep the
  ``apiVersion`` they were written with), no protobuf or YAML bodies, no table output;
- no controllers: deployments are stored but create no pods, PVCs stay ``Pending``, the
  namespace controller is reduced to "deleting a namespace deletes what it holds";
- a list continued with a ``continue`` token reads the current objects after the token's
  key (not a snapshot at the first page's version); a watch from that version then
  replays the changes in between, so a client sees every change at least once;
- garbage collection and foreground deletion happen within the deleting request
  (dependents first for ``Foreground``); dependents whose owner never existed are kept;
- a PUT without ``metadata.resourceVersion`` is accepted for every kind (the real server
  refuses it for some); ``generation`` exists on every kind and counts changes outside
  ``metadata`` and ``status``;
- objects may be created in a namespace that does not exist, unless ``strict_namespaces``;
- core ``v1`` events and ``events.k8s.io/v1`` events are two stores, not two views of one;
- the ``scale`` subresource, ``pods/exec``, ``pods/attach`` and ``pods/portforward`` are not served;
- ``pods/{name}/log`` is proxied to the node's kubelet endpoint (``status.daemonEndpoints``),
  as the real server does, but over plain HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from tests.support.kube import _errors as errors
from tests.support.kube._errors import KubeStatusError
from tests.support.kube._request import delete_options, flag, int_param, options_from, parse_version, read_json
from tests.support.kube._resources import Registry, ResourceType
from tests.support.kube._selectors import FieldSelector, LabelSelector, SelectorError
from tests.support.kube._store import Store
from tests.support.kube._watch import encode, event_line, stream_watch

__all__ = ["DEFAULT_USER", "FakeKubeApi"]

log = structlog.get_logger("tests.support.kube.apiserver")

#: who the requests are made as, in Forbidden messages
DEFAULT_USER = "system:serviceaccount:default:default"
#: what /version reports
_VERSION = {"major": "1", "minor": "31", "gitVersion": "v1.31.0-stead-fake", "gitCommit": "0" * 40,
            "gitTreeState": "clean", "buildDate": "2024-08-13T00:00:00Z", "goVersion": "go1.22.5",
            "compiler": "gc", "platform": "linux/amd64"}
_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json",
                "application/strategic-merge-patch+json")
_BODY_TYPES = ("application/json",)
_NOT_FOUND = KubeStatusError(404, "NotFound", "the server could not find the requested resource")
#: how often wait_for() checks its predicate when nothing is written
_WAIT_POLL_S = 0.05
#: how long the log proxy waits for a kubelet to answer
_LOG_CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _DenyRule:
    verb: str
    resource: str
    namespace: str | None

    def matches(self, verb: str, resource: str, namespace: str | None) -> bool:
        return (self.verb in ("*", verb) and self.resource in ("*", resource, resource.split("/")[0])
                and (self.namespace is None or self.namespace == namespace))


@dataclass(frozen=True)
class _Target:
    """What a resource URL names."""

    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None
    watch_path: bool  # the legacy /watch/ prefix

    @property
    def resource(self) -> str:
        return self.rt.plural + (f"/{self.subresource}" if self.subresource else "")


class FakeKubeApi:
    """``async with FakeKubeApi() as api:`` serves on ``api.url`` (127.0.0.1, a free port) until the block ends.

    ``latency_s`` (settable while running) is slept before every request is handled; ``history`` change events
    are retained for watches that resume from a version; ``bookmark_interval_s`` spaces the BOOKMARK events of
    watches that allow them.
    """

    def __init__(self, *, latency_s: float = 0.0, history: int = 1000, bookmark_interval_s: float = 1.0,
                 strict_namespaces: bool = False, user: str = DEFAULT_USER) -> None:
        self.latency_s = latency_s
        self.bookmark_interval_s = bookmark_interval_s
        self.user = user
        self.registry = Registry()
        self.store = Store(self.registry, history=history, strict_namespaces=strict_namespaces)
        #: ``(verb, resource)`` of every resource request handled, e.g. ``("create", "pods")``, ``("patch",
        #: "pods/status")``
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self._deny: list[_DenyRule] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._port = 0

    # ----- life cycle

    async def __aenter__(self) -> FakeKubeApi:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = int(self._runner.addresses[0][1])
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(sock_connect=_LOG_CONNECT_TIMEOUT_S))
        log.debug("fake_apiserver_started", url=self.url)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.store.close_watchers()
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = None

    # ----- how clients reach it

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("FakeKubeApi is not serving; use it as `async with FakeKubeApi() as api:`")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configuration(self) -> Any:
        """A ``kubernetes_asyncio.client.Configuration`` for this server."""
        from kubernetes_asyncio import client

        configuration = client.Configuration(host=self.url)
        configuration.verify_ssl = False
        return configuration

    def kubeconfig(self, *, namespace: str = "default") -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "stead-fake",
                "clusters": [{"name": "stead-fake", "cluster": {"server": self.url}}],
                "users": [{"name": "stead-fake", "user": {"token": "stead-fake-token"}}],
                "contexts": [{"name": "stead-fake", "context": {"cluster": "stead-fake", "user": "stead-fake",
                                                                  "namespace": namespace}}]}

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        """Write a kubeconfig for this server (``kubernetes_asyncio.config.load_kube_config(config_file=path)``)."""
        path = Path(path)
        path.write_text(json.dumps(self.kubeconfig(namespace=namespace), indent=2))
        return path

    # ----- test controls and inspection

    def deny(self, verb: str, resource: str, namespace: str | None = None) -> None:
        """Answer matching requests 403 Forbidden. ``verb``: get, list, watch, create, update, patch, delete,
        deletecollection or ``*``; ``resource``: a plural (``pods``, its subresources too), ``pods/status``, or
        ``*``; ``namespace``: only there (None: everywhere)."""
        self._deny.append(_DenyRule(verb, resource, namespace))

    def allow_all(self) -> None:
        self._deny.clear()

    def compact(self) -> None:
        """Drop the retained history: a watch resuming from any version before now gets 410 Expired."""
        self.store.compact()

    def close_watches(self) -> None:
        """End every watch stream now, as an API server restart or a dropped connection does: clients resume
        from their last version (and, after :meth:`compact`, get 410 and re-list)."""
        self.store.close_watchers()

    @property
    def resource_version(self) -> int:
        return self.store.resource_version

    def _resource_type(self, resource: str) -> ResourceType:
        plural, _, group = resource.partition(".")
        rt = self.registry.by_plural(plural, group if group else None)
        if rt is None:
            raise KeyError(f"no resource {resource!r} is served: name a plural such as 'pods', or plural.group such "
                           f"as 'deployments.apps' (custom resources exist once their CRD is created)")
        return rt

    def objects(self, resource: str, namespace: str | None = None, *, copy: bool = True) -> list[dict[str, Any]]:
        """The objects of ``resource`` (``pods``, ``deployments.apps``, ``steadjobs.stead.dev``, ...) sorted by
        namespace and name: copies, or with ``copy=False`` the stored objects themselves, cheap to read in a
        ``wait_for`` predicate over many objects, never to be modified."""
        rt = self._resource_type(resource)
        return self.store.snapshot(rt, namespace) if copy else self.store.select(
            rt, namespace, LabelSelector(), FieldSelector()).items

    def get_object(self, resource: str, namespace: str | None, name: str, *,
                   copy: bool = True) -> dict[str, Any] | None:
        """One object (None when there is none); ``copy=False`` as for :meth:`objects`."""
        obj = self.store.find(self._resource_type(resource), namespace, name)
        if obj is None or not copy:
            return obj
        copied: dict[str, Any] = json.loads(json.dumps(obj))
        return copied

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Return once ``predicate()`` holds, checked after every write and every ``_WAIT_POLL_S`` (so it may look
        at files and processes too); TimeoutError after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_WAIT_POLL_S):
                            await self.store.changed.wait()
        except TimeoutError:
            raise TimeoutError(f"the fake API server's objects did not satisfy {predicate!r} within {timeout_s} s; "
                               f"look at api.objects(...) to see what they are") from None

    # ----- HTTP

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        try:
            return await self._dispatch(request)
        except KubeStatusError as exc:
            return _json_response(exc.body(), exc.code)
        except SelectorError as exc:
            return _json_response(errors.bad_request(str(exc)).body(), 400)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:  # a bug of the fake: answer as the real server would, and say where
            log.exception("fake_apiserver_failed", method=request.method, path=request.path)
            return _json_response(errors.status_body(500, "InternalError", f"the fake API server failed: {exc!r}; "
                                                     f"this is a bug of tests.support.kube"), 500)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if request.method != "GET" and (not parts or parts[0] not in ("api", "apis") or len(parts) < 3
                                        or (parts[0] == "apis" and len(parts) < 4)):
            raise errors.method_not_allowed(request.method, request.path)
        match parts:
            case ["version"]:
                return _json_response(_VERSION)
            case ["healthz" | "livez" | "readyz"]:
                return web.Response(text="ok")
            case ["api"]:
                return _json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.port}"}]})
            case ["apis"]:
                return _json_response(self.registry.api_group_list())
            case ["apis", group]:
                if group not in self.registry.group_versions():
                    raise _NOT_FOUND
                return _json_response(self.registry.api_group(group))
            case ["api", version]:
                if not self.registry.has_group_version("", version):
                    raise _NOT_FOUND
                return _json_response(self.registry.resource_list("", version))
            case ["apis", group, version]:
                if not self.registry.has_group_version(group, version):
                    raise _NOT_FOUND
                return _json_response(self.registry.resource_list(group, version))
            case ["api", version, *rest]:
                return await self._resource_request(request, self._target("", version, rest))
            case ["apis", group, version, *rest]:
                return await self._resource_request(request, self._target(group, version, rest))
        raise _NOT_FOUND

    def _target(self, group: str, version: str, rest: list[str]) -> _Target:
        watch_path = bool(rest) and rest[0] == "watch"
        if watch_path:
            rest = rest[1:]
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise _NOT_FOUND
        rt = self.registry.find(group, version, rest[0])
        if rt is None or (namespace is not None and not rt.namespaced):
            raise _NOT_FOUND
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if (name is not None and rt.namespaced and namespace is None) or (sub is not None and
                                                                         sub not in rt.subresources):
            raise _NOT_FOUND
        return _Target(rt, namespace, name, sub, watch_path)

    def _verb(self, request: web.Request, target: _Target) -> str:
        method = request.method
        watch = target.watch_path or flag(request.query, "watch")
        if target.name is None:
            verbs = {"GET": "watch" if watch else "list", "POST": "create", "DELETE": "deletecollection"}
        elif target.subresource in ("binding", "eviction"):
            verbs = {"POST": "create"}
        elif target.subresource == "log":
            verbs = {"GET": "get"}
        elif target.subresource == "status":
            verbs = {"GET": "get", "PUT": "update", "PATCH": "patch"}
        else:
            verbs = {"GET": "watch" if watch else "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
        verb = verbs.get(method)
        if verb is None:
            raise errors.method_not_allowed(method, target.resource)
        return verb

    def _authorize(self, verb: str, target: _Target) -> None:
        if not any(rule.matches(verb, target.resource, target.namespace) for rule in self._deny):
            return
        rt = target.rt
        subject = f'{rt.qualified} "{target.name}"' if target.name else rt.qualified
        where = f'in the namespace "{target.namespace}"' if target.namespace else "at the cluster scope"
        raise errors.forbidden(rt.group, rt.plural, target.name,
                               f'{subject} is forbidden: User "{self.user}" cannot {verb} resource '
                               f'"{target.resource}" in API group "{rt.group}" {where}')

    async def _resource_request(self, request: web.Request, target: _Target) -> web.StreamResponse:
        verb = self._verb(request, target)
        if target.rt.namespaced and target.namespace is None and verb in ("create", "deletecollection"):
            raise errors.method_not_allowed(request.method, f"{target.resource} across all namespaces (name the "
                                                            f"namespace: .../namespaces/NAME/{target.rt.plural})")
        self.requests[(verb, target.resource)] += 1
        self._authorize(verb, target)
        rt, ns, name, query = target.rt, target.namespace, target.name, request.query
        if target.subresource == "log":
            assert name is not None and ns is not None
            return await self._pod_log(request, ns, name)
        if verb in ("list", "watch"):
            labels = LabelSelector.parse(query.get("labelSelector"))
            fields = FieldSelector.parse(query.get("fieldSelector"), plural=rt.plural, custom=rt.custom)
            if name is not None:
                fields = FieldSelector((*fields.terms, ("metadata.name", True, name)))
            if verb == "watch":
                return await self._watch(request, target, labels, fields)
            return self._list(target, labels, fields, query)
        if verb == "get":
            return _json_response(self.store.get(rt, ns, name or ""))
        if verb == "create" and target.subresource == "binding":
            assert ns is not None and name is not None
            self.store.bind(ns, name, await read_json(request, _BODY_TYPES))
            return _json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                   "code": 201}, 201)
        if verb == "create" and target.subresource == "eviction":
            return await self._evict(request, target)
        if verb == "create":
            return self._object_response(self.store.create(rt, ns, await read_json(request, _BODY_TYPES)), 201)
        if verb == "update":
            return self._object_response(self.store.update(rt, ns, name or "", await read_json(request, _BODY_TYPES),
                                                           subresource=target.subresource))
        if verb == "patch":
            content_type = request.content_type
            accepted = _PATCH_TYPES[:2] if rt.custom else _PATCH_TYPES
            body = await read_json(request, accepted)
            return self._object_response(self.store.patch(rt, ns, name or "", content_type, body,
                                                          subresource=target.subresource))
        options = await delete_options(request)
        if verb == "deletecollection":
            labels = LabelSelector.parse(query.get("labelSelector"))
            fields = FieldSelector.parse(query.get("fieldSelector"), plural=rt.plural, custom=rt.custom)
            deleted = self.store.delete_collection(rt, ns, labels, fields, options)
            return _json_response({"kind": f"{rt.kind}List", "apiVersion": rt.api_version,
                                   "metadata": {"resourceVersion": str(self.store.resource_version)},
                                   "items": deleted})
        obj, gone = self.store.delete(rt, ns, name or "", options)
        if gone and not rt.returns_deleted_object:
            return _json_response(errors.success_body(obj["metadata"]["name"], rt.group, rt.plural,
                                                      obj["metadata"]["uid"]))
        return self._object_response(obj)

    def _object_response(self, obj: dict[str, Any], status: int = 200) -> web.Response:
        return web.Response(body=self.store.encoded(obj), status=status, content_type="application/json")

    def _list(self, target: _Target, labels: LabelSelector, fields: FieldSelector,
              query: Mapping[str, str]) -> web.Response:
        rt = target.rt
        limit = int_param(query, "limit")
        continue_after, list_rv = None, None
        token = query.get("continue")
        if token:
            continue_after, list_rv = self._decode_continue(token)
        else:
            self._check_list_version(query.get("resourceVersion"), query.get("resourceVersionMatch"))
        result = self.store.select(rt, target.namespace, labels, fields, limit=limit or None,
                                 continue_after=continue_after)
        rv = list_rv if list_rv is not None else result.resource_version
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if result.continue_token:
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                {"rv": rv, "start": result.continue_token}).encode()).decode()
            meta["remainingItemCount"] = result.remaining
        body = b'{"kind":"' + f"{rt.kind}List".encode() + b'","apiVersion":"' + rt.api_version.encode() + \
            b'","metadata":' + encode(meta) + b',"items":[' + b",".join(encode(o) for o in result.items) + b"]}"
        return web.Response(body=body, content_type="application/json")

    def _decode_continue(self, token: str) -> tuple[tuple[str, str], int]:
        try:
            decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
            namespace, _, name = decoded["start"].partition("/")
            rv = int(decoded["rv"])
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise errors.bad_request(f"continue key is not valid: {token!r} is not a token this server issued; "
                                     f"start the list again without 'continue'") from None
        try:
            self.store.check_version(rv)
        except KubeStatusError:
            raise errors.expired("The provided continue parameter is too old to display a consistent list result. "
                                 "You can start a new list without the continue parameter.") from None
        return (namespace, name), rv

    def _check_list_version(self, version: str | None, match: str | None) -> None:
        if version in (None, "", "0"):
            return
        asked = parse_version(version)
        current = self.store.resource_version
        if asked > current:
            raise errors.too_large_resource_version(asked, current)
        if match == "Exact" and asked != current:
            raise errors.expired(f"too old resource version: {asked} ({current}); this server keeps no snapshots, "
                                 f"list with resourceVersionMatch=NotOlderThan or without a resourceVersion")

    async def _watch(self, request: web.Request, target: _Target, labels: LabelSelector,
                     fields: FieldSelector) -> web.StreamResponse:
        query = request.query
        version = query.get("resourceVersion")
        since = None if version in (None, "", "0") else parse_version(version)
        bookmarks = flag(query, "allowWatchBookmarks")
        send_initial = flag(query, "sendInitialEvents")
        timeout_s = int_param(query, "timeoutSeconds")
        try:
            watcher = self.store.watch(target.rt, target.namespace, labels, fields, since=since,
                                       send_initial_events=send_initial, initial_end_bookmark=send_initial and
                                       bookmarks)
        except KubeStatusError as exc:  # the real server answers 200 and sends the error as the one event
            response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(event_line("ERROR", exc.body()))
            await response.write_eof()
            return response
        try:
            return await stream_watch(request, watcher, current_rv=lambda: self.store.resource_version,
                                      timeout_s=timeout_s or None,
                                      bookmark_interval_s=self.bookmark_interval_s if bookmarks else None)
        finally:
            self.store.unwatch(watcher)

    async def _evict(self, request: web.Request, target: _Target) -> web.Response:
        """``pods/{name}/eviction``: a DisruptionTarget condition, then a delete with the eviction's options."""
        assert target.name is not None and target.namespace is not None
        body = await read_json(request, _BODY_TYPES)
        raw = (body or {}).get("deleteOptions") or {}
        pod = self.store.get(target.rt, target.namespace, target.name)
        conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") !=
                      "DisruptionTarget"]
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                           "message": "Eviction API: evicting", "lastTransitionTime": None})
        self.store.patch(target.rt, target.namespace, target.name, "application/merge-patch+json",
                         {"status": {"conditions": conditions}}, subresource="status")
        self.store.delete(target.rt, target.namespace, target.name, options_from(raw, {}))
        return _json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                               "code": 201}, 201)

    async def _pod_log(self, request: web.Request, namespace: str, name: str) -> web.StreamResponse:
        """Proxy to the kubelet of the pod's node, as the real server does (``status.daemonEndpoints``)."""
        pods = self.registry.find("", "v1", "pods")
        nodes = self.registry.find("", "v1", "nodes")
        assert pods is not None and nodes is not None
        pod = self.store.get(pods, namespace, name)
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        container = request.query.get("container")
        if container is None:
            if len(containers) != 1:
                raise errors.bad_request(f"a container name must be specified for pod {name}, choose one of: "
                                         f"[{' '.join(containers)}]")
            container = containers[0]
        node_name = pod["spec"].get("nodeName")
        node = self.store.find(nodes, None, node_name) if node_name else None
        if node is None:
            raise errors.bad_request(f'container "{container}" in pod "{name}" is waiting to start: the pod is not '
                                     f"scheduled to a node yet")
        status = node.get("status") or {}
        port = ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port")
        address = next((a["address"] for a in status.get("addresses") or [] if a.get("type") == "InternalIP"),
                       "127.0.0.1")
        if not port:
            raise KubeStatusError(500, "InternalError", f'node "{node_name}" reports no kubelet endpoint '
                                                        f"(status.daemonEndpoints.kubeletEndpoint.Port)")
        assert self._session is not None
        url = f"http://{address}:{port}/containerLogs/{namespace}/{name}/{container}"
        try:
            async with self._session.get(url, params=dict(request.query)) as upstream:
                response = web.StreamResponse(status=upstream.status,
                                              headers={"Content-Type": upstream.headers.get("Content-Type",
                                                                                            "text/plain")})
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientConnectionError as exc:
            raise KubeStatusError(500, "InternalError", f"Get {url!r}: the kubelet of node {node_name!r} does not "
                                                        f"answer: {exc}") from None


def _json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode(body), status=status, content_type="application/json")
