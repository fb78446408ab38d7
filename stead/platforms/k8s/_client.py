"""The one module that talks to ``kubernetes_asyncio``: connection, requests, watches, error mapping.

Objects travel as plain JSON dicts (no generated models: a relaunch of 300 pods
should not pay for deserialising 300 ``V1Pod`` trees), through the library's
``ApiClient`` so that its configuration (in-cluster service account, kubeconfig
with every auth plugin it supports, or an explicit URL) and its connection pool
are the real ones. The library's and aiohttp's exceptions are mapped here to
stead's: an unreachable API server is :class:`PlatformUnavailable` (retryable),
403 and 422 are :class:`PlatformRejected` (the request must change), 404 is a
return value, and a watch whose resourceVersion is too old raises
:class:`Expired`, which tells the informer to list again.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp
import structlog
from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import config as kconfig
from kubernetes_asyncio.config.config_exception import ConfigException

from stead.core.errors import ConfigError, PlatformError, PlatformRejected, PlatformUnavailable
from stead.platforms.k8s.settings import K8sSettings

__all__ = ["CONFIGMAPS", "EVENTS", "JOBS", "NETWORK_POLICIES", "NODES", "PODS", "ROLES", "ROLE_BINDINGS", "SECRETS",
           "SERVICES", "SERVICE_ACCOUNTS", "Expired", "Kube", "Resource", "current_namespace", "warn_insecure"]

log = structlog.get_logger("stead.k8s")

JsonObject = dict[str, Any]

#: where a pod finds its namespace (the service account's projected volume)
_POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_SERVICE_ACCOUNT_TOKEN = _POD_NAMESPACE_FILE.with_name("token")


class Expired(PlatformError):
    """A watch's resourceVersion is older than the API server keeps (410 Gone): list again."""


@dataclasses.dataclass(frozen=True)
class Resource:
    """One kind's REST collection: ``/api/v1/...`` for the core group, ``/apis/GROUP/VERSION/...`` otherwise."""

    plural: str
    group: str = ""
    version: str = "v1"
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None, subresource: str = "") -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


PODS = Resource("pods")
SERVICES = Resource("services")
SECRETS = Resource("secrets")
CONFIGMAPS = Resource("configmaps")
EVENTS = Resource("events")
NODES = Resource("nodes", namespaced=False)
SERVICE_ACCOUNTS = Resource("serviceaccounts")
NETWORK_POLICIES = Resource("networkpolicies", group="networking.k8s.io")
ROLES = Resource("roles", group="rbac.authorization.k8s.io")
ROLE_BINDINGS = Resource("rolebindings", group="rbac.authorization.k8s.io")
JOBS = Resource("steadjobs", group="stead.dev")


def current_namespace(settings: K8sSettings) -> str:
    """The namespace to use: the setting, else the pod's own (in a cluster), else ``default``."""
    if settings.namespace:
        return settings.namespace
    try:
        return _POD_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


