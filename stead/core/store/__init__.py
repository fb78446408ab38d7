"""The StateStore protocol and :func:`open_store`, which picks a backend by URL scheme.

Backends register in the entry-point group ``stead.stores`` (name = URL scheme,
value = ``async def open_store(url: str, settings: Settings) -> StateStore``);
the built-in ``memory``, ``sqlite`` and ``etcd`` are also found without their
entry points, e.g. when running from a source tree that was not installed.
Every backend, a third party's included, keeps the same limits, so that code
tested on one runs on all: :data:`MAX_TXN_ITEMS` keys in one ``create_all``,
a ``store_max_write_bytes`` of at least :data:`MIN_MAX_WRITE_BYTES`, and at most
:data:`EMBEDDED_MAX_WRITE_BYTES` in one write to an embedded store.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import cast

from stead.core.config import Settings
from stead.core.entrypoints import installed, load_named
from stead.core.errors import ConfigError
from stead.core.store._common import (
    EMBEDDED_MAX_WRITE_BYTES,
    MAX_TXN_ITEMS,
    MIN_MAX_WRITE_BYTES,
    item_size,
    prefix_end,
    public_store_url,
    write_size,
)
from stead.core.store.base import KeyValue, Lease, StateStore, WatchEvent, WatchKind

__all__ = ["EMBEDDED_MAX_WRITE_BYTES", "MAX_TXN_ITEMS", "MIN_MAX_WRITE_BYTES", "KeyValue", "Lease", "StateStore",
           "StoreFactory", "WatchEvent", "WatchKind", "item_size", "known_schemes", "open_store", "prefix_end",
           "public_store_url", "write_size"]

StoreFactory = Callable[[str, Settings], Awaitable[StateStore]]

ENTRY_POINT_GROUP = "stead.stores"
_BUILT_IN = {
    "memory": "stead.core.store.memory:open_store",
    "sqlite": "stead.core.store.sqlite:open_store",
    "etcd": "stead.core.store.etcd:open_store",
}
_EXAMPLES = "memory://, sqlite:///.stead/state.db, etcd://127.0.0.1:2379 (etcd://USER@HOST:PORT?ca_file=... secured)"


def known_schemes() -> list[str]:
    """Every URL scheme a store can be opened with."""
    return list(installed(ENTRY_POINT_GROUP, _BUILT_IN))


async def open_store(url: str, *, settings: Settings | None = None) -> StateStore:
    """Open the store that ``url`` names, e.g. ``sqlite:///.stead/state.db`` or ``etcd://127.0.0.1:2379``.

    ``settings`` default to stead's settings from the environment (``STEAD_<NAME>``), so that a process
    given ``STEAD_ETCD_CA_FILE`` and the like opens a secured etcd without more ado. Raises ConfigError
    for an unknown scheme or malformed URL, StoreUnavailable when the store cannot be reached (etcd is
    checked once on open), StoreError when it refuses this client (etcd: a wrong password or certificate).
    """
    scheme, sep, _ = url.partition("://")
    known = known_schemes()
    if not sep or scheme not in known:
        raise ConfigError(f"unknown store URL {public_store_url(url)!r}; the scheme must be one of "
                          f"{', '.join(known)}, e.g. {_EXAMPLES}")
    _, factory, _ = load_named(ENTRY_POINT_GROUP, scheme, what="store backend", builtin=_BUILT_IN,
                               hint="pick another --store")
    return await cast(StoreFactory, factory)(url, settings or Settings.from_env())
