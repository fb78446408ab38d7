"""The event log on every store backend: seqs, races, corruption, follow, snapshots."""

from __future__ import annotations

import uuid

import anyio
import pytest

from stead.core.errors import CodecError, LogConflict, LogCorrupt
from stead.core.events import JobSubmitted, Record, StepProgress, decode_record
from stead.core.events.log import BadRecord, EventLog
from stead.core.store import StateStore

pytestmark = pytest.mark.anyio


def _job() -> str:
    return f"job-{uuid.uuid4().hex[:8]}"


async def test_appends_get_consecutive_seqs_and_read_back_in_order(store: StateStore) -> None:
    log = EventLog(store, _job())
    first = await log.append(JobSubmitted(job="j", min_nodes=1, max_nodes=1, nproc_per_node=1))
    batch = await log.append_many([StepProgress(round=1, step=i) for i in range(5)])
    assert first.seq == 1
    assert [r.seq for r in batch] == [2, 3, 4, 5, 6]
    records = await log.read()
    assert [r.seq for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[3].event == StepProgress(round=1, step=2)
    assert await EventLog(store, log.job).head() == 6


async def test_two_writers_racing_for_the_same_seq_only_one_wins(store: StateStore) -> None:
    job = _job()
    a, b = EventLog(store, job), EventLog(store, job)
    await a.head()
    await b.head()
    await a.append(StepProgress(round=1, step=1))
    with pytest.raises(LogConflict, match="only one master may run per job"):
        await b.append(StepProgress(round=1, step=99))
    assert [r.event for r in await a.read()] == [StepProgress(round=1, step=1)]


async def test_a_corrupt_record_is_reported_by_key_and_nothing_is_lost(store: StateStore) -> None:
    log = EventLog(store, _job())
    await log.append_many([StepProgress(round=1, step=i) for i in range(3)])
    await store.put(log.key(2), b"{not json")
    with pytest.raises(LogCorrupt, match=log.key(2)):
        await log.read()
    items = await log.scan()
    assert isinstance(items[1], BadRecord) and items[1].seq == 2
    assert isinstance(items[0], Record) and isinstance(items[2], Record)


async def test_a_gap_in_seq_is_reported(store: StateStore) -> None:
    log = EventLog(store, _job())
    await log.append_many([StepProgress(round=1, step=i) for i in range(3)])
    await store.delete(log.key(2))
    with pytest.raises(LogCorrupt, match="seq 2 missing"):
        await log.read()


async def test_a_record_stored_under_the_wrong_seq_is_reported(store: StateStore) -> None:
    log = EventLog(store, _job())
    await log.append_many([StepProgress(round=1, step=i) for i in range(2)])
    moved = await store.get(log.key(1))
    assert moved is not None
    await store.put(log.key(2), moved.value)  # a duplicate of seq 1 sitting at seq 2
    with pytest.raises(LogCorrupt, match="record says seq 1"):
        await log.read()


def test_unknown_event_types_name_the_record() -> None:
    raw = b'{"type":"nope.never","v":1,"seq":1,"at":0,"data":{}}'
    with pytest.raises(CodecError, match=r"/k/1.*unknown event type 'nope.never'"):
        decode_record(raw, where="/k/1")


async def test_follow_yields_past_then_new_records(store: StateStore) -> None:
    log = EventLog(store, _job())
    await log.append(StepProgress(round=1, step=0))
    seen: list[int] = []
    done = anyio.Event()

    async def follow() -> None:
        async for item in log.follow(1):
            assert isinstance(item, Record)
            seen.append(item.seq)
            if len(seen) == 3:
                done.set()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        await anyio.sleep(0.1)
        writer = EventLog(store, log.job)
        await writer.append(StepProgress(round=1, step=1))
        await writer.append(StepProgress(round=1, step=2))
        with anyio.fail_after(10):
            await done.wait()
    assert seen == [1, 2, 3]


async def test_snapshots_round_trip_and_bound_the_head_scan(store: StateStore) -> None:
    log = EventLog(store, _job())
    await log.append_many([StepProgress(round=1, step=i) for i in range(4)])
    await log.save_snapshot(3, {"state": {"x": 1}})
    snap = await log.load_snapshot()
    assert snap is not None and snap.seq == 3 and snap.body == {"state": {"x": 1}}
    assert await EventLog(store, log.job).head() == 4
    await store.put(log.snapshot_key, b"garbage")
    with pytest.raises(LogCorrupt, match="delete that key"):
        await log.load_snapshot()
