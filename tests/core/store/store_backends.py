"""What the store tests share: the backend under test and the settings they open stores with."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from stead.core.config import Settings
from stead.core.store import StateStore

#: short polling and reconnect intervals keep the suite fast; nothing asserts on durations
SETTINGS = Settings(sqlite_watch_poll_s=0.02, retry_initial_s=0.05, retry_max_s=0.2, store_timeout_s=5.0)


@dataclasses.dataclass
class Backend:
    """One backend under test: a store, a fresh key namespace and a way to open more clients on the same data."""

    name: str
    url: str
    store: StateStore
    ns: str
    open_another: Callable[[], Awaitable[StateStore]]
    #: a lease TTL the backend honours exactly (etcd rounds up to whole seconds)
    short_ttl_s: float

    def key(self, name: str) -> str:
        return self.ns + name
