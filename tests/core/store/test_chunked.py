"""ChunkedValue on every backend: values past one write round-trip, and no reader ever gets a torn one."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import pytest

from stead.core.config import Settings
from stead.core.errors import CodecError
from stead.core.store import MIN_MAX_WRITE_BYTES, KeyValue, StateStore, open_store
from stead.core.store.chunked import ChunkedValue

if TYPE_CHECKING:
    from conftest import Backend, KillBetweenChunks

pytestmark = pytest.mark.anyio

LIMIT = MIN_MAX_WRITE_BYTES


@pytest.fixture
async def small(backend: Backend, settings: Settings) -> AsyncIterator[StateStore]:
    """The backend's store as one that takes at most LIMIT bytes a write (as etcd takes 1.5 MiB)."""
    store = await open_store(backend.url, settings=dataclasses.replace(backend.settings, store_max_write_bytes=LIMIT))
    try:
        yield store
    finally:
        await store.close()


def _value(chunks: float) -> bytes:
    return os.urandom(int(chunks * LIMIT))


async def _chunk_keys(store: StateStore, key: str) -> list[str]:
    return [kv.key for kv in await store.range(f"{key}/chunks/")]


async def test_a_value_larger_than_one_write_round_trips_and_its_key_holds_only_a_head(
        small: StateStore, backend: Backend) -> None:
    key = backend.key("big")
    value = _value(4.5)
    await ChunkedValue(small, key).put(value)
    assert await ChunkedValue(small, key).get() == value  # another reader: nothing kept in the writer's memory
    head = await small.get(key)
    assert head is not None and len(head.value) < 1024
    assert len(await _chunk_keys(small, key)) == 5


async def test_a_value_that_fits_is_stored_as_it_is_and_the_chunks_of_a_larger_one_go(
        small: StateStore, backend: Backend) -> None:
    key = backend.key("shrinks")
    chunked = ChunkedValue(small, key)
    await chunked.put(_value(2.5))
    await chunked.put(b'{"small":true}')
    assert (await small.get(key)).value == b'{"small":true}'  # type: ignore[union-attr]
    assert await _chunk_keys(small, key) == []
    grown = _value(3.5)
    await chunked.put(grown)
    assert await chunked.get() == grown


async def test_a_value_written_by_a_plain_put_reads_back_and_is_replaced(small: StateStore, backend: Backend) -> None:
    """What an older stead wrote (one key) still loads; a new writer replaces it with a chunked value."""
    key = backend.key("old")
    await small.put(key, b'{"seq":3,"body":{}}')
    assert await ChunkedValue(small, key).get() == b'{"seq":3,"body":{}}'
    value = _value(1.5)
    await ChunkedValue(small, key).put(value)
    assert await ChunkedValue(small, key).get() == value
    assert await ChunkedValue(small, backend.key("absent")).get() is None


async def test_a_value_that_looks_like_a_head_is_stored_in_chunks_and_reads_back_as_written(
        small: StateStore, backend: Backend) -> None:
    key = backend.key("lookalike")
    await ChunkedValue(small, key).put(b"stead-chunked:not a head")
    assert await ChunkedValue(small, key).get() == b"stead-chunked:not a head"


async def test_a_writer_killed_between_chunks_leaves_the_previous_value_and_the_next_writer_clears_its_chunks(
        small: StateStore, backend: Backend, kill_between_chunks: KillBetweenChunks) -> None:
    key = backend.key("torn")
    before = _value(1.5)  # two chunks
    await ChunkedValue(small, key).put(before)
    newer = _value(4.5)
    await kill_between_chunks(small, lambda store: ChunkedValue(store, key).put(newer), 3)  # 3 of 5 chunks written
    assert await ChunkedValue(small, key).get() == before
    after = _value(1.5)
    await ChunkedValue(small, key).put(after)  # a new master: it knows nothing of what the dead one left
    assert await ChunkedValue(small, key).get() == after
    assert len(await _chunk_keys(small, key)) == 2  # the dead writer's three chunks went with the old two


async def test_a_writer_killed_before_a_first_chunked_value_leaves_the_plain_one(
        small: StateStore, backend: Backend, kill_between_chunks: KillBetweenChunks) -> None:
    key = backend.key("first")
    await small.put(key, b"plain")
    newer = _value(2.5)
    await kill_between_chunks(small, lambda store: ChunkedValue(store, key).put(newer), 1)
    assert await ChunkedValue(small, key).get() == b"plain"
    value = _value(1.5)
    await ChunkedValue(small, key).put(value)
    assert await ChunkedValue(small, key).get() == value
    assert len(await _chunk_keys(small, key)) == 2


class _WritesBeforeChunksAreRead:
    """A reader's store: before it reads the chunks, ``meanwhile`` runs (a writer replacing the value)."""

    def __init__(self, store: StateStore, meanwhile: Callable[[], Awaitable[None]]) -> None:
        self.store, self.meanwhile = store, meanwhile

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def range(self, prefix: str, **kw: object) -> list[KeyValue]:
        if "/chunks/" in prefix:
            meanwhile, self.meanwhile = self.meanwhile, _nothing
            await meanwhile()
        return await self.store.range(prefix, **kw)  # type: ignore[arg-type]


async def _nothing() -> None:
    return None


@pytest.mark.parametrize("writes", [1, 2], ids=["chunks-deleted-under-it", "chunks-replaced-under-it"])
async def test_a_reader_that_races_a_writer_gets_a_whole_value_never_a_torn_one(
        small: StateStore, backend: Backend, writes: int) -> None:
    key = backend.key(f"raced-{writes}")
    writer = ChunkedValue(small, key)
    await writer.put(_value(2.5))
    newer = [_value(1.5 + i) for i in range(writes)]

    async def replace() -> None:
        for value in newer:  # the first goes to the other slot; the second back to the slot the reader wants
            await writer.put(value)

    reader = ChunkedValue(_WritesBeforeChunksAreRead(small, replace), key)  # type: ignore[arg-type]
    assert await reader.get() == newer[-1]


async def test_chunks_lost_or_changed_for_good_are_reported_with_the_key_to_delete(
        small: StateStore, backend: Backend) -> None:
    key = backend.key("lost")
    await ChunkedValue(small, key).put(_value(2.5))
    first, second, _ = await _chunk_keys(small, key)
    await small.put(first, os.urandom(len((await small.get(first)).value)))  # type: ignore[union-attr]
    with pytest.raises(CodecError, match=f"{key} names 3 chunks .* do not match its SHA-256.*delete {key}"):
        await ChunkedValue(small, key).get()
    await small.delete(second)
    with pytest.raises(CodecError, match=f"{key} names 3 chunks .* but 2 chunks are there.*delete {key}"):
        await ChunkedValue(small, key).get()
