"""Rules and helpers every store backend shares, so that all three behave alike.

Key rule (enforced by every backend): a key is a ``str`` that starts with ``/``,
contains no NUL character and is valid UTF-8. Prefixes follow the same rule and
match as plain string prefixes (``/a`` matches ``/a``, ``/ab`` and ``/a/x``),
which is etcd's meaning. Keys sort by their UTF-8 bytes, which is also their
code-point order. ``create_all`` takes at most :data:`MAX_TXN_ITEMS` items in
every backend, so that code tested against ``memory://`` also runs on etcd.
Every write is measured by :func:`write_size` (an upper bound of the request
etcd gets) and refused with :class:`WriteTooLarge` before the store is asked
when it exceeds the store's ``max_write_bytes`` (``store_max_write_bytes``, or
the backend's own limit).
A write gets one revision, shared by every key of a ``create_all`` or
``delete_prefix``. ``watch`` without ``start_revision`` starts right after the
newest revision this client has seen when ``watch()`` is called, so nothing
written after the call is missed. A closed store raises StoreError, also from
its open watches.

Threads and event loops: a store may be used from any thread and any event loop
at once, and a caller may be cancelled at any point, natively (``task.cancel()``,
``asyncio.timeout``, grpclib tearing a handler down) or by anyio. Native
cancellation is not stopped by anyio's shields, so no backend may rely on a
caller waiting for work it handed to a thread: work that touches a client runs
where the client lives (sqlite: the store's own thread; etcd: the event loop
that opened it, see :class:`LoopAffinity`) and is never abandoned half-done.
:class:`Notifier` wakes watchers on whatever loop they wait on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import structlog

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, StoreUnavailable, WriteTooLarge
from stead.core.store.base import Lease

__all__ = [
    "EMBEDDED_MAX_WRITE_BYTES",
    "MAX_TXN_ITEMS",
    "MIN_MAX_WRITE_BYTES",
    "LoopAffinity",
    "Notifier",
    "StoreLease",
    "check_items",
    "check_key",
    "check_limit",
    "check_prefix",
    "check_revision",
    "check_ttl",
    "check_value",
    "check_write",
    "hold_lease",
    "item_size",
    "max_write_bytes",
    "prefix_end",
    "public_store_url",
    "write_size",
]

log = structlog.get_logger()

T = TypeVar("T")

#: etcd's default ``--max-txn-ops``; ``create_all`` is one transaction, so it is capped here in every backend
MAX_TXN_ITEMS = 128

#: the largest write sqlite and memory take: SQLite's default SQLITE_MAX_LENGTH (the most bytes one value may hold)
EMBEDDED_MAX_WRITE_BYTES = 1_000_000_000
#: the smallest ``store_max_write_bytes`` a store accepts: room for a snapshot's head and any one event of stead's
MIN_MAX_WRITE_BYTES = 64 << 10
#: what one key of a write adds to its key and value bytes, at most: etcd's protobuf framing of a put and of the
#: compare that a ``create_all`` makes on the same key (its key bytes are counted twice for that)
_ITEM_OVERHEAD_BYTES = 64
#: what one write adds to its keys, at most: etcd's raft request header and transaction framing
_WRITE_OVERHEAD_BYTES = 512


@dataclasses.dataclass(frozen=True)
class StoreLease:
    """The :class:`~stead.core.store.base.Lease` every backend hands out."""

    id: int
    ttl_s: float


def _check_path(kind: str, key: object) -> bytes:
    if not isinstance(key, str):
        raise StoreError(f"store {kind} must be a str, got {type(key).__name__}; pass a path like '/stead/jobs/x'")
    if not key.startswith("/"):
        raise StoreError(f"store {kind} {key!r} must start with '/'; pass a path like '/stead/jobs/x'")
    if "\x00" in key:
        raise StoreError(f"store {kind} {key!r} contains a NUL character; remove it")
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError:
        raise StoreError(f"store {kind} {key!r} is not valid UTF-8; use only encodable characters") from None


def check_key(key: object) -> bytes:
    """The key's UTF-8 bytes, or :class:`StoreError` if it breaks the key rule."""
    return _check_path("key", key)


def check_prefix(prefix: object) -> bytes:
    """The prefix's UTF-8 bytes, or :class:`StoreError` if it breaks the key rule."""
    return _check_path("prefix", prefix)


