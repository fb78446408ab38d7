"""The event log on every store backend: seqs, races, corruption, follow, snapshots."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from stead.core.errors import CodecError, LogConflict, LogCorrupt, StoreUnavailable, WriteTooLarge
from stead.core.events import JobFailed, JobSubmitted, Record, StepProgress, decode_record
from stead.core.events.log import BadRecord, EventLog, Snapshot
from stead.core.store import MIN_MAX_WRITE_BYTES, StateStore

if TYPE_CHECKING:
    from conftest import KillBetweenChunks

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
    past, done = anyio.Event(), anyio.Event()

    async def follow() -> None:
        async for item in log.follow(1):
            assert isinstance(item, Record)
            seen.append(item.seq)
            past.set()
            if len(seen) == 3:
                done.set()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        with anyio.fail_after(10):
            await past.wait()  # the past record came: the log was read, what is appended now is new
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


# -- sizes: no write over what the store takes -----------------------------------------------------------------

LIMIT = MIN_MAX_WRITE_BYTES  # what the small_store fixture takes in one write


def _state(nodes: int) -> dict[str, Any]:
    """A snapshot body about the size of a job's with ``nodes`` nodes (about 190 bytes each)."""
    return {"state": {"nodes": {f"node-{i}": {"node_id": f"node-{i}", "incarnation": 1, "phase": "joined",
                                              "host": f"host-{i}.example", "pid": 1000 + i, "exit_code": None,
                                              "signal": None, "resources": [], "pending": ""}
                                for i in range(nodes)}}}


async def test_a_snapshot_larger_than_one_store_write_round_trips_in_chunks(small_store: StateStore) -> None:
    log = EventLog(small_store, _job())
    await log.append_many([StepProgress(round=1, step=i) for i in range(4)])
    body = _state(1500)
    await log.save_snapshot(3, body)
    assert len(json.dumps(body)) > 4 * LIMIT
    snapshot = await EventLog(small_store, log.job).load_snapshot()
    assert snapshot == Snapshot(seq=3, body=body)
    assert await EventLog(small_store, log.job).head() == 4
    await log.save_snapshot(4, {"state": {"x": 1}})  # smaller again: one key, as before
    assert await EventLog(small_store, log.job).load_snapshot() == Snapshot(seq=4, body={"state": {"x": 1}})


async def test_a_snapshot_writer_killed_between_chunks_leaves_the_previous_snapshot_loaded(
        small_store: StateStore, kill_between_chunks: KillBetweenChunks) -> None:
    job = _job()
    await EventLog(small_store, job).save_snapshot(10, _state(600))
    await kill_between_chunks(small_store, lambda store: EventLog(store, job).save_snapshot(20, _state(1500)), 2)
    assert await EventLog(small_store, job).load_snapshot() == Snapshot(seq=10, body=_state(600))
    await EventLog(small_store, job).save_snapshot(30, _state(900))  # the next master's
    assert await EventLog(small_store, job).load_snapshot() == Snapshot(seq=30, body=_state(900))


async def test_a_single_key_snapshot_of_an_older_stead_still_loads(store: StateStore) -> None:
    log = EventLog(store, _job())
    await store.put(log.snapshot_key, b'{"seq":7,"body":{"state":{"phase":"running"}}}')
    assert await log.load_snapshot() == Snapshot(seq=7, body={"state": {"phase": "running"}})


async def test_an_event_larger_than_one_store_write_is_refused_naming_its_kind_its_size_and_the_limit(
        small_store: StateStore) -> None:
    log = EventLog(small_store, _job())
    huge = JobFailed(reason="crashed", message="m" * LIMIT)
    with pytest.raises(WriteTooLarge, match=rf"event job\.failed of job '{log.job}' is \d+ bytes encoded, more than "
                                            rf"one write to .* takes \({LIMIT} bytes, store_max_write_bytes\)"):
        await log.append(huge)
    assert await log.head() == 0
    await log.append(JobFailed(reason="crashed", message="m" * (LIMIT // 2)))  # half of it fits
    assert [r.seq for r in await log.read()] == [1]


async def test_events_that_fit_one_by_one_but_not_together_are_not_appended_in_part(small_store: StateStore) -> None:
    log = EventLog(small_store, _job())
    events = [JobFailed(reason="crashed", message=f"{i}" * (LIMIT // 3)) for i in range(4)]
    assert sum(log.cost(log.encode(e)) for e in events) > log.append_budget
    with pytest.raises(WriteTooLarge, match="create_all of 4 keys"):
        await log.append_many(events)
    assert await log.read() == []


class _AnswerLost:
    """The store of a test whose next ``create_all`` is applied but reported failed (etcd applied the write, then
    its answer timed out); ``gets_lost`` of the gets that follow fail the same way."""

    def __init__(self, store: StateStore, *, gets_lost: int = 0) -> None:
        self._store = store
        self.writes_lost = 1
        self.gets_lost = gets_lost

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def create_all(self, items: Any) -> bool:
        created = await self._store.create_all(items)
        if self.writes_lost:
            self.writes_lost -= 1
            raise StoreUnavailable("etcd did not answer within store_timeout_s")
        return created

    async def get(self, key: str) -> Any:
        if self.gets_lost:
            self.gets_lost -= 1
            raise StoreUnavailable("etcd did not answer within store_timeout_s")
        return await self._store.get(key)


async def test_an_append_applied_by_the_store_whose_answer_was_lost_is_taken_as_written(store: StateStore) -> None:
    job = _job()
    log = EventLog(_AnswerLost(store), job)  # type: ignore[arg-type]
    (first,) = await log.append_many([StepProgress(round=1, step=1)])
    (second,) = await log.append_many([StepProgress(round=1, step=2)])  # not a conflict with its own first write
    assert (first.seq, second.seq) == (1, 2)
    assert [r.seq for r in await EventLog(store, job).read()] == [1, 2]


async def test_an_append_whose_fate_cannot_be_learned_stops_its_writer_before_the_next_if_it_landed(
        store: StateStore) -> None:
    job = _job()
    lossy = _AnswerLost(store)
    log = EventLog(lossy, job)  # type: ignore[arg-type]
    await log.head()  # (it reads the snapshot with a get)
    lossy.gets_lost = 1
    with pytest.raises(StoreUnavailable):
        await log.append_many([StepProgress(round=1, step=1)])  # reported failed, though it landed
    with pytest.raises(LogConflict, match=r"reached the store .* after its write was reported failed.*replays"):
        await log.append_many([StepProgress(round=1, step=2)])
    assert [r.seq for r in await EventLog(store, job).read()] == [1]


async def test_an_append_that_did_not_land_is_retried_at_the_same_seq(store: StateStore) -> None:
    job = _job()

    class _Refused(_AnswerLost):
        async def create_all(self, items: Any) -> bool:
            if self.writes_lost:
                self.writes_lost -= 1
                raise StoreUnavailable("etcd is unavailable")
            return await self._store.create_all(items)

    refused = _Refused(store)
    log = EventLog(refused, job)  # type: ignore[arg-type]
    await log.head()
    refused.gets_lost = 1
    with pytest.raises(StoreUnavailable):
        await log.append_many([StepProgress(round=1, step=1)])
    (record,) = await log.append_many([StepProgress(round=1, step=1)])
    assert record.seq == 1
    assert [r.seq for r in await EventLog(store, job).read()] == [1]
