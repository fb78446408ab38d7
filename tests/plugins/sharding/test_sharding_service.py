"""The master-side service on real stores: durable leases, group commit, waiting, failures, events."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import structlog

from stead.core.config import Settings
from stead.core.errors import InvalidRequest
from stead.core.events import Event, NodeExited, NodeLost, NumericsNote, NumericsReported, Record, StepSamples
from stead.core.plugins import PluginContext
from stead.core.statemachine import JobPhase, JobState, NodePhase, NodeState
from stead.core.store import MIN_MAX_WRITE_BYTES, StateStore, open_store
from stead.plugins.sharding.events import LeasesReleased, SamplesSkipped, ShardRoundStarted
from stead.plugins.sharding.ledger import DatasetSpec, Range
from stead.plugins.sharding.plugin import ShardingPlugin
from stead.plugins.sharding.service import ShardService, StreamId
from stead.plugins.sharding.settings import ShardingSettings

pytestmark = pytest.mark.anyio

SPEC = DatasetSpec(name="ids", shard_size=5, size=100, seed=9, epochs=2)
PREFIX = "/stead/jobs/t/plugins/sharding/v1"


@pytest.fixture(params=["memory", "sqlite", "etcd"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StateStore]:
    if request.param == "etcd":
        url = request.getfixturevalue("etcd_url")
    else:
        url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'state.db'}"
    s = await open_store(url)
    await s.delete_prefix(PREFIX)  # the etcd server is shared by the session
    try:
        yield s
    finally:
        await s.delete_prefix(PREFIX)
        await s.close()


def _who(rank: int, round_: int = 1, world: int = 2) -> StreamId:
    return StreamId("ids", round_, rank, world, f"node-{rank}", f"nonce-{round_}-{rank}")


def _service(store: StateStore, **settings: float) -> ShardService:
    return ShardService(store, prefix=PREFIX, settings=ShardingSettings(snapshot_every=3, **settings))  # type: ignore[arg-type]


def _slots(ranges: tuple[Range, ...] | list[Range]) -> list[tuple[int, int]]:
    return [(p, i) for p, s, e in ranges for i in range(s, e)]


async def test_a_restarted_master_on_the_same_store_loses_no_lease_mid_epoch(store: StateStore) -> None:
    first = _service(store)
    await first.register(SPEC)
    await asyncio.gather(first.lease(_who(0), epoch=0, have=0, count=1, consumed=0, wait_s=5),
                         first.lease(_who(1), epoch=0, have=0, count=1, consumed=0, wait_s=5))
    held: dict[int, list[Range]] = {0: [], 1: []}
    for step in range(7):  # 7 records with snapshot_every=3: snapshots, deleted segments and a journal tail
        for rank in (0, 1):
            answer = await first.lease(_who(rank), epoch=0, have=len(held[rank]), count=1, consumed=0)
            held[rank] += answer.ranges
        if step == 3:
            cursor = await first.save(_who(0), consumed=[7, 3], epochs=[0, 0])
    again = _service(store)  # the first master is gone; a new one reads the store
    for rank in (0, 1):  # a worker whose reply was lost asks again: the same ranges, nothing new
        replay = await again.lease(_who(rank), epoch=0, have=len(held[rank]) - 1, count=1, consumed=0)
        assert replay.ranges == (held[rank][-1],)
    rest: list[Range] = []
    while not (answer := await again.lease(_who(0), epoch=0, have=len(held[0]) + len(rest), count=3,
                                           consumed=0)).exhausted:
        rest += answer.ranges
    assert sorted(_slots(held[0] + held[1] + rest)) == [(0, i) for i in range(100)]
    assert await again.save(_who(1), consumed=[7, 3], epochs=[0, 0]) == cursor
    assert await store.get(f"{PREFIX}/datasets/ids/snapshot") is not None  # replayed from snapshot + journal


class _CommitsThenCancelled:
    """A store whose next journal write reaches the store, but whose caller is cancelled before the answer."""

    def __init__(self, store: StateStore) -> None:
        self.store, self.armed = store, True

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def compare_and_put(self, key: str, value: bytes, **kw: int) -> bool:
        won = await self.store.compare_and_put(key, value, **kw)
        if self.armed and "/journal/" in key:
            self.armed = False
            raise asyncio.CancelledError
        return won


async def test_a_journal_write_whose_caller_was_cancelled_is_recognised_not_blamed_on_another_master(
        store: StateStore) -> None:
    flaky = _CommitsThenCancelled(store)
    service = _service(flaky)  # type: ignore[arg-type]
    await service.register(SPEC)
    with pytest.raises(asyncio.CancelledError):
        await service.lease(_who(0, world=1), epoch=0, have=0, count=1, consumed=0)
    first = await service.lease(_who(0, world=1), epoch=0, have=0, count=1, consumed=0)  # asks again: same answer
    second = await service.lease(_who(0, world=1), epoch=0, have=1, count=1, consumed=0)
    again = _service(store)  # and a restarted master reads one consistent journal
    replay = await again.lease(_who(0, world=1), epoch=0, have=1, count=1, consumed=0)
    assert replay.ranges == second.ranges and first.ranges != second.ranges


async def test_concurrent_leases_share_store_writes_and_never_overlap(store: StateStore) -> None:
    service = _service(store)
    await service.register(SPEC)
    world = 8
    answers = await asyncio.gather(*(service.lease(_who(r, world=world), epoch=0, have=0, count=2, consumed=0,
                                                   wait_s=5) for r in range(world)))
    slots = [s for a in answers for s in _slots(a.ranges)]
    assert len(slots) == len(set(slots)) == world * 2 * 5
    records = await store.range(f"{PREFIX}/datasets/ids/journal/")
    snapshot = await store.get(f"{PREFIX}/datasets/ids/snapshot")
    assert len(records) + (snapshot is not None) * 3 < world * 2  # fewer writes than calls: group commit


async def test_a_world_whose_leases_outgrow_one_store_write_is_journaled_and_snapshotted_in_several(
        store: StateStore) -> None:
    """1,500 ranks leasing at once on a store that takes 64 KiB a write (as etcd takes 1.5 MiB): their ops go in
    several journal records, the ledger (about 90 KiB) in chunks, and a restarted master replays both."""
    small = await open_store(store.url, settings=Settings(store_max_write_bytes=MIN_MAX_WRITE_BYTES))

    def service(snapshot_every: int) -> ShardService:
        return ShardService(small, prefix=PREFIX, settings=ShardingSettings(snapshot_every=snapshot_every))

    def who(rank: int) -> StreamId:
        return _who(rank, world=world)

    try:
        first, world = service(1000), 1500
        await first.register(dataclasses.replace(SPEC, shard_size=1, size=4 * world, epochs=1))
        answers = await asyncio.gather(*(first.lease(who(r), epoch=0, have=0, count=2, consumed=0, wait_s=30)
                                         for r in range(world)))
        records = await small.range(f"{PREFIX}/datasets/ids/journal/")
        second = service(1)  # from the journal; its next record snapshots the ledger
        assert [(await second.lease(who(r), epoch=0, have=0, count=2, consumed=0)).ranges
                for r in range(world)] == [a.ranges for a in answers]
        more = await second.lease(who(0), epoch=0, have=1, count=1, consumed=0)
        chunks = await small.range(f"{PREFIX}/datasets/ids/snapshot/chunks/")
        third = service(1000)  # from the chunked snapshot
        assert (await third.lease(who(0), epoch=0, have=1, count=1, consumed=0)).ranges == more.ranges
    finally:
        await small.close()
    assert len(records) > 1 and len(chunks) > 1
    assert len({s for a in answers for s in _slots(a.ranges)}) == 2 * world


async def test_a_lease_waits_for_the_other_ranks_and_wakes_when_they_come(store: StateStore) -> None:
    service = _service(store)
    await service.register(SPEC)
    early = await service.lease(_who(0), epoch=0, have=0, count=1, consumed=0, wait_s=0)
    assert early.waiting_for == (1,) and not early.ranges
    waiting = asyncio.ensure_future(service.lease(_who(0), epoch=0, have=0, count=1, consumed=0, wait_s=30))
    await anyio.wait_all_tasks_blocked()  # the lease waits
    assert not waiting.done()
    late = await service.lease(_who(1), epoch=0, have=0, count=1, consumed=0)
    assert (await waiting).ranges and late.ranges and (await waiting).ranges != late.ranges


async def test_failed_workers_and_silent_workers_leases_return_to_the_queue_with_an_event(store: StateStore) -> None:
    events: list[Event] = []

    async def emit(event: Event) -> Record | None:
        events.append(event)
        return None

    now = [0.0]
    service = ShardService(store, prefix=PREFIX, settings=ShardingSettings(lease_timeout_s=10), emit=emit,
                           clock=lambda: now[0])
    await service.register(SPEC)
    world = 3
    first = await asyncio.gather(*(service.lease(_who(r, world=world), epoch=0, have=0, count=1, consumed=0,
                                                 wait_s=5) for r in range(world)))
    await service.report(_who(1, world=world), consumed=2, epoch=0)
    await service.failed(node_id="node-1", reason="node node-1 lost")
    released = [e for e in events if isinstance(e, LeasesReleased)]
    assert [(e.rank, e.samples) for e in released] == [(1, 3)]
    assert any(isinstance(e, ShardRoundStarted) and e.remaining == 200 for e in events)
    now[0] = 9.0
    await service.report(_who(0, world=world), consumed=0, epoch=0)
    now[0] = 12.0  # rank 2 silent for 12 s > 10 s; rank 0 reported at 9 s
    answer = await service.lease(_who(0, world=world), epoch=0, have=1, count=3, consumed=5)
    given_back = set(_slots(first[1].ranges)[2:] + _slots(first[2].ranges))  # rank 1 read 2 of its 5
    assert given_back < set(_slots(answer.ranges)) and len(_slots(answer.ranges)) == 3 + 5 + 5
    with pytest.raises(InvalidRequest, match=r"lost its leases of dataset 'ids' \(no report for 10 s"):
        await service.lease(_who(2, world=world), epoch=0, have=1, count=1, consumed=0)


async def test_requests_for_unknown_datasets_and_bad_names_are_refused(store: StateStore) -> None:
    service = _service(store)
    with pytest.raises(InvalidRequest, match="dataset 'nope' is not registered; create the sampler"):
        await service.lease(StreamId("nope", 1, 0, 1, "n", "x"), epoch=0, have=0, count=1, consumed=0)
    with pytest.raises(InvalidRequest, match="dataset name 'a/b' is not a valid name"):
        await service.register(DatasetSpec(name="a/b", shard_size=1, size=1))
    with pytest.raises(InvalidRequest, match="shard_size=0 must be at least 1"):
        await service.register(DatasetSpec(name="z", shard_size=0, size=1))
    assert await store.range(PREFIX) == []


async def test_the_plugin_returns_the_leases_of_lost_and_exited_nodes_but_not_after_the_job_ended() -> None:
    store = await open_store("memory://")
    handlers: list[object] = []
    phase = [JobPhase.RUNNING]
    # node-0 was relaunched: its second incarnation reads for rank 0 in this round
    nodes = {"node-0": NodeState(node_id="node-0", incarnation=2, phase=NodePhase.JOINED)}
    ctx = PluginContext(plugin="sharding", job="t", settings=ShardingSettings(), stead_settings=Settings(),
                        store=store, state=lambda: JobState(phase=phase[0], nodes=nodes), emit=_no_emit,
                        add_rpc_handler=handlers.append)
    plugin = ShardingPlugin(settings=ShardingSettings())
    await plugin.start(ctx=ctx)
    assert len(handlers) == 1 and plugin.service is not None
    service = plugin.service
    await service.register(SPEC)
    world = 4
    answers = await asyncio.gather(*(service.lease(_who(r, world=world), epoch=0, have=0, count=1, consumed=0,
                                                   wait_s=5) for r in range(world)))
    ledger = service._datasets["ids"].ledger
    # the first incarnation of node-0 ending late (a partitioned host's agent hanging up once the link healed)
    # leaves its successor's stream alone
    events = [NodeLost(node_id="node-1", incarnation=1), NodeExited(node_id="node-2", incarnation=1, signal=9),
              NodeExited(node_id="node-0", incarnation=1), NodeLost(node_id="node-0", incarnation=1)]
    for seq, event in enumerate(events, start=1):
        await plugin.handle(record=Record(seq=seq, at=0.0, event=event), ctx=ctx)
    assert ledger.gen is not None and [r for r, s in ledger.gen.streams.items() if s.dead] == [1, 2]
    back = set(_slots(answers[1].ranges + answers[2].ranges))
    assert back <= {(p, i) for p, s, e in ledger.remaining.ranges() for i in range(s, e)}
    phase[0] = JobPhase.SUCCEEDED  # a finished job's nodes exit: nothing to give back
    await plugin.handle(record=Record(seq=5, at=0.0, event=NodeExited(node_id="node-3", incarnation=1)), ctx=ctx)
    assert not ledger.gen.streams[3].dead
    await store.close()


async def test_the_plugin_records_the_samples_of_the_ranks_skipped_steps_and_logs_a_note_it_refuses() -> None:
    store = await open_store("memory://")
    emitted: list[Event] = []

    async def emit(event: Event) -> Record:
        emitted.append(event)
        return Record(seq=0, at=0.0, event=event)

    ctx = PluginContext(plugin="sharding", job="t", settings=ShardingSettings(), stead_settings=Settings(),
                        store=store, state=lambda: JobState(phase=JobPhase.RUNNING), emit=emit,
                        add_rpc_handler=lambda handler: None)
    plugin = ShardingPlugin(settings=ShardingSettings())
    await plugin.start(ctx=ctx)
    service = plugin.service
    assert service is not None
    await service.register(SPEC)
    await asyncio.gather(*(service.lease(_who(r), epoch=0, have=0, count=1, consumed=0, wait_s=5) for r in (0, 1)))
    notes = (NumericsNote(kind="step_skipped", rank=0, step=6, round=1, samples=(
                 StepSamples(dataset="ids", count=3, ranges=((0, 1, 4),)),)),
             NumericsNote(kind="step_skipped", rank=1, step=6, samples=(  # no round said: the report's
                 StepSamples(dataset="ids", count=2, ranges=((0, 50, 52),)),
                 StepSamples(dataset="other", count=2, ranges=((0, 0, 2),)))),  # a dataset never registered
             NumericsNote(kind="step_skipped", rank=2, step=6),  # no stead sampler: nothing to record
             NumericsNote(kind="step_skipped", rank=3, step=6, samples=(
                 StepSamples(dataset="ids", count=4, ranges=((0, 98, 102),)),)))  # past the dataset's 100 samples
    with structlog.testing.capture_logs() as logs:
        await plugin.handle(record=Record(seq=1, at=0.0, event=NumericsReported(node_id="node-0", round=1,
                                                                                notes=notes)), ctx=ctx)
    assert service._datasets["ids"].ledger.skipped.to_json() == [[0, 1, 4], [0, 50, 52]]
    assert [(e.rank, e.samples, e.skipped) for e in emitted if isinstance(e, SamplesSkipped)] == [(0, 3, 3), (1, 2, 5)]
    refused = [(entry["dataset"], entry["rank"]) for entry in logs if entry["event"] == "shard_skipped_refused"]
    assert refused == [("other", 1), ("ids", 3)]
    tally = await service.tally("ids")
    assert tally.skipped == 5 and tally.total == 200
    await store.close()


async def _no_emit(event: Event) -> Record:
    return Record(seq=0, at=0.0, event=event)