def check_value(key: str, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise StoreError(f"value for store key {key!r} must be bytes, got {type(value).__name__}; encode it first")


def check_items(items: Sequence[tuple[str, bytes]], *, what: str = "create_all") -> list[tuple[str, bytes, bytes]]:
    """Validated ``(key, key_bytes, value)`` triples for ``create_all`` (or ``put_all``: ``what``)."""
    if len(items) > MAX_TXN_ITEMS:
        raise StoreError(f"{what} got {len(items)} items but one transaction takes at most {MAX_TXN_ITEMS} "
                         "(etcd's transaction limit); split the batch into smaller calls")
    checked: list[tuple[str, bytes, bytes]] = []
    seen: set[str] = set()
    for key, value in items:
        raw = check_key(key)
        if key in seen:
            raise StoreError(f"{what} got key {key!r} twice; pass each key once")
        seen.add(key)
        checked.append((key, raw, check_value(key, value)))
    return checked


def item_size(key: str | bytes, value_bytes: int) -> int:
    """What one key with a value of ``value_bytes`` adds to a write (see :func:`write_size`)."""
    raw = key.encode() if isinstance(key, str) else key
    return 2 * len(raw) + value_bytes + _ITEM_OVERHEAD_BYTES


def write_size(items: Iterable[tuple[str | bytes, int]]) -> int:
    """The size one write of ``(key, value length)`` items counts against a store's ``max_write_bytes``.

    An upper bound of the request etcd checks against its ``--max-request-bytes``, so
    that a write measured within the limit is one etcd takes; ``write_size(())`` is
    what a write costs beyond its keys.
    """
    return _WRITE_OVERHEAD_BYTES + sum(item_size(key, size) for key, size in items)


def max_write_bytes(settings: Settings, own: int, url: str) -> int:
    """A store's ``max_write_bytes``: ``store_max_write_bytes`` if set, else the backend's ``own`` limit."""
    limit = settings.store_max_write_bytes or own
    if limit < MIN_MAX_WRITE_BYTES:
        raise ConfigError(f"store_max_write_bytes={limit} for {url} is too small: a store must take writes of at "
                          f"least {MIN_MAX_WRITE_BYTES} bytes; set it to the store's own limit (etcd: its "
                          "--max-request-bytes) or 0 for the backend's default")
    return limit


def check_write(url: str, what: str, items: Sequence[tuple[bytes, bytes]], limit: int) -> None:
    """:class:`WriteTooLarge` if the ``(key bytes, value)`` items are more than one write to ``url`` may take."""
    size = write_size((key, len(value)) for key, value in items)
    if size > limit:
        first = items[0][0].decode(errors="replace")
        keys = f"key {first!r}" if len(items) == 1 else f"{len(items)} keys from {first!r}"
        raise WriteTooLarge(f"{what} of {keys} is {size} bytes, more than the {limit} bytes one write to {url} may "
                            "take (store_max_write_bytes; on etcd its --max-request-bytes); nothing was written: "
                            "write a large value with stead.core.store.chunked.ChunkedValue, or fewer keys at once")


def check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise StoreError(f"range limit must be a non-negative int or None (no limit), got {limit!r}")


def check_revision(name: str, revision: int) -> None:
    if not isinstance(revision, int) or revision < 0:
        raise StoreError(f"{name} must be a non-negative int, got {revision!r}")


def check_ttl(ttl_s: float) -> None:
    if not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise StoreError(f"lease ttl_s must be a positive number of seconds, got {ttl_s!r}")


def public_store_url(url: str) -> str:
    """``url`` without its query and without the user (and anything else before ``@``) of its authority: safe to
    log or show, whatever a user put there by mistake."""
    scheme, sep, rest = url.partition("?")[0].partition("://")
    if not sep:
        return scheme
    authority, slash, tail = rest.partition("/")
    _, at, hosts = authority.rpartition("@")
    return f"{scheme}://{hosts if at else authority}{slash}{tail}"


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix`` (etcd's ``range_end``)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # etcd's "to the end of the keyspace"; unreachable for keys starting with '/'


async def _keep_alive(lease: Lease, refresh: Callable[[Lease], Awaitable[None]], url: str) -> None:
    """Refresh ``lease`` every ttl/3; tolerate an unreachable store until the lease has surely expired."""
    last_ok = time.monotonic()
    while True:
        await anyio.sleep(lease.ttl_s / 3)
        try:
            await refresh(lease)
        except StoreUnavailable as exc:
            if time.monotonic() - last_ok >= lease.ttl_s:
                raise StoreUnavailable(
                    f"lease {lease.id} on {url} could not be refreshed for {lease.ttl_s}s and has expired, "
                    "so its keys are gone; make the store reachable and take a new lease") from exc
            log.warning("store_lease_refresh_failed", url=url, lease=lease.id, error=str(exc))
        else:
            last_ok = time.monotonic()


@asynccontextmanager
async def hold_lease(
    *,
    url: str,
    grant: Callable[[], Awaitable[Lease]],
    refresh: Callable[[Lease], Awaitable[None]],
    revoke: Callable[[Lease], Awaitable[None]],
    revoke_timeout_s: float,
) -> AsyncIterator[Lease]:
    """Grant a lease, keep it alive from a task owned by this context, revoke it on exit.

    If the lease is lost (the store says it is gone, or it could not be refreshed
    within its TTL), the body is cancelled and the loss is raised from the context.
    """
    lease = await grant()
    try:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_keep_alive, lease, refresh, url)
                try:
                    yield lease
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The body's own exception or the keep-alive's failure: surface it unwrapped.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    finally:
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + revoke_timeout_s
            try:
                await revoke(lease)
            except (StoreUnavailable, StoreError) as exc:
                log.warning("store_lease_revoke_failed", url=url, lease=lease.id, error=str(exc))
        if scope.cancelled_caught:
            log.warning("store_lease_revoke_timed_out", url=url, lease=lease.id, timeout_s=revoke_timeout_s)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Notifier:
    """A change counter whose waiters may sit on any event loop, woken from any thread.

    A waiter reads :attr:`count` before it looks at the data, then waits with
    :meth:`wait_past`, which returns at once if anything changed meanwhile, so no
    change is missed between looking and waiting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def count(self) -> int:
        return self._count

    def notify(self) -> None:
        with self._lock:
            self._count += 1
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody waits there any more
                loop.call_soon_threadsafe(_wake, future)

    async def wait_past(self, seen: int, timeout_s: float = math.inf) -> None:
        """Return when the count differs from ``seen``, or after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        waiter = (loop, future)
        with self._lock:
            if self._count != seen:
                return
            self._waiters.append(waiter)
        try:
            with anyio.move_on_after(max(0.0, timeout_s)):
                await future
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._waiters.remove(waiter)


class LoopAffinity:
    """Runs a client's coroutines on the event loop that created the client, whichever loop calls.

    Clients such as ``grpc.aio`` channels belong to one event loop. A call from
    another loop (another thread) is handed to the owner loop and awaited from the
    caller's; cancelling the caller cancels the call there. If the owner loop has
    stopped, the call fails with :class:`StoreError` instead of hanging.
    """

    def __init__(self, url: str, *, close_timeout_s: float) -> None:
        self.url = url
        self.close_timeout_s = close_timeout_s
        self.loop = asyncio.get_running_loop()

    def here(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop running in this thread
            return False

    def _gone(self, op: str) -> StoreError:
        return StoreError(f"store {self.url} belongs to an event loop that has stopped (during {op}); "
                          "open the store again on a running loop")

    async def call(self, op: str, make: Callable[[], Awaitable[T]]) -> T:
        if self.here():
            return await make()
        if self.loop.is_closed() or not self.loop.is_running():
            raise self._gone(op)

        async def run() -> T:
            return await make()

        try:
            handed = asyncio.run_coroutine_threadsafe(run(), self.loop)
        except RuntimeError:  # closed between the check and the hand-over
            raise self._gone(op) from None
        try:
            return await asyncio.wrap_future(handed)
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller was cancelled (and the call on the owner loop with it)
            raise self._gone(op) from None  # the owner loop cancelled it on its way out

    def iterate(self, op: str, source: AsyncGenerator[T, None]) -> AsyncIterator[T]:
        """``source`` (an async generator of the owner loop) as an iterator for the calling loop.

        On the owner loop that is ``source`` itself.
        """
        return source if self.here() else self._pumped(op, source)

    async def _pumped(self, op: str, source: AsyncGenerator[T, None]) -> AsyncIterator[T]:
        """``source`` read from another loop.

        From another loop, one task on the owner loop owns the generator: it fetches an
        item each time the reader asks for one (so nothing piles up) and closes the
        generator itself when the reader leaves, so the generator never runs in two
        tasks at once.
        """
        reader = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        wanted = asyncio.Event()  # set on the owner loop, waited on there

        def send(kind: str, value: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the reader's loop has closed: nobody listens
                reader.call_soon_threadsafe(inbox.put_nowait, (kind, value))

        async def pump() -> None:
            try:
                async with contextlib.aclosing(source) as events:
                    while True:
                        await wanted.wait()
                        wanted.clear()
                        try:
                            item = await anext(events)
                        except StopAsyncIteration:
                            send("end", None)
                            return
                        send("item", item)
            except Exception as exc:
                send("error", exc)
            finally:
                send("closed", None)

        if self.loop.is_closed() or not self.loop.is_running():
            raise self._gone(op)
        try:
            pumping = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        except RuntimeError:
            raise self._gone(op) from None
        closed = False
        try:
            while True:
                self.loop.call_soon_threadsafe(wanted.set)
                kind, value = await inbox.get()
                if kind == "item":
                    yield value
                elif kind == "end":
                    return
                elif kind == "error":
                    raise value
                else:
                    closed = True
                    raise self._gone(op)
        finally:
            pumping.cancel()  # the pump closes the generator in its own task
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.close_timeout_s):
                while not closed:
                    closed = (await inbox.get())[0] == "closed"
