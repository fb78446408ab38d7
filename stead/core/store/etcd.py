"""StateStore on etcd v3 (``etcd://[user@]host:port[,host:port][?ca_file=...]``), the backend for clusters.

The only module that imports the etcd client. It speaks etcd's gRPC API through
aetcd's generated stubs on one ``grpc.aio`` channel (aetcd's high-level
``Client`` drops range limits and runs watches in a task nobody owns, so it is
not used). Every grpc failure is mapped here to
:class:`~stead.core.errors.StoreUnavailable` (retry later) or
:class:`~stead.core.errors.StoreError` (the request itself is wrong). Each call
is bounded by ``store_timeout_s``; a lost connection is retried by the channel
with ``retry_initial_s`` doubling to ``retry_max_s``. The channel belongs to the
event loop that opened the store; calls from other loops or threads are run
there (:class:`~stead.core.store._common.LoopAffinity`).

Security (:mod:`._etcd_access` reads it from the URL and settings): with a CA
file the channel is TLS, the server verified against that CA, with a client
certificate when one is given; with a user, the store logs in with etcd's
``Authenticate`` and sends the token it gets in the ``token`` metadata of every
call. etcd's tokens expire (simple tokens after ``--auth-token-ttl``, 5 minutes
by default), so a call refused for its token logs in again once and is retried.
A refusal that retrying cannot cure (a wrong password, a certificate either side
refuses) is a :class:`~stead.core.errors.StoreError` that says what to check; a
failure that may be an outage or a misconfiguration says both.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import math
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import grpc
import grpc.aio
import structlog
from aetcd import rpc

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, StoreUnavailable, WriteTooLarge
from stead.core.store._common import (
    LoopAffinity,
    StoreLease,
    check_items,
    check_key,
    check_limit,
    check_prefix,
    check_revision,
    check_ttl,
    check_value,
    check_write,
    hold_lease,
    max_write_bytes,
    prefix_end,
)
from stead.core.store._etcd_access import (
    EtcdAccess,
    connection_failure,
    etcd_access,
    host_port,
    refusal,
    stale_token,
    unreachable_advice,
)
from stead.core.store.base import KeyValue, Lease, StateStore, WatchEvent, WatchKind

__all__ = ["EtcdAccess", "EtcdStore", "etcd_access", "open_store", "parse_etcd_url"]

log = structlog.get_logger()

#: etcd's default --max-request-bytes: the most one write may take (store_max_write_bytes for another)
ETCD_MAX_REQUEST_BYTES = 1_572_864
_PERMANENT = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNIMPLEMENTED,
})


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` endpoints of an ``etcd://`` URL; the port defaults to 2379."""
    return list(etcd_access(url, Settings()).endpoints)


async def _grpc_target(url: str, endpoints: Sequence[tuple[str, int]]) -> str:
    """One endpoint: let grpc resolve it. Several: resolve them now into one address list grpc fails over on."""
    if len(endpoints) == 1:
        return host_port(*endpoints[0])
    v4: list[str] = []
    v6: list[str] = []
    for host, port in endpoints:
        try:
            infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise StoreUnavailable(f"cannot resolve etcd host {host!r} of {url}: {exc}; check the name or "
                                   "pass --store with reachable addresses") from exc
        addresses = {ipaddress.ip_address(info[4][0]) for info in infos}
        v4 += [host_port(str(a), port) for a in sorted(a for a in addresses if a.version == 4)]
        v6 += [host_port(str(a), port) for a in sorted(a for a in addresses if a.version == 6)]
    if v4:
        return "ipv4:" + ",".join(v4)
    return "ipv6:" + ",".join(v6)


class _LeaseGone(StoreError):
    """etcd does not know the lease (it expired or was revoked)."""


class _Compacted(StoreError):
    """The requested revision is older than etcd's compacted history."""