class Kube:
    """An API server connection: ``async with Kube(settings) as kube``.

    Which server: ``settings.api_url`` when set, else the in-cluster service account when this runs in a pod,
    else the kubeconfig (``settings.kubeconfig``, ``$KUBECONFIG``, ``~/.kube/config``; ``settings.context``).
    """

    def __init__(self, settings: K8sSettings, *, pool: int | None = None) -> None:
        self.settings = settings
        self.namespace = current_namespace(settings)
        self._pool = pool or settings.create_concurrency + 8
        self._api: kclient.ApiClient | None = None
        #: where requests go, for messages
        self.host = ""

    async def __aenter__(self) -> Self:
        configuration = await _configuration(self.settings)
        configuration.connection_pool_maxsize = self._pool
        self.host = configuration.host
        self._api = kclient.ApiClient(configuration)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    # -- requests ------------------------------------------------------------------

    async def get(self, resource: Resource, name: str, *, namespace: str | None = None) -> JsonObject | None:
        """The object, or None when there is none."""
        try:
            return await self._call("GET", resource.path(namespace or self.namespace, name))
        except _NotFound:
            return None

    async def create(self, resource: Resource, body: Mapping[str, Any], *, namespace: str | None = None,
                     exist_ok: bool = False) -> JsonObject | None:
        """Create the object; with ``exist_ok`` an object of that name already there is None, not an error."""
        try:
            return await self._call("POST", resource.path(namespace or self.namespace), body=body)
        except _AlreadyExists:
            if exist_ok:
                return None
            raise PlatformRejected(f"{resource.plural} {body.get('metadata', {}).get('name')!r} already exists in "
                                   f"namespace {namespace or self.namespace}; delete it or choose another name") \
                from None

    async def delete(self, resource: Resource, name: str, *, namespace: str | None = None,
                     grace_period_s: int | None = None, propagation: str = "Background") -> bool:
        """Delete the object; False when there was none."""
        body: JsonObject = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        try:
            await self._call("DELETE", resource.path(namespace or self.namespace, name), body=body)
        except _NotFound:
            return False
        return True

    async def patch(self, resource: Resource, name: str, patch: Mapping[str, Any], *, namespace: str | None = None,
                    subresource: str = "") -> JsonObject | None:
        """A JSON merge patch; None when the object is gone."""
        try:
            return await self._call("PATCH", resource.path(namespace or self.namespace, name, subresource), body=patch,
                                    content_type="application/merge-patch+json")
        except _NotFound:
            return None

    async def list(self, resource: Resource, *, namespace: str | None = None,
                   label_selector: str = "") -> tuple[builtins.list[JsonObject], str]:
        """The objects and the list's resourceVersion (where a watch of them starts)."""
        query = [("labelSelector", label_selector)] if label_selector else []
        found = await self._call("GET", resource.path(namespace or self.namespace), query=query)
        return list(found.get("items") or []), str(found.get("metadata", {}).get("resourceVersion", ""))

    async def watch(self, resource: Resource, *, resource_version: str, namespace: str | None = None,
                    label_selector: str = "", timeout_s: float = 300.0) -> AsyncIterator[tuple[str, JsonObject]]:
        """``(type, object)`` from ``resource_version`` on, bookmarks included, until the server ends the watch
        (after ``timeout_s``); :class:`Expired` when that version is no longer kept."""
        query: builtins.list[tuple[str, str]] = [("watch", "true"), ("allowWatchBookmarks", "true"),
                                        ("resourceVersion", resource_version),
                                        ("timeoutSeconds", str(max(1, int(timeout_s))))]
        if label_selector:
            query.append(("labelSelector", label_selector))
        response = await self._request("GET", resource.path(namespace or self.namespace), query=query, stream=True)
        try:
            async for line in _lines(response):
                try:
                    event = json.loads(line)
                    kind, obj = str(event["type"]), event["object"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise PlatformError(f"the API server at {self.host} sent a watch event that is not JSON "
                                        f"({exc}): {line[:200]!r}") from None
                if kind == "ERROR":
                    code = obj.get("code") if isinstance(obj, dict) else None
                    if code == 410:
                        raise Expired(f"watch of {resource.plural} from resourceVersion {resource_version}: "
                                      f"{obj.get('message', 'expired')}")
                    raise _error(code or 500, obj, self.host, f"watch {resource.plural}")
                yield kind, obj
        finally:
            response.close()

    # -- plumbing -------------------------------------------------------------------

    async def _call(self, method: str, path: str, *, body: Mapping[str, Any] | None = None,
                    query: builtins.list[tuple[str, str]] | None = None,
                    content_type: str = "application/json") -> JsonObject:
        response = await self._request(method, path, body=body, query=query, content_type=content_type)
        try:
            data = await response.read()
        finally:
            response.close()
        try:
            found = json.loads(data) if data else {}
        except ValueError:
            raise PlatformError(f"the API server at {self.host} answered {method} {path} with something that is "
                                f"not JSON: {data[:200]!r}") from None
        return found if isinstance(found, dict) else {}

    async def _request(self, method: str, path: str, *, body: Mapping[str, Any] | None = None,
                       query: builtins.list[tuple[str, str]] | None = None, content_type: str = "application/json",
                       stream: bool = False) -> Any:
        api = self._api
        if api is None:
            raise PlatformError("the Kubernetes client is not open; use it inside `async with Kube(...)`")
        # a watch may stay quiet for long (bookmarks only): bound its connect and each read, not its whole life
        limit = self.settings.request_timeout_s
        timeout: Any = (limit, self.settings.watch_timeout_s + limit) if stream else limit
        try:
            response = await api.call_api(
                path, method, query_params=query or [], body=dict(body) if body is not None else None,
                header_params={"Accept": "application/json", "Content-Type": content_type},
                auth_settings=["BearerToken"], _preload_content=False, _request_timeout=timeout)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise PlatformUnavailable(f"the Kubernetes API server at {self.host} cannot be reached ({exc!r}); check "
                                      "that the cluster is up and the kubeconfig (or k8s.api_url) points at it") \
                from exc
        status = response.status
        if 200 <= status <= 299:
            return response
        try:
            payload = json.loads(await response.read() or b"{}")
        except ValueError:
            payload = {}
        finally:
            response.close()
        if status == 404:
            raise _NotFound(path)
        if status == 409 and isinstance(payload, dict) and payload.get("reason") == "AlreadyExists":
            raise _AlreadyExists(path)
        raise _error(status, payload, self.host, f"{method} {path}")


class _NotFound(PlatformError):
    pass


class _AlreadyExists(PlatformError):
    pass


#: the objects a job's maker (the operator, or `stead run --platform k8s` with its user's kubeconfig) needs rights
#: on beyond what the job's own Role grants
_JOB_RBAC = frozenset({"serviceaccounts", "roles", "rolebindings"})


def _rbac_hint(what: str) -> str:
    """Whose rules to change for a refused request (``what``: its method and path), since three parties call."""
    kinds = set(what.split()[-1].partition("?")[0].split("/"))
    if "nodes" in kinds:
        return ("cordoning a host needs the optional ClusterRole stead-node-cordon: apply deploy/node-cordon.yaml "
                "(`stead k8s manifests --with-node-cordon`) and run the job's master as the account it binds, "
                "stead-master (serviceAccountName, in the operator's k8s.allowed_service_accounts); or leave "
                "k8s.cordon_bad_hosts off")
    if kinds & _JOB_RBAC:
        return ("whoever makes a job's objects needs create, get and delete on serviceaccounts, roles and "
                "rolebindings in the job's namespace, and every permission the job's Role grants (pods; get on "
                "secrets and steadjobs): the operator's Role (deploy/rbac.yaml) has them; for `stead run --platform "
                "k8s`, ask your cluster's admin for them for your kubeconfig's user")
    return ("a job's master uses its own Role, <job>-master, made with the job (pods; get on its Secret and "
            "SteadJob); the operator uses its Role in deploy/rbac.yaml (`stead k8s manifests`); `stead run "
            "--platform k8s` uses your kubeconfig's user, which needs what the operator's Role holds")


def _error(status: int, payload: Any, host: str, what: str) -> PlatformError | PlatformUnavailable:
    message = payload.get("message") if isinstance(payload, dict) else None
    message = message or f"HTTP {status}"
    if status in (401, 403):
        return PlatformRejected(f"the Kubernetes API server refused {what}: {message}; {_rbac_hint(what)}")
    if status in (400, 422):
        return PlatformRejected(f"the Kubernetes API server rejected {what}: {message}; fix the job's "
                                "specification (k8s.* settings, resources, image)")
    if status == 410:
        return Expired(f"{what}: {message}")
    if status in (429, 500, 502, 503, 504):
        return PlatformUnavailable(f"the Kubernetes API server at {host} could not serve {what} now ({message}); "
                                   "stead retries")
    return PlatformError(f"the Kubernetes API server answered {what} with {status}: {message}")


async def _lines(response: Any) -> AsyncIterator[str]:
    content = response.content
    while True:
        try:
            line = await content.readline()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise PlatformUnavailable(f"a watch on the Kubernetes API server broke off ({exc!r})") from exc
        if not line:
            return
        text = line.decode("utf-8").strip()
        if text:
            yield text


def warn_insecure(settings: K8sSettings) -> None:
    """Say in the log that the API server's certificate goes unchecked (k8s.insecure_skip_tls_verify)."""
    log.warning("k8s_tls_verification_off", api_url=settings.api_url,
                hint="k8s.insecure_skip_tls_verify=true: anyone on the path can act as the API server and read "
                     "this service account's token; give k8s.api_ca_file instead")


async def _configuration(settings: K8sSettings) -> Any:
    configuration = kclient.Configuration()
    if settings.api_url:
        if not settings.api_url.startswith(("http://", "https://")):
            raise ConfigError(f"k8s.api_url {settings.api_url!r} is not an http(s) URL; give "
                              "https://host:port (or http:// for a test server)")
        configuration.host = settings.api_url.rstrip("/")
        if settings.api_ca_file:
            configuration.ssl_ca_cert = settings.api_ca_file
        if settings.insecure_skip_tls_verify:
            warn_insecure(settings)
            configuration.verify_ssl = False
        return configuration
    if os.environ.get("KUBERNETES_SERVICE_HOST") and _SERVICE_ACCOUNT_TOKEN.exists():
        try:
            kconfig.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            return configuration
        except ConfigException as exc:
            raise ConfigError(f"the in-cluster Kubernetes configuration cannot be loaded ({exc}); give the pod a "
                              "service account, or set k8s.api_url") from exc
    try:
        await kconfig.load_kube_config(config_file=settings.kubeconfig or None, context=settings.context or None,
                                       client_configuration=configuration, persist_config=False)
    except (ConfigException, OSError, TypeError) as exc:
        raise ConfigError(f"no Kubernetes cluster configured ({exc}); set KUBECONFIG or --set k8s.kubeconfig=PATH "
                          "(and k8s.context), or k8s.api_url") from exc
    return configuration
