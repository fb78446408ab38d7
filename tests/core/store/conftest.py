"""Fixtures of the store contract suite: every test runs against memory, sqlite, a real etcd, and a real etcd that
takes only TLS clients with a client certificate and a login (``etcd-secured``)."""

from __future__ import annotations

import dataclasses
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from stead.core.config import Settings
from stead.core.store import StateStore, open_store
from stead.testing.etcd import EtcdServer

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
    #: what a client of this backend opens it with (the secured etcd's certificates and login)
    settings: Settings = SETTINGS

    def key(self, name: str) -> str:
        return self.ns + name


@pytest.fixture
def settings() -> Settings:
    return SETTINGS


@pytest.fixture
def etcd(request: pytest.FixtureRequest) -> str:
    """The URL of the session's etcd (``etcd_url`` of tests/core/conftest.py; tests use fresh key prefixes).

    Started only when an etcd test asks for it; without the binary the test is
    skipped, or fails when CI is set.
    """
    url: str = request.getfixturevalue("etcd_url")
    return url


@pytest.fixture
def sqlite_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="stead-store-") as tmp:
        yield Path(tmp)


@pytest.fixture(params=["memory", "sqlite", "etcd", "etcd-secured"])
async def backend(request: pytest.FixtureRequest, sqlite_dir: Path) -> AsyncIterator[Backend]:
    name: str = request.param
    settings = SETTINGS
    if name == "memory":
        url, ttl = "memory://", 0.3
    elif name == "sqlite":
        url, ttl = f"sqlite:///{sqlite_dir}/state.db", 0.3
    elif name == "etcd":
        url, ttl = request.getfixturevalue("etcd"), 1.0
    else:
        server: EtcdServer = request.getfixturevalue("secure_etcd")
        url, ttl = server.url, 1.0
        settings = Settings.from_mapping(server.client_settings(), base=SETTINGS)
    store = await open_store(url, settings=settings)
    others: list[StateStore] = []

    async def open_another() -> StateStore:
        if name == "memory":  # an in-process store has no second client: share the instance
            return store
        other = await open_store(url, settings=settings)
        others.append(other)
        return other

    try:
        yield Backend(name=name, url=url, store=store, ns=f"/t-{uuid.uuid4().hex[:12]}/",
                      open_another=open_another, short_ttl_s=ttl, settings=settings)
    finally:
        for other in others:
            await other.close()
        await store.close()


@pytest.fixture
def store(backend: Backend) -> StateStore:
    return backend.store