class EtcdStore:
    """A StateStore client of one etcd cluster over a single gRPC channel."""

    def __init__(self, access: EtcdAccess, target: str, settings: Settings) -> None:
        self._access = access
        self._url = access.public_url  # no user, no file paths: what every log line and error shows
        self._timeout = settings.store_timeout_s
        self._max_write_bytes = max_write_bytes(settings, ETCD_MAX_REQUEST_BYTES, self._url)
        options: list[tuple[str, Any]] = [
            ("grpc.initial_reconnect_backoff_ms", max(1, int(settings.retry_initial_s * 1000))),
            ("grpc.min_reconnect_backoff_ms", max(1, int(settings.retry_initial_s * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, int(settings.retry_max_s * 1000))),
            ("grpc.max_receive_message_length", -1),
        ]
        if access.user and not access.tls and not settings.etcd_allow_plaintext_password:
            raise ConfigError(f"etcd at {access.public_url}: user {access.user!r} ({access.origin('user')}) would "
                              "send its password without TLS, readable by anyone on the path; set etcd_ca_file (or "
                              "ca_file= in the store URL) to the CA of etcd's server certificate, or, for an etcd on "
                              "loopback or a test, etcd_allow_plaintext_password=true")
        #: with a user: the password (read once, at open) and etcd's token for it, renewed when etcd refuses it
        self._password = access.password() if access.user else ""
        self._auth_token = ""
        if access.tls:
            if len(access.endpoints) > 1:  # resolved to addresses: verify each server as the first endpoint's host
                options.append(("grpc.ssl_target_name_override", access.endpoints[0][0]))
            self._channel: Any = grpc.aio.secure_channel(target, _credentials(access), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._kv: Any = rpc.KVStub(self._channel)
        self._leases: Any = rpc.LeaseStub(self._channel)
        self._watches: Any = rpc.WatchStub(self._channel)
        self._auth: Any = rpc.AuthStub(self._channel)
        self._login_lock = asyncio.Lock()
        self._known_revision = 0
        self._closed = False
        #: whether it ever answered: a TLS refusal after that is taken as the connection breaking, not a verdict
        self._answered = False
        self._streams: set[Any] = set()
        self._affinity = LoopAffinity(self._url, close_timeout_s=self._timeout)

    @classmethod
    async def open(cls, url: str, settings: Settings | None = None) -> EtcdStore:
        """Connect to the cluster of ``url`` (and log in); StoreUnavailable if it does not answer."""
        settings = settings or Settings()
        access = etcd_access(url, settings)
        store = cls(access, await _grpc_target(access.public_url, access.endpoints), settings)
        try:
            await store._login(stale="")
            await store.revision()
            store._answered = True
        except BaseException:
            await store.close()
            raise
        log.info("store_opened", url=store.url, backend="etcd", revision=store._known_revision, tls=access.tls,
                 user=access.user or None)
        return store

    @property
    def url(self) -> str:
        return self._url

    @property
    def max_write_bytes(self) -> int:
        return self._max_write_bytes

    def _check_write(self, what: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        check_write(self._url, what, items, self._max_write_bytes)

    # -- the gRPC boundary ----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self._url} is closed; open a new one with open_store()")

    def _error(self, op: str, exc: BaseException) -> StoreError | StoreUnavailable:
        """Map a grpc failure of ``op`` to stead's errors, with advice."""
        if self._closed:
            return StoreError(f"store {self._url} was closed during {op}; open a new one with open_store()")
        if isinstance(exc, TimeoutError):
            code, details = "DEADLINE_EXCEEDED", f"no answer within store_timeout_s={self._timeout}"
        elif isinstance(exc, grpc.aio.AioRpcError):
            code, details = exc.code().name, exc.details() or ""
            refused = refusal(self._access, op, details)
            if refused is not None:
                return refused
            broken = connection_failure(self._access, op, code, details)
            if broken is not None and self._answered and not isinstance(broken, StoreUnavailable):
                # the same certificates worked when the store opened: a TLS error now (a record broken by a restart,
                # a close_notify) is the connection failing, retried until retry_deadline_s like an outage
                return StoreUnavailable(f"{broken} (it answered with the same certificates before: retrying)")
            if broken is not None:
                return broken
            if "request is too large" in details or "larger than max" in details:
                return WriteTooLarge(f"etcd at {self._url} refused {op}: {details}; the write is larger than this "
                                     "etcd accepts (its --max-request-bytes, 1.5 MiB by default): set "
                                     "store_max_write_bytes to that limit, and stead writes what fits")
            if exc.code() in _PERMANENT:
                if "lease not found" in details:
                    return _LeaseGone(f"etcd at {self._url} refused {op}: the lease expired or was revoked; "
                                      "take a new lease with store.lease()")
                if "compacted" in details:
                    return _Compacted(f"etcd at {self._url} refused {op}: {details}; re-read with range() and "
                                      "watch from revision()+1")
                return StoreError(f"etcd at {self._url} refused {op}: {details} ({code}); fix the request")
            if "space exceeded" in (details or ""):
                return StoreError(f"etcd at {self._url} is out of space ({details}); compact and defragment etcd "
                                  "and disarm its NOSPACE alarm (etcdctl compact / defrag / alarm disarm)")
        else:
            code, details = type(exc).__name__, str(exc)
        return StoreUnavailable(f"etcd at {self._url} is unavailable during {op} ({code}: {details}); "
                                f"{unreachable_advice(self._access)}")

    # -- logging in (etcd's authentication) -------------------------------------------------------------------

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("token", self._auth_token),) if self._auth_token else None

    def _must_log_in(self, details: str) -> bool:
        """Whether etcd refused a call for its token (expired, or etcd's users changed), so logging in again
        cures it; ``details``: the refusal's text."""
        return bool(self._access.user) and stale_token(details)

    async def _login(self, *, stale: str) -> None:
        """Get a new token from etcd, unless another call did since ``stale`` (the token that was refused)."""
        if not self._access.user:
            return
        async with self._login_lock:
            if self._auth_token != stale:
                return
            call = self._auth.Authenticate(rpc.AuthenticateRequest(name=self._access.user, password=self._password),
                                           timeout=self._timeout)
            try:
                response = await call
            except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and "authentication is not enabled" in (exc.details() or ""):
                    log.warning("etcd_auth_not_enabled", url=self._url, user=self._access.user,
                                hint="etcd lets every client in; enable its authentication (etcdctl auth enable)")
                    return
                raise self._error("login", exc) from exc
            except BaseException:
                await self._settle(call)
                raise
            self._auth_token = str(response.token)
            log.debug("etcd_logged_in", url=self._url, user=self._access.user)

    def _open_stream(self, method: Any) -> Any:
        self._check_open()
        call = method(metadata=self._metadata())
        self._streams.add(call)
        return call

    async def _end_stream(self, call: Any) -> None:
        await self._settle(call)
        self._streams.discard(call)  # only once settled: close() settles what an interrupted end left

    async def _settle(self, call: Any) -> None:
        """Cancel a call and wait until grpc has delivered its end on this event loop, even when cancelled.

        grpc.aio completes calls through one process-wide poller, and a cancelled
        stream's status arrives a moment after ``code()`` returns; if this loop
        closed first, grpc would schedule it on a dead loop and the next loop
        (the next test) reports "Event loop is closed". A native cancellation (a
        generator finalized while its loop shuts down) is not stopped by anyio's
        shield, so the settling runs in a task of its own that the caller waits
        for in any case (bounded by ``store_timeout_s``).
        """
        settling = asyncio.ensure_future(self._settle_now(call))
        try:
            await asyncio.shield(settling)
        except asyncio.CancelledError:
            while not settling.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(settling)
            raise

    async def _settle_now(self, call: Any) -> None:
        status_task = _status_task(call)
        call.cancel()
        with anyio.move_on_after(self._timeout):
            await call.code()
            if status_task is not None:
                await asyncio.wait([status_task])

    async def _call(self, op: str, method: Any, request: Any) -> Any:
        self._check_open()
        return await self._affinity.call(op, lambda: self._call_here(op, method, request))

    async def _call_here(self, op: str, method: Any, request: Any, *, logged_in: bool = False) -> Any:
        self._check_open()
        token = self._auth_token
        call = method(request, timeout=self._timeout, metadata=self._metadata())
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            if not logged_in and self._must_log_in(exc.details() or ""):  # refused before it was applied: retry once
                await self._login(stale=token)
                return await self._call_here(op, method, request, logged_in=True)
            raise self._error(op, exc) from exc
        except grpc.aio.UsageError as exc:
            raise self._error(op, exc) from exc
        except BaseException:  # cancelled: let grpc finish the call while this loop runs
            await self._settle(call)
            if self._closed and _not_cancelled_by_caller():  # grpc.aio's way of reporting a closed channel
                raise self._error(op, ConnectionError("closed")) from None
            raise
        self._known_revision = max(self._known_revision, response.header.revision)
        return response

    # -- StateStore ---------------------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        response = await self._call("get", self._kv.Range, rpc.RangeRequest(key=check_key(key)))
        return _key_value(response.kvs[0]) if response.kvs else None

    async def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        raw, data = check_key(key), check_value(key, value)
        self._check_write("put", [(raw, data)])
        request = rpc.PutRequest(key=raw, value=data, lease=_lease_id(lease))
        response = await self._call("put", self._kv.Put, request)
        return int(response.header.revision)

    async def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int, lease: Lease | None = None
    ) -> bool:
        raw, data = check_key(key), check_value(key, value)
        self._check_write("compare_and_put", [(raw, data)])
        check_revision("expected_mod_revision", expected_mod_revision)
        if expected_mod_revision == 0:
            compare = rpc.Compare(key=raw, result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, create_revision=0)
        else:
            compare = rpc.Compare(key=raw, result=rpc.Compare.EQUAL, target=rpc.Compare.MOD,
                                  mod_revision=expected_mod_revision)
        put = rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=data, lease=_lease_id(lease)))
        response = await self._call("compare_and_put", self._kv.Txn, rpc.TxnRequest(compare=[compare], success=[put]))
        return bool(response.succeeded)

    async def put_all(self, items: Sequence[tuple[str, bytes]]) -> int:
        checked = check_items(items, what="put_all")
        self._check_write("put_all", [(raw, value) for _, raw, value in checked])
        if not checked:
            return await self.revision()
        request = rpc.TxnRequest(
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=value)) for _, raw, value in checked])
        response = await self._call("put_all", self._kv.Txn, request)
        return int(response.header.revision)

    async def create_all(self, items: Sequence[tuple[str, bytes]]) -> bool:
        checked = check_items(items)
        self._check_write("create_all", [(raw, value) for _, raw, value in checked])
        if not checked:
            return True
        request = rpc.TxnRequest(
            compare=[rpc.Compare(key=raw, result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, create_revision=0)
                     for _, raw, _ in checked],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=raw, value=value)) for _, raw, value in checked])
        response = await self._call("create_all", self._kv.Txn, request)
        return bool(response.succeeded)

    async def delete(self, key: str) -> bool:
        response = await self._call("delete", self._kv.DeleteRange, rpc.DeleteRangeRequest(key=check_key(key)))
        return int(response.deleted) > 0

    async def delete_prefix(self, prefix: str) -> int:
        low = check_prefix(prefix)
        request = rpc.DeleteRangeRequest(key=low, range_end=prefix_end(low))
        response = await self._call("delete_prefix", self._kv.DeleteRange, request)
        return int(response.deleted)

    async def range(self, prefix: str, *, start: str | None = None, limit: int | None = None) -> list[KeyValue]:
        low = check_prefix(prefix)
        high = prefix_end(low)
        if start is not None:
            low = max(low, check_key(start))
        check_limit(limit)
        self._check_open()
        if limit == 0 or low >= high:
            return []
        request = rpc.RangeRequest(key=low, range_end=high, limit=limit or 0)
        response = await self._call("range", self._kv.Range, request)
        return [_key_value(kv) for kv in response.kvs]

    def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        low = check_prefix(prefix)
        if start_revision is not None:
            check_revision("start_revision", start_revision)
        start = self._known_revision + 1 if start_revision is None else start_revision
        return self._affinity.iterate("watch", self._watch(low, prefix_end(low), start))

    async def _start_watch(self, create: Any) -> tuple[Any, Any]:
        """A watch stream and its first response; logs in again once when etcd refuses the token."""
        for attempt in (1, 2):
            token = self._auth_token
            call = self._open_stream(self._watches.Watch)
            try:
                try:
                    with anyio.fail_after(self._timeout):
                        await call.write(rpc.WatchRequest(create_request=create))
                        response = await call.read()
                except TimeoutError as exc:
                    raise self._error("watch", exc) from exc
                except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
                    raise self._error("watch", exc) from exc
                except asyncio.CancelledError:
                    if self._closed and _not_cancelled_by_caller():  # a call close() ended
                        raise self._error("watch", ConnectionError("closed")) from None
                    raise
            except BaseException:
                await self._end_stream(call)
                raise
            if attempt == 1 and response is not grpc.aio.EOF and response.canceled and \
                    self._must_log_in(response.cancel_reason):
                await self._end_stream(call)
                await self._login(stale=token)
                continue
            return call, response
        raise AssertionError("unreachable: the second attempt returns")

    async def _watch(self, low: bytes, high: bytes, start: int) -> AsyncGenerator[WatchEvent, None]:
        create = rpc.WatchCreateRequest(key=low, range_end=high, start_revision=max(start, 1))
        call, response = await self._start_watch(create)
        try:
            while True:
                if response is grpc.aio.EOF:
                    raise self._error("watch", ConnectionError("the watch stream ended"))
                if response.compact_revision:
                    raise StoreError(f"watch of {self._url} from revision {start} is impossible: history before "
                                     f"{response.compact_revision} was compacted; re-read with range() and watch "
                                     "from revision()+1")
                if response.canceled:
                    reason = str(response.cancel_reason)
                    raise refusal(self._access, "watch", reason) or StoreUnavailable(
                        f"etcd at {self._url} cancelled the watch ({reason}); watch again from the last revision "
                        "seen + 1")
                for event in response.events:
                    revision = int(event.kv.mod_revision)
                    self._known_revision = max(self._known_revision, revision)
                    yield WatchEvent(kind=WatchKind.PUT if event.type == rpc.Event.PUT else WatchKind.DELETE,
                                     key=event.kv.key.decode(), value=bytes(event.kv.value), revision=revision)
                response = await call.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            raise self._error("watch", exc) from exc
        except asyncio.CancelledError:
            if self._closed and _not_cancelled_by_caller():  # grpc.aio's way of reporting a call close() ended
                raise self._error("watch", ConnectionError("closed")) from None
            raise
        finally:
            await self._end_stream(call)

    def lease(self, ttl_s: float) -> AbstractAsyncContextManager[Lease]:
        check_ttl(ttl_s)
        return hold_lease(url=self._url, grant=lambda: self.grant_lease(ttl_s), refresh=self.refresh_lease,
                          revoke=self.revoke_lease, revoke_timeout_s=self._timeout)

    async def revision(self) -> int:
        # an empty transaction: a linearizable read of the revision that needs no permission on any key, so a
        # user whose role covers only its own job's keys may call it
        await self._call("revision", self._kv.Txn, rpc.TxnRequest())
        return self._known_revision

    async def close(self) -> None:
        try:
            await self._affinity.call("close", self._close)
        except StoreError:  # its loop has stopped, and took the channel's calls with it
            self._closed = True

    async def _close(self) -> None:
        if not self._closed:
            self._closed = True
            for call in list(self._streams):
                await self._end_stream(call)
            await self._channel.close()
            log.info("store_closed", url=self._url, backend="etcd")

    # -- beyond the protocol: raw leases (no keep-alive) and history compaction --------------------------------

    async def grant_lease(self, ttl_s: float) -> Lease:
        """A lease nobody keeps alive; etcd rounds ``ttl_s`` up to whole seconds (and to its minimum TTL)."""
        check_ttl(ttl_s)
        response = await self._call("grant_lease", self._leases.LeaseGrant, rpc.LeaseGrantRequest(TTL=math.ceil(ttl_s)))
        if response.error:
            raise StoreError(f"etcd at {self._url} refused a lease of {ttl_s}s: {response.error}")
        return StoreLease(id=int(response.ID), ttl_s=float(response.TTL))

    async def refresh_lease(self, lease: Lease) -> None:
        """Push the lease's expiry ``ttl_s`` into the future; StoreError if it is already gone."""
        self._check_open()
        await self._affinity.call("refresh_lease", lambda: self._refresh_lease(lease))

    async def _refresh_lease(self, lease: Lease) -> None:
        call = self._open_stream(self._leases.LeaseKeepAlive)
        try:
            with anyio.fail_after(self._timeout):
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease.id))
                response = await call.read()
                await call.done_writing()  # etcd then ends the stream cleanly
                while await call.read() is not grpc.aio.EOF:
                    pass
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, TimeoutError) as exc:
            raise self._error("refresh_lease", exc) from exc
        finally:
            await self._end_stream(call)
        if response is grpc.aio.EOF:
            raise self._error("refresh_lease", ConnectionError("the keep-alive stream ended"))
        if response.TTL <= 0:
            raise StoreError(f"lease {lease.id} on {self._url} expired or was revoked; take a new lease")

    async def revoke_lease(self, lease: Lease) -> None:
        """Delete the lease and its keys now; a lease already gone is not an error."""
        with contextlib.suppress(_LeaseGone):
            await self._call("revoke_lease", self._leases.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease.id))

    async def compact(self, revision: int) -> None:
        """Forget the change history before ``revision``; watches cannot start before it any more."""
        check_revision("revision", revision)
        upto = min(revision, await self.revision())
        if upto > 0:
            with contextlib.suppress(_Compacted):  # already compacted that far: nothing to do
                await self._call("compact", self._kv.Compact, rpc.CompactionRequest(revision=upto))


