"""The reactor: persist, fold, act, tell; timers; snapshots; effects that fail, hang or were left running."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import pytest
import structlog.testing

from stead.core.config import Settings
from stead.core.errors import CodecError, EffectDeclined, StoreError, StoreUnavailable, WriteTooLarge
from stead.core.events import (
    EffectFailed,
    Event,
    JobFailed,
    JobSubmitted,
    LastCall,
    NodeJoined,
    NodeLost,
    PluginFailed,
    Record,
    RoundStarted,
    StepProgress,
    TransitionRejected,
)
from stead.core.events.log import EventLog
from stead.core.master.reactor import Reactor
from stead.core.serde import to_json
from stead.core.statemachine import Effect, JobPhase, JobState
from stead.core.store import MIN_MAX_WRITE_BYTES, KeyValue, StateStore, open_store, write_size
from stead.testing import FakeClock

pytestmark = pytest.mark.anyio


class _Nothing:
    async def run(self, effect: Effect) -> None:
        return None


@contextlib.asynccontextmanager
async def _one_joined(spec: JobSubmitted, clock: FakeClock | None = None) -> AsyncIterator[Reactor]:
    """A reactor on a memory store, on ``clock``'s time (a clock of its own by default), with ``spec`` submitted
    and node-0 joined."""
    store, clock = await open_store("memory://"), clock or FakeClock()
    try:
        async with Reactor(EventLog(store, "t", clock=clock.now), _Nothing(), settings=Settings(),
                           clock=clock) as reactor:
            await reactor.resume()
            await reactor.submit(spec)
            await reactor.submit(NodeJoined(node_id="node-0", incarnation=1))
            yield reactor
    finally:
        await store.close()


async def test_a_last_call_timer_armed_again_after_firing_starts_the_round() -> None:
    spec = JobSubmitted(job="t", min_nodes=2, max_nodes=3, nproc_per_node=1, last_call_timeout_s=30)
    clock = FakeClock()
    async with _one_joined(spec, clock) as reactor:
        await reactor.submit(NodeJoined(node_id="node-1", incarnation=1))  # MIN joined: last call armed
        await reactor.submit(NodeLost(node_id="node-1", incarnation=1))
        await clock.advance(29.9)
        assert LastCall(round=1) in reactor.state.timers  # not due yet
        await clock.advance(0.1)  # fires with one node: no round
        assert LastCall(round=1) not in reactor.state.timers and reactor.state.rdzv.round == 0
        await reactor.submit(NodeJoined(node_id="node-1", incarnation=2))  # MIN again: armed again
        await clock.advance(30)
        state = reactor.state
        records = await reactor.log.read()
    assert state.rdzv.round == 1 and state.rdzv.members == ("node-0", "node-1")
    assert sum(isinstance(r.event, RoundStarted) for r in records) == 1


async def test_an_emission_asked_for_twice_before_its_event_is_folded_is_made_once() -> None:
    """The last node's NodeJoined twice in one write (a registration retried while the first was queued): each
    asks for round 1 before its RoundStarted is folded. The master must start the round once, not die on the
    second emission's effect key (it did, at 1,000 simulated nodes)."""
    async with _one_joined(JobSubmitted(job="t", min_nodes=2, max_nodes=2, nproc_per_node=1)) as reactor:
        last = NodeJoined(node_id="node-1", incarnation=1)
        await reactor.submit_many([last, last])
        state = await reactor.wait_until(lambda s: s.rdzv.round == 1)
        await reactor.submit(StepProgress(round=1, step=1))  # the reactor still runs
        records = await reactor.log.read()
    assert state.phase is JobPhase.RUNNING
    assert sum(isinstance(r.event, RoundStarted) for r in records) == 1


async def test_a_round_refused_because_a_member_was_lost_meanwhile_is_planned_again() -> None:
    """The last join plans round 1; the member's loss, persisted in the same write, is folded before the round's
    start, which is refused. The round must be planned again when the node is back (found at 5,000 simulated
    nodes: the second plan reused the first one's key and was never made, and the job waited for ever)."""
    async with _one_joined(JobSubmitted(job="t", min_nodes=2, max_nodes=2, nproc_per_node=1)) as reactor:
        await reactor.submit_many([NodeJoined(node_id="node-1", incarnation=1),
                                   NodeLost(node_id="node-1", incarnation=1)])
        assert reactor.state.rdzv.round == 0
        await reactor.submit(NodeJoined(node_id="node-1", incarnation=2))  # relaunched, back
        state = await reactor.wait_until(lambda s: s.rdzv.round == 1, timeout_s=10)
        records = await reactor.log.read()
    assert state.rdzv.members == ("node-0", "node-1") and state.nodes["node-1"].incarnation == 2
    assert [r.event.type_name for r in records if isinstance(r.event, (RoundStarted, TransitionRejected))] == [
        "round.started", "transition.rejected", "round.started"]


