"""Stores for the core tests: one fixture over memory, sqlite and a real etcd server; a writer killed mid-value."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.core.store import MIN_MAX_WRITE_BYTES, StateStore, open_store

#: what ``small_store`` takes in one write: the least a store may be set to
SMALL_WRITE_BYTES = MIN_MAX_WRITE_BYTES

KillBetweenChunks = Callable[[StateStore, Callable[[StateStore], Awaitable[object]], int], Awaitable[None]]


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


@pytest.fixture
async def small_store(store_url: str) -> AsyncIterator[StateStore]:
    """The store of ``store_url`` as one that takes SMALL_WRITE_BYTES a write (as etcd takes 1.5 MiB), so that a
    test reaches the limit with small values."""
    s = await open_store(store_url, settings=Settings(store_max_write_bytes=SMALL_WRITE_BYTES))
    try:
        yield s
    finally:
        await s.close()


class _StopsAtChunk:
    """A writer's view of a store where it stops for good (killed) just before it writes chunk ``at`` of a value."""

    def __init__(self, store: StateStore, at: int) -> None:
        self.store, self.at = store, at
        self.stopped = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def put(self, key: str, value: bytes) -> int:
        if "/chunks/" in key and key.endswith(f"/{self.at:06d}"):
            self.stopped.set()
            await anyio.sleep_forever()
        return await self.store.put(key, value)


async def _kill_between_chunks(store: StateStore, write: Callable[[StateStore], Awaitable[object]], at: int) -> None:
    stopping = _StopsAtChunk(store, at)
    writing = asyncio.ensure_future(write(stopping))  # type: ignore[arg-type]
    with anyio.fail_after(10):
        await stopping.stopped.wait()
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing


@pytest.fixture
def kill_between_chunks() -> KillBetweenChunks:
    """``await kill(store, write, at)``: ``write(store)`` killed just before it writes chunk ``at`` of a chunked
    value (stead.core.store.chunked), as a master killed in the middle of a snapshot; what it wrote stays."""
    return _kill_between_chunks
