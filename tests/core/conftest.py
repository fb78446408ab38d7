"""Stores for the core tests: one fixture over memory, sqlite and a real etcd server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stead.core.store import StateStore, open_store


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
