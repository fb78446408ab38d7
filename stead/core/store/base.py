"""The StateStore protocol every backend implements.

Keys are ``/``-separated strings; values are bytes. Every write gets a store-wide
monotonically increasing ``revision`` (etcd's meaning). One write takes at most
``max_write_bytes`` (etcd's request limit); ``stead.core.store.chunked`` keeps
larger values. ``compare_and_put`` and
``create_all`` report a lost race as ``False``, never as an exception. Client
failures surface as :class:`~stead.core.errors.StoreUnavailable` (retryable) or
:class:`~stead.core.errors.StoreError` (permanent).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

__all__ = ["KeyValue", "Lease", "StateStore", "WatchEvent", "WatchKind"]


@dataclasses.dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int | None = None


class WatchKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    kind: WatchKind
    key: str
    value: bytes
    revision: int


@runtime_checkable
class Lease(Protocol):
    """A granted lease, kept alive by its owner's task while the context is open."""

    @property
    def id(self) -> int: ...

    @property
    def ttl_s(self) -> float: ...


@runtime_checkable
class StateStore(Protocol):
    """Async key-value store with revisions, CAS, prefix range/watch and leases."""

    @property
    def url(self) -> str: ...

    @property
    def max_write_bytes(self) -> int:
        """The most one write may take (see ``_common.write_size``): one value, or a transaction's keys and values
        together. A larger write raises :class:`~stead.core.errors.WriteTooLarge` and writes nothing."""

    async def get(self, key: str) -> KeyValue | None:
        """The key's value and revisions, or ``None`` when absent."""

    async def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        """Write ``key`` unconditionally; return the new revision."""

    async def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int, lease: Lease | None = None
    ) -> bool:
        """Write only if the key's mod revision equals ``expected_mod_revision``.

        ``expected_mod_revision=0`` means "only if the key does not exist".
        Returns ``False`` (and writes nothing) when the comparison fails.
        """

    async def create_all(self, items: Sequence[tuple[str, bytes]]) -> bool:
        """Atomically create every key, or none if any of them already exists."""

    async def put_all(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Write every key unconditionally, atomically, at one revision (at most MAX_TXN_ITEMS); return it."""

    async def delete(self, key: str) -> bool:
        """Delete ``key``; ``True`` if it existed."""

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; return how many were deleted."""

    async def range(self, prefix: str, *, start: str | None = None, limit: int | None = None) -> list[KeyValue]:
        """Keys under ``prefix`` in key order, from ``start`` (inclusive), at most ``limit``."""

    def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix`` from ``start_revision`` (inclusive) or from now on."""

    def lease(self, ttl_s: float) -> AbstractAsyncContextManager[Lease]:
        """Grant a lease kept alive until the context exits (then revoked).

        Keys put with the lease vanish when it expires or is revoked.
        """

    async def revision(self) -> int:
        """The store's current revision."""

    async def compact(self, revision: int) -> None:
        """Forget the change history before ``revision`` (watches cannot start earlier any more)."""

    async def close(self) -> None:
        """Release connections and threads; idempotent."""
