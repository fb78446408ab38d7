"""Fixtures of the store contract suite: every test runs against memory, sqlite and a real etcd."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from store_backends import SETTINGS, Backend

from stead.core.store import StateStore, open_store
from stead.testing.etcd import EtcdServer, etcd_binary


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer | None]:
    """One etcd for the whole session (tests use fresh key prefixes); None when the binary is missing."""
    if shutil.which("etcd") is None:
        yield None
        return
    with EtcdServer() as server:
        yield server


@pytest.fixture
def sqlite_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="stead-store-") as tmp:
        yield Path(tmp)


@pytest.fixture(params=["memory", "sqlite", "etcd"])
async def backend(request: pytest.FixtureRequest, etcd_server: EtcdServer | None,
                  sqlite_dir: Path) -> AsyncIterator[Backend]:
    name: str = request.param
    if name == "memory":
        url, ttl = "memory://", 0.3
    elif name == "sqlite":
        url, ttl = f"sqlite:///{sqlite_dir}/state.db", 0.3
    else:
        if etcd_server is None:
            etcd_binary()  # skips, or fails when CI is set
            raise AssertionError("unreachable")
        url, ttl = etcd_server.url, 1.0
    store = await open_store(url, settings=SETTINGS)
    others: list[StateStore] = []

    async def open_another() -> StateStore:
        if name == "memory":  # an in-process store has no second client: share the instance
            return store
        other = await open_store(url, settings=SETTINGS)
        others.append(other)
        return other

    try:
        yield Backend(name=name, url=url, store=store, ns=f"/t-{uuid.uuid4().hex[:12]}/",
                      open_another=open_another, short_ttl_s=ttl)
    finally:
        for other in others:
            await other.close()
        await store.close()


@pytest.fixture
def store(backend: Backend) -> StateStore:
    return backend.store
