"""In-process StateStore for tests and single-process experiments (``memory://``).

Nothing is persisted; every ``open_store("memory://")`` is a fresh, empty store.
Leases expire by a monotonic clock (injectable for tests), checked lazily on
every call and by waiting watchers at the next lease deadline. Any thread and
any event loop may use one instance at once: every call runs under one lock
and watchers are woken through a :class:`~stead.core.store._common.Notifier`.
Every call is a checkpoint (it yields to the event loop first), as a real store's
round trip would be, so a task that calls it in a loop cannot starve its loop.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager

import anyio.lowlevel

from stead.core.config import Settings
from stead.core.errors import StoreError
from stead.core.store._common import (
    EMBEDDED_MAX_WRITE_BYTES,
    Notifier,
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
)
from stead.core.store.base import KeyValue, Lease, StateStore, WatchEvent, WatchKind

__all__ = ["MemoryStore", "open_store"]


@dataclasses.dataclass
class _LeaseState:
    ttl_s: float
    expires_at: float
    keys: set[str]


class MemoryStore:
    """A dict with revisions, a change history for watches, and leases."""

    def __init__(self, url: str = "memory://", *, clock: Callable[[], float] = time.monotonic,
                 settings: Settings | None = None) -> None:
        self._url = url
        self._clock = clock
        self._settings = settings or Settings()
        self._max_write_bytes = max_write_bytes(self._settings, EMBEDDED_MAX_WRITE_BYTES, url)
        self._data: dict[str, KeyValue] = {}
        self._sorted_keys: list[str] = []
        self._history: list[WatchEvent] = []
        self._history_revisions: list[int] = []
        self._compacted = 0
        self._revision = 0
        self._leases: dict[int, _LeaseState] = {}
        self._next_lease_id = 1
        self._changed = Notifier()
        self._closed = False
        self._lock = threading.RLock()

    @property
    def url(self) -> str:
        return self._url

    @property
    def max_write_bytes(self) -> int:
        return self._max_write_bytes

    def _check_write(self, what: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        check_write(self._url, what, items, self._max_write_bytes)

    # -- internals ----------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self._url} is closed; open a new one with open_store()")
        self._expire_leases()

    def _notify(self) -> None:
        self._changed.notify()

    def _record(self, kind: WatchKind, key: str, value: bytes, revision: int) -> None:
        self._history.append(WatchEvent(kind=kind, key=key, value=value, revision=revision))
        self._history_revisions.append(revision)

    def _write(self, key: str, value: bytes, lease: Lease | None, revision: int) -> None:
        lease_id = self._live_lease(lease)
        old = self._data.get(key)
        if old is None:
            bisect.insort(self._sorted_keys, key)
        elif old.lease is not None and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        if lease_id is not None:
            self._leases[lease_id].keys.add(key)
        create = old.create_revision if old is not None else revision
        self._data[key] = KeyValue(key=key, value=value, create_revision=create, mod_revision=revision, lease=lease_id)
        self._record(WatchKind.PUT, key, value, revision)

    def _remove(self, key: str, revision: int) -> None:
        old = self._data.pop(key)
        del self._sorted_keys[bisect.bisect_left(self._sorted_keys, key)]
        if old.lease is not None and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        self._record(WatchKind.DELETE, key, b"", revision)

    def _live_lease(self, lease: Lease | None) -> int | None:
        if lease is None:
            return None
        if lease.id not in self._leases:
            raise StoreError(f"lease {lease.id} expired or was revoked; take a new lease with store.lease()")
        return lease.id

    def _drop_lease(self, lease_id: int) -> None:
        state = self._leases.pop(lease_id)
        if state.keys:
            self._revision += 1
            for key in sorted(state.keys):
                self._remove(key, self._revision)
            self._notify()

    def _expire_leases(self) -> None:
        now = self._clock()
        for lease_id in [i for i, s in self._leases.items() if s.expires_at <= now]:
            self._drop_lease(lease_id)

    def _next_expiry(self) -> float:
        return min((s.expires_at for s in self._leases.values()), default=math.inf)

    def _keys_under(self, prefix: str, start: str | None) -> list[str]:
        low = prefix if start is None or start < prefix else start
        keys: list[str] = []
        for key in self._sorted_keys[bisect.bisect_left(self._sorted_keys, low):]:
            if not key.startswith(prefix):
                break
            keys.append(key)
        return keys

    # -- StateStore ---------------------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        check_key(key)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            return self._data.get(key)

    async def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        raw, data = check_key(key), check_value(key, value)
        self._check_write("put", [(raw, data)])
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            self._live_lease(lease)
            self._revision += 1
            self._write(key, data, lease, self._revision)
            self._notify()
            return self._revision

    async def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int, lease: Lease | None = None
    ) -> bool:
        raw, data = check_key(key), check_value(key, value)
        self._check_write("compare_and_put", [(raw, data)])
        check_revision("expected_mod_revision", expected_mod_revision)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            self._live_lease(lease)
            current = self._data.get(key)
            if (current.mod_revision if current is not None else 0) != expected_mod_revision:
                return False
            self._revision += 1
            self._write(key, data, lease, self._revision)
            self._notify()
            return True

    async def put_all(self, items: Sequence[tuple[str, bytes]]) -> int:
        checked = check_items(items, what="put_all")
        self._check_write("put_all", [(raw, value) for _, raw, value in checked])
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            if not checked:
                return self._revision
            self._revision += 1
            for key, _, value in checked:
                self._write(key, value, None, self._revision)
            self._notify()
            return self._revision

    async def create_all(self, items: Sequence[tuple[str, bytes]]) -> bool:
        checked = check_items(items)
        self._check_write("create_all", [(raw, value) for _, raw, value in checked])
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            if any(key in self._data for key, _, _ in checked):
                return False
            if not checked:
                return True
            self._revision += 1
            for key, _, value in checked:
                self._write(key, value, None, self._revision)
            self._notify()
            return True

    async def delete(self, key: str) -> bool:
        check_key(key)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            if key not in self._data:
                return False
            self._revision += 1
            self._remove(key, self._revision)
            self._notify()
            return True

    async def delete_prefix(self, prefix: str) -> int:
        check_prefix(prefix)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            keys = self._keys_under(prefix, None)
            if keys:
                self._revision += 1
                for key in keys:
                    self._remove(key, self._revision)
                self._notify()
            return len(keys)

    async def range(self, prefix: str, *, start: str | None = None, limit: int | None = None) -> list[KeyValue]:
        check_prefix(prefix)
        if start is not None:
            check_key(start)
        check_limit(limit)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            keys = self._keys_under(prefix, start)
            if limit is not None:
                keys = keys[:limit]
            return [self._data[k] for k in keys]

    def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        check_prefix(prefix)
        if start_revision is not None:
            check_revision("start_revision", start_revision)
        return self._watch(prefix, self._revision + 1 if start_revision is None else start_revision)

    async def _watch(self, prefix: str, next_revision: int) -> AsyncIterator[WatchEvent]:
        while True:
            with self._lock:
                self._check_open()
                if next_revision < self._compacted:
                    raise StoreError(f"watch start revision {next_revision} of {self._url} was compacted (history "
                                     f"starts at {self._compacted}); re-read with range() and watch from "
                                     "revision()+1")
                changed = self._changed.count
                first = bisect.bisect_left(self._history_revisions, next_revision)
                batch = [e for e in self._history[first:] if e.key.startswith(prefix)]
                next_revision = max(next_revision, self._revision + 1)
                wait_s = self._next_expiry() - self._clock()
            for event in batch:
                yield event
            if not batch:
                await self._changed.wait_past(changed, wait_s)

    def lease(self, ttl_s: float) -> AbstractAsyncContextManager[Lease]:
        check_ttl(ttl_s)
        return hold_lease(url=self._url, grant=lambda: self.grant_lease(ttl_s), refresh=self.refresh_lease,
                          revoke=self.revoke_lease, revoke_timeout_s=self._settings.store_timeout_s)

    async def revision(self) -> int:
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            return self._revision

    async def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._notify()

    # -- beyond the protocol: raw leases (no keep-alive) and history compaction --------------------------------

    async def grant_lease(self, ttl_s: float) -> Lease:
        """A lease nobody keeps alive: it expires ``ttl_s`` from now unless refreshed."""
        check_ttl(ttl_s)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            lease_id = self._next_lease_id
            self._next_lease_id += 1
            self._leases[lease_id] = _LeaseState(ttl_s=ttl_s, expires_at=self._clock() + ttl_s, keys=set())
            return StoreLease(id=lease_id, ttl_s=ttl_s)

    async def refresh_lease(self, lease: Lease) -> None:
        """Push the lease's expiry ``ttl_s`` into the future; StoreError if it is already gone."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            state = self._leases.get(lease.id)
            if state is None:
                raise StoreError(f"lease {lease.id} on {self._url} expired or was revoked; take a new lease")
            state.expires_at = self._clock() + state.ttl_s

    async def revoke_lease(self, lease: Lease) -> None:
        """Delete the lease and its keys now; a lease already gone is not an error."""
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            if lease.id in self._leases:
                self._drop_lease(lease.id)

    async def compact(self, revision: int) -> None:
        """Forget the change history before ``revision``; watches cannot start before it any more."""
        check_revision("revision", revision)
        await anyio.lowlevel.checkpoint()
        with self._lock:
            self._check_open()
            revision = min(revision, self._revision)
            cut = bisect.bisect_left(self._history_revisions, revision)
            del self._history[:cut], self._history_revisions[:cut]
            self._compacted = max(self._compacted, revision)


async def open_store(url: str, settings: Settings) -> StateStore:
    """Entry point of the ``memory`` scheme: a fresh, empty in-process store."""
    return MemoryStore(url, settings=settings)