async def test_snapshots_bound_the_replay_and_compact_the_store_history(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    settings = Settings(snapshot_every=10, store_history_keep=5)
    store = await open_store(url)
    async with Reactor(EventLog(store, "t"), _Nothing(), settings=settings) as reactor:
        await reactor.resume()
        await reactor.submit(JobSubmitted(job="t", min_nodes=1, max_nodes=1, nproc_per_node=1))
        for step in range(30):
            await reactor.submit(StepProgress(round=1, step=step))
        before = reactor.state
    with pytest.raises(StoreError, match="history before"):
        async for _ in store.watch("/stead/", start_revision=1):
            break
    snapshot = await EventLog(store, "t").load_snapshot()
    assert snapshot is not None and snapshot.seq >= 20
    async with Reactor(EventLog(store, "t"), _Nothing(), settings=settings) as again:
        assert await again.resume() == before
    await store.close()


async def test_an_illegal_event_is_recorded_as_rejected_and_changes_nothing() -> None:
    store = await open_store("memory://")
    async with Reactor(EventLog(store, "t"), _Nothing(), settings=Settings()) as reactor:
        await reactor.resume()
        await reactor.submit(JobSubmitted(job="t", min_nodes=1, max_nodes=1, nproc_per_node=1))
        before = reactor.state
        record = await reactor.submit(NodeJoined(node_id="node-7", incarnation=1))  # never requested
        records = await reactor.log.read()
        after = reactor.state
    await store.close()
    rejected = records[-1].event
    assert isinstance(rejected, TransitionRejected) and rejected.seq == record.seq
    assert "node-7 was never requested" in rejected.reason
    assert dataclasses.replace(after, seq=before.seq) == before


# -- the pipeline: persist, fold, act, tell --------------------------------------------------------------------


SPEC = JobSubmitted(job="t", min_nodes=1, max_nodes=1, nproc_per_node=1, max_node_relaunches=2)


class _Executor:
    """Records effects; fails the ones ``fail`` names (by kind), or hangs on ``hang``."""

    def __init__(self, fail: set[str] | None = None, hang: set[str] | None = None) -> None:
        self.ran: list[Effect] = []
        self.fail, self.hang = fail or set(), hang or set()

    async def run(self, effect: Effect) -> None:
        self.ran.append(effect)
        if effect.kind in self.hang:
            await anyio.sleep_forever()
        if effect.kind in self.fail:
            raise OSError(f"cannot {effect.kind}")


class _Sink:
    def __init__(self) -> None:
        self.seen: list[tuple[Record, JobState]] = []

    def deliver(self, record: Record, state: JobState) -> None:
        self.seen.append((record, state))


async def test_each_record_is_persisted_folded_acted_on_then_told_with_the_state_at_that_record() -> None:
    store = await open_store("memory://")
    executor, sink = _Executor(), _Sink()
    async with Reactor(EventLog(store, "t"), executor, settings=Settings(), plugins=sink) as reactor:
        await reactor.resume()
        await reactor.submit(SPEC)
        records = await reactor.log.read()
    await store.close()
    assert [r.event.type_name for r in records] == ["job.submitted", "node.requested"]
    assert [r.seq for r, _ in sink.seen] == [1, 2]
    assert [s.seq for _, s in sink.seen] == [1, 2]  # each told with the state right after its own record
    assert sink.seen[0][1].nodes == {} and "node-0" in sink.seen[1][1].nodes
    assert [e.id for e in executor.ran] == ["launch/node-0/1"]


async def test_a_cancelled_submitter_does_not_leave_its_event_persisted_but_unapplied() -> None:
    store = await open_store("memory://")
    async with Reactor(EventLog(store, "t"), _Executor(), settings=Settings()) as reactor:
        await reactor.resume()
        submit = asyncio.ensure_future(reactor.submit(SPEC))
        await asyncio.sleep(0)
        submit.cancel()  # natively, as grpclib cancels a handler whose client went away
        state = await reactor.wait_until(lambda s: "node-0" in s.nodes, timeout_s=10)
        records = await reactor.log.read()
    await store.close()
    assert state.phase is JobPhase.STARTING and len(records) == 2 and state.seq == 2


async def test_a_failing_effect_becomes_an_event_and_the_machine_relaunches_the_node() -> None:
    store = await open_store("memory://")
    executor = _Executor(fail={"launch-node"})
    async with Reactor(EventLog(store, "t"), executor, settings=Settings()) as reactor:
        await reactor.resume()
        await reactor.submit(SPEC)
        state = await reactor.wait_until(lambda s: s.phase.terminal, timeout_s=10)
        records = await reactor.log.read()
    await store.close()
    failed = [r.event for r in records if isinstance(r.event, EffectFailed)]
    assert [(f.kind, f.node_id, f.incarnation) for f in failed] == [("launch-node", "node-0", i) for i in (1, 2, 3)]
    assert "OSError: cannot launch-node" in failed[0].error
    assert [e.id for e in executor.ran if e.kind == "launch-node"] == ["launch/node-0/1", "launch/node-0/2",
                                                                        "launch/node-0/3"]
    assert state.phase is JobPhase.FAILED and "max_node_relaunches=2" in state.reason


async def _failed(reactor: Reactor) -> int:
    return sum(isinstance(r.event, EffectFailed) for r in await reactor.log.read())


async def test_an_effect_that_outlasts_its_timeout_fails_without_stopping_the_loop() -> None:
    store, clock = await open_store("memory://"), FakeClock()
    settings = Settings(effect_timeout_s=60)
    async with Reactor(EventLog(store, "t", clock=clock.now), _Executor(hang={"launch-node"}), settings=settings,
                       clock=clock) as reactor:
        await reactor.resume()
        submitted = asyncio.ensure_future(reactor.submit(SPEC))  # its launch hangs: answered once it failed
        for launched in range(3):  # the launch and both relaunches (max_node_relaunches=2) hang until their timeout
            await clock.advance(59)
            assert await _failed(reactor) == launched
            await clock.advance(1)
            assert await _failed(reactor) == launched + 1
        await submitted
        state = reactor.state
        records = await reactor.log.read()
    await store.close()
    failed = [r.event for r in records if isinstance(r.event, EffectFailed)]
    assert [f.incarnation for f in failed] == [1, 2, 3] and state.phase is JobPhase.FAILED
    assert "did not finish within effect_timeout_s=60 s" in failed[0].error


async def test_an_effect_a_dead_master_left_running_is_run_again_and_done_ones_are_not(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    store = await open_store(url)
    async with Reactor(EventLog(store, "t"), _Executor(), settings=Settings()) as first:
        await first.resume()
        await first.submit(SPEC)
    prefix = "/stead/jobs/t/effects/"
    assert (await store.get(prefix + "launch/node-0/1")).value == b"done"  # type: ignore[union-attr]
    await store.put(prefix + "launch/node-0/1", b"running")  # as if the master died while launching
    again = _Executor()
    async with Reactor(EventLog(store, "t"), again, settings=Settings()) as second:
        await second.resume()
    assert [e.id for e in again.ran] == ["launch/node-0/1"]
    rerun = _Executor()
    async with Reactor(EventLog(store, "t"), rerun, settings=Settings()) as third:
        await third.resume()
    await store.close()
    assert rerun.ran == []


class _NoPlatform(_Executor):
    """Like a master started by hand (`stead master`): it cannot launch nodes."""

    async def run(self, effect: Effect) -> None:
        await super().run(effect)
        if effect.kind == "launch-node":
            raise EffectDeclined("no platform launches nodes here")


async def test_a_launch_a_master_cannot_perform_stays_unclaimed_for_one_that_can(tmp_path: Path) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'r.db'}")
    by_hand = _NoPlatform()
    async with Reactor(EventLog(store, "t"), by_hand, settings=Settings()) as first:
        await first.resume()
        await first.submit(SPEC)
        records = await first.log.read()
    assert [e.id for e in by_hand.ran] == ["launch/node-0/1"]
    assert not any(isinstance(r.event, EffectFailed) for r in records)  # declined is not failed
    assert await store.get("/stead/jobs/t/effects/launch/node-0/1") is None
    with_platform = _Executor()
    async with Reactor(EventLog(store, "t"), with_platform, settings=Settings()) as second:
        await second.resume()
    assert [e.id for e in with_platform.ran] == ["launch/node-0/1"]
    assert (await store.get("/stead/jobs/t/effects/launch/node-0/1")).value == b"done"  # type: ignore[union-attr]
    await store.close()


async def test_an_event_that_cannot_be_stored_fails_its_submitter_only() -> None:
    store = await open_store("memory://")
    async with Reactor(EventLog(store, "t"), _Executor(), settings=Settings()) as reactor:
        await reactor.resume()
        bad = JobFailed(reason="x" * 10, message=object())  # type: ignore[arg-type]
        outcomes = await asyncio.gather(reactor.submit(SPEC), reactor.submit(bad),
                                        reactor.submit(StepProgress(round=1, step=3)), return_exceptions=True)
        state = reactor.state
    await store.close()
    assert isinstance(outcomes[1], CodecError)
    assert isinstance(outcomes[0], Record) and isinstance(outcomes[2], Record)
    assert state.step == 3 and state.phase is JobPhase.STARTING


class _AwayStore:
    """A memory store whose writes of new keys fail (the store is away) while ``away`` is set."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self.away = False
        self.refused = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def create_all(self, items: Sequence[tuple[str, bytes]]) -> bool:
        if self.away:
            self.refused += 1
            raise StoreUnavailable("etcd at etcd://127.0.0.1:1 is unavailable during create_all")
        return await self._store.create_all(items)


async def test_a_timer_that_fires_while_the_store_is_away_is_tried_again_with_backoff_then_recorded() -> None:
    store, clock = await open_store("memory://"), FakeClock()
    away = _AwayStore(store)
    settings = Settings(retry_initial_s=1, retry_max_s=8)
    spec = JobSubmitted(job="t", min_nodes=2, max_nodes=3, nproc_per_node=1, last_call_timeout_s=30)
    try:
        with structlog.testing.capture_logs() as logs:
            async with Reactor(EventLog(away, "t", clock=clock.now), _Nothing(),  # type: ignore[arg-type]
                               settings=settings, clock=clock) as reactor:
                await reactor.resume()
                await reactor.submit(spec)
                await reactor.submit(NodeJoined(node_id="node-0", incarnation=1))
                await reactor.submit(NodeJoined(node_id="node-1", incarnation=1))  # MIN joined: last call armed
                away.away = True
                await clock.advance(30)  # the last call fires: not recorded
                assert away.refused == 1
                while away.refused < 5:  # each pause of the fake clock's time, then tried again
                    await clock.advance(settings.retry_max_s)
                away.away = False
                await clock.advance(settings.retry_max_s)
                state = reactor.state
    finally:
        await store.close()
    pauses = [e["retry_in_s"] for e in logs if e["event"] == "timer_not_recorded"]
    assert pauses[3] > pauses[0], f"no backoff between attempts: {pauses}"  # doubling, jittered by at most half
    assert state.rdzv.round == 1 and state.rdzv.members == ("node-0", "node-1")


# -- sizes: every append fits in one store write -------------------------------------------------------------------

LIMIT = MIN_MAX_WRITE_BYTES  # what the small_store fixture takes in one write


class _Gate(_Executor):
    """Holds the reactor's loop in the first node launch until opened, so that submissions queue up meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.opened = asyncio.Event(), asyncio.Event()

    async def run(self, effect: Effect) -> None:
        await super().run(effect)
        self.entered.set()
        await self.opened.wait()


async def _queued_while_busy(reactor: Reactor, gate: _Gate, events: list[Event]) -> list[Record | BaseException]:
    """Submit ``events`` each on its own while the loop is held, so that they wait together; then let it go."""
    first = asyncio.ensure_future(reactor.submit(SPEC))
    with anyio.fail_after(10):
        await gate.entered.wait()
    waiting = asyncio.gather(*(reactor.submit(e) for e in events), return_exceptions=True)
    await asyncio.sleep(0)  # each submission is queued
    gate.opened.set()
    await first
    return list(await waiting)


def _job() -> str:
    """A job of its own: the suite's etcd is shared by every test."""
    return f"t-{uuid.uuid4().hex[:8]}"


def _failures(count: int, size: int) -> list[Event]:
    return [PluginFailed(plugin=f"plugin-{i}", event_type="node.joined", error=f"{i % 10}" * size)
            for i in range(count)]


async def test_submissions_waiting_together_are_appended_in_writes_the_store_takes_and_all_recorded(
        small_store: StateStore) -> None:
    events, job = _failures(64, 2000), _job()  # 64 events, the most one append takes, of 2.3 KiB each: over LIMIT
    gate = _Gate()
    async with Reactor(EventLog(small_store, job), gate, settings=Settings()) as reactor:
        await reactor.resume()
        outcomes = await _queued_while_busy(reactor, gate, events)
        records = await reactor.log.read()
    stored = {kv.key: kv for kv in await small_store.range(reactor.log.prefix)}
    assert all(isinstance(o, Record) for o in outcomes)
    recorded = [r for r in records if isinstance(r.event, PluginFailed)]
    assert [r.event for r in recorded] == events
    writes: dict[int, list[KeyValue]] = {}
    for record in recorded:
        kv = stored[reactor.log.key(record.seq)]
        writes.setdefault(kv.mod_revision, []).append(kv)
    assert 1 < len(writes) <= 4  # split by size into a few writes, not 64 one by one after a refused batch
    assert all(write_size((kv.key, len(kv.value)) for kv in kvs) <= LIMIT for kvs in writes.values())


async def test_an_event_larger_than_a_store_write_is_refused_clearly_and_the_others_waiting_with_it_are_recorded(
        small_store: StateStore) -> None:
    small, (huge,), job = _failures(2, 100), _failures(1, LIMIT), _job()
    gate = _Gate()
    async with Reactor(EventLog(small_store, job), gate, settings=Settings()) as reactor:
        await reactor.resume()
        outcomes = await _queued_while_busy(reactor, gate, [small[0], huge, small[1]])
        records = await reactor.log.read()
    assert isinstance(outcomes[0], Record) and isinstance(outcomes[2], Record)
    assert isinstance(outcomes[1], WriteTooLarge)
    assert re.search(rf"event plugin\.failed of job '{job}' is \d+ bytes encoded, more than one write to .* takes "
                     rf"\({LIMIT} bytes, store_max_write_bytes\); it was not recorded", str(outcomes[1]))
    assert [r.event for r in records if isinstance(r.event, PluginFailed)] == small


class _FailsLoudly(_Executor):
    """Every start of workers fails with a long error, as a platform's full report would be."""

    async def run(self, effect: Effect) -> None:
        await super().run(effect)
        if effect.kind == "start-workers":
            raise OSError(f"{effect.id}: " + "x" * 4000)


async def test_a_rounds_many_effect_failures_are_recorded_in_as_many_writes_as_they_take(
        small_store: StateStore) -> None:
    nodes, job = 40, _job()  # 40 EffectFailed of about 4 KiB each: more than one write of LIMIT takes
    spec = JobSubmitted(job="t", min_nodes=nodes, max_nodes=nodes, nproc_per_node=1, max_restarts=0)
    async with Reactor(EventLog(small_store, job), _FailsLoudly(), settings=Settings()) as reactor:
        await reactor.resume()
        await reactor.submit(spec)
        await reactor.submit_many([NodeJoined(node_id=f"node-{i}", incarnation=1) for i in range(nodes)])
        state = await reactor.wait_until(lambda s: s.phase.terminal, timeout_s=30)
        records = await reactor.log.read()
    failed = [r.event for r in records if isinstance(r.event, EffectFailed)]
    assert sorted(f.node_id or "" for f in failed) == sorted(f"node-{i}" for i in range(nodes))
    assert state.phase is JobPhase.FAILED  # decided on, not a reactor stopped by a refused write


async def test_a_snapshot_larger_than_one_store_write_is_written_in_chunks_and_resumed_from(
        small_store: StateStore) -> None:
    nodes, job = 400, _job()  # a state of about 80 KiB
    spec = JobSubmitted(job="t", min_nodes=nodes, max_nodes=nodes, nproc_per_node=1)
    settings = Settings(snapshot_every=100)
    async with Reactor(EventLog(small_store, job), _Executor(), settings=settings) as reactor:
        await reactor.resume()
        await reactor.submit(spec)
        for i in range(0, nodes, 50):
            await reactor.submit_many([NodeJoined(node_id=f"node-{n}", incarnation=1) for n in range(i, i + 50)])
        before = await reactor.wait_until(lambda s: s.rdzv.round == 1, timeout_s=30)
        await reactor.snapshot()
        head = await small_store.get(reactor.log.snapshot_key)
    async with Reactor(EventLog(small_store, job), _Executor(), settings=settings) as again:
        assert await again.resume() == before
    assert head is not None and len(head.value) < 1024 < len(json.dumps(to_json(before)))
