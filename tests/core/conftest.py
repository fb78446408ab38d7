"""Stores for the core tests: one fixture over memory, sqlite and a real etcd server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from stead.core.store import StateStore, open_store
from stead.testing import leaks
from stead.testing.etcd import EtcdServer


@pytest.fixture(scope="session")
def etcd_url() -> Iterator[str]:
    before = leaks.descendants()
    with EtcdServer() as server:
        owned = leaks.descendants() - before
        leaks.LONG_LIVED.update(owned)
        yield server.url
    leaks.LONG_LIVED.difference_update(owned)


@pytest.fixture(params=["memory", "sqlite", "etcd"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    url: str = request.getfixturevalue("etcd_url")
    return url


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[StateStore]:
    s = await open_store(store_url)
    try:
        yield s
    finally:
        await s.close()
