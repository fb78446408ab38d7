"""The reactor: timers armed again fire again; snapshots bound both replay and the store history."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stead.core.config import Settings
from stead.core.errors import StoreError
from stead.core.events import JobSubmitted, NodeJoined, NodeLost, RoundStarted, StepProgress, TransitionRejected
from stead.core.events.log import EventLog
from stead.core.reactor import Reactor
from stead.core.statemachine import Effect
from stead.core.store import open_store

pytestmark = pytest.mark.anyio


class _Nothing:
    async def run(self, effect: Effect) -> None:
        return None


async def test_a_last_call_timer_armed_again_after_firing_starts_the_round() -> None:
    store = await open_store("memory://")
    spec = JobSubmitted(job="t", min_nodes=2, max_nodes=3, nproc_per_node=1, last_call_timeout_s=0.05)
    async with Reactor(EventLog(store, "t"), _Nothing(), settings=Settings()) as reactor:
        await reactor.resume()
        await reactor.submit(spec)
        await reactor.submit(NodeJoined(node_id="node-0", incarnation=1))
        await reactor.submit(NodeJoined(node_id="node-1", incarnation=1))  # MIN joined: last call armed
        await reactor.submit(NodeLost(node_id="node-1", incarnation=1))  # fires with one node: no round
        await reactor.wait_until(lambda s: "last-call/1" not in reactor._timers)
        await reactor.submit(NodeJoined(node_id="node-1", incarnation=2))  # MIN again: armed again
        state = await reactor.wait_until(lambda s: s.rdzv.round == 1)
        records = await reactor.log.read()
    await store.close()
    assert state.rdzv.members == ("node-0", "node-1")
    assert sum(isinstance(r.event, RoundStarted) for r in records) == 1


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