def _not_cancelled_by_caller() -> bool:
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


def _status_task(call: Any) -> asyncio.Task[Any] | None:
    """grpc's internal task that receives a stream's status, found by its coroutine's reference to the call.

    Relies on grpc.aio internals; if they change, nothing is found and _settle only waits for ``code()``.
    """
    cython_call = getattr(call, "_cython_call", None)
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        if getattr(coro, "__qualname__", "") != "_AioCall._handle_status_once_received" or task.done():
            continue
        if any(ref is cython_call for scope in gc.get_referents(coro) for ref in gc.get_referents(scope)):
            return task
    return None


def _credentials(access: EtcdAccess) -> Any:
    """The channel's TLS credentials: etcd's server verified against the CA, with the client certificate if any."""
    client = (access.read("key_file"), access.read("cert_file")) if access.cert_file else (None, None)
    return grpc.ssl_channel_credentials(root_certificates=access.read("ca_file"), private_key=client[0],
                                        certificate_chain=client[1])


def _lease_id(lease: Lease | None) -> int:
    return 0 if lease is None else lease.id


def _key_value(kv: Any) -> KeyValue:
    return KeyValue(key=kv.key.decode(), value=bytes(kv.value), create_revision=int(kv.create_revision),
                    mod_revision=int(kv.mod_revision), lease=int(kv.lease) or None)


async def open_store(url: str, settings: Settings) -> StateStore:
    """Entry point of the ``etcd`` scheme: connects and checks the cluster answers."""
    return await EtcdStore.open(url, settings)
