"""Rules and helpers every store backend shares, so that all three behave alike.

Key rule (enforced by every backend): a key is a ``str`` that starts with ``/``,
contains no NUL character and is valid UTF-8. Prefixes follow the same rule and
match as plain string prefixes (``/a`` matches ``/a``, ``/ab`` and ``/a/x``),
which is etcd's meaning. Keys sort by their UTF-8 bytes, which is also their
code-point order. ``create_all`` takes at most :data:`MAX_TXN_ITEMS` items in
every backend, so that code tested against ``memory://`` also runs on etcd.
A write gets one revision, shared by every key of a ``create_all`` or
``delete_prefix``. ``watch`` without ``start_revision`` starts right after the
newest revision this client has seen when ``watch()`` is called, so nothing
written after the call is missed. A closed store raises StoreError, also from
its open watches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
import structlog

from stead.core.errors import StoreError, StoreUnavailable
from stead.core.store.base import Lease

__all__ = [
    "MAX_TXN_ITEMS",
    "StoreLease",
    "check_items",
    "check_key",
    "check_limit",
    "check_prefix",
    "check_revision",
    "check_ttl",
    "check_value",
    "hold_lease",
    "prefix_end",
]

log = structlog.get_logger()

#: etcd's default ``--max-txn-ops``; ``create_all`` is one transaction, so it is capped here in every backend
MAX_TXN_ITEMS = 128


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


def check_items(items: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes, bytes]]:
    """Validated ``(key, key_bytes, value)`` triples for ``create_all``."""
    if len(items) > MAX_TXN_ITEMS:
        raise StoreError(f"create_all got {len(items)} items but one atomic create takes at most {MAX_TXN_ITEMS} "
                         "(etcd's transaction limit); split the batch into smaller calls")
    checked: list[tuple[str, bytes, bytes]] = []
    seen: set[str] = set()
    for key, value in items:
        raw = check_key(key)
        if key in seen:
            raise StoreError(f"create_all got key {key!r} twice; pass each key once")
        seen.add(key)
        checked.append((key, raw, check_value(key, value)))
    return checked


def check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise StoreError(f"range limit must be a non-negative int or None (no limit), got {limit!r}")


def check_revision(name: str, revision: int) -> None:
    if not isinstance(revision, int) or revision < 0:
        raise StoreError(f"{name} must be a non-negative int, got {revision!r}")


def check_ttl(ttl_s: float) -> None:
    if not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
        raise StoreError(f"lease ttl_s must be a positive number of seconds, got {ttl_s!r}")


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
