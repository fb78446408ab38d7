"""The StateStore protocol and :func:`open_store`, which picks a backend by URL scheme.

Backends register in the entry-point group ``stead.stores`` (name = URL scheme,
value = ``async def open_store(url: str, settings: Settings) -> StateStore``);
the built-in ``memory``, ``sqlite`` and ``etcd`` are also found without their
entry points, e.g. when running from a source tree that was not installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import cast

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.store.base import KeyValue, Lease, StateStore, WatchEvent, WatchKind

__all__ = ["KeyValue", "Lease", "StateStore", "StoreFactory", "WatchEvent", "WatchKind", "known_schemes",
           "open_store"]

StoreFactory = Callable[[str, Settings], Awaitable[StateStore]]

ENTRY_POINT_GROUP = "stead.stores"
_BUILT_IN = {
    "memory": "stead.core.store.memory:open_store",
    "sqlite": "stead.core.store.sqlite:open_store",
    "etcd": "stead.core.store.etcd:open_store",
}
_EXAMPLES = "memory://, sqlite:///.stead/state.db, etcd://127.0.0.1:2379"


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_schemes() -> list[str]:
    """Every URL scheme a store can be opened with."""
    return sorted(set(_BUILT_IN) | set(_entry_points()))


def _factory(scheme: str) -> StoreFactory:
    entry_point = _entry_points().get(scheme)
    try:
        if entry_point is not None:
            loaded = entry_point.load()
        else:
            module_name, _, attr = _BUILT_IN[scheme].partition(":")
            loaded = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        where = entry_point.value if entry_point is not None else _BUILT_IN[scheme]
        raise ConfigError(f"the {scheme!r} store backend ({where}) failed to load: {exc}; "
                          "reinstall the package that provides it or pick another --store") from exc
    return cast(StoreFactory, loaded)


async def open_store(url: str, *, settings: Settings | None = None) -> StateStore:
    """Open the store that ``url`` names, e.g. ``sqlite:///.stead/state.db`` or ``etcd://127.0.0.1:2379``.

    Raises ConfigError for an unknown scheme or malformed URL, StoreUnavailable when
    the store cannot be reached (etcd is checked once on open).
    """
    scheme, sep, _ = url.partition("://")
    known = known_schemes()
    if not sep or scheme not in known:
        raise ConfigError(f"unknown store URL {url!r}; the scheme must be one of {', '.join(known)}, "
                          f"e.g. {_EXAMPLES}")
    return await _factory(scheme)(url, settings or Settings())
