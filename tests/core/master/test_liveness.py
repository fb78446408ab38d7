"""Liveness: the one check of an agent's node incarnation, heartbeat deadlines on the master's clock, shedding.

The heartbeat watcher runs on a :class:`FakeClock` beside a real reactor (a memory store) running a job: a node's
loss is recorded at the fake time it falls due, and the tests take no real time.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest
from _running_job import NODES, running_job

from stead.core.config import Settings
from stead.core.errors import InvalidRequest, Overloaded, RpcUnavailable
from stead.core.events import NodeLost, Record
from stead.core.master.liveness import Liveness
from stead.core.master.reactor import Reactor
from stead.testing import FakeClock

pytestmark = pytest.mark.anyio

#: a look at the nodes every 0.5 s (the watcher's longest sleep), a node lost after 10 s of silence
SETTINGS = Settings(heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0, shed_lag_s=1.0)


@contextlib.asynccontextmanager
async def _watched(clock: FakeClock, *, watching: bool = True) -> AsyncIterator[tuple[Reactor, Liveness]]:
    """A running job on ``clock``'s time and a Liveness of it (watching, unless ``watching`` is False: the test
    starts it)."""
    async with running_job(clock, SETTINGS) as reactor, anyio.create_task_group() as tasks:
        liveness = Liveness(job="t", settings=SETTINGS, submit=reactor.submit, get_state=lambda: reactor.state,
                            clock=clock)
        if watching:
            tasks.start_soon(liveness.watch)
        yield reactor, liveness
        tasks.cancel_scope.cancel()


async def _beating(clock: FakeClock, liveness: Liveness, seconds: float, nodes: tuple[str, ...]) -> None:
    """Let ``seconds`` pass, ``nodes`` beating every heartbeat interval."""
    for _ in range(round(seconds / SETTINGS.heartbeat_interval_s)):
        await clock.advance(SETTINGS.heartbeat_interval_s)
        for node in nodes:
            liveness.heard(node, 1)


async def _losses(reactor: Reactor) -> list[Record]:
    return [r for r in await reactor.log.read() if isinstance(r.event, NodeLost)]


async def test_a_node_whose_heartbeats_stop_is_declared_lost_after_the_heartbeat_timeout() -> None:
    clock = FakeClock()
    async with _watched(clock) as (reactor, liveness):
        await _beating(clock, liveness, 5, NODES)
        last_beat = clock.now()
        await _beating(clock, liveness, SETTINGS.heartbeat_timeout_s, ("node-0",))  # node-1 went quiet
        assert await _losses(reactor) == []  # silent for exactly the timeout: not yet
        await _beating(clock, liveness, 1, ("node-0",))
        losses = await _losses(reactor)
        assert [r.event for r in losses] == [NodeLost(node_id="node-1", incarnation=1, reason="no heartbeat for 10 s")]
        # at the watcher's first look past the timeout
        assert last_beat + SETTINGS.heartbeat_timeout_s < losses[0].at <= last_beat + SETTINGS.heartbeat_timeout_s + 0.5
        await _beating(clock, liveness, 30, ("node-0",))
        assert [r.event.node_id for r in await _losses(reactor)] == ["node-1"]  # once; the beating node never


async def test_a_master_that_starts_watching_gives_every_node_it_knows_a_full_timeout() -> None:
    clock = FakeClock()
    async with _watched(clock, watching=False) as (reactor, liveness), anyio.create_task_group() as tasks:
        await clock.advance(60)  # joined a minute ago, never heard from since (the master that heard them died)
        tasks.start_soon(liveness.watch)
        await clock.advance(SETTINGS.heartbeat_timeout_s)
        assert await _losses(reactor) == []
        await clock.advance(0.5)
        assert {r.event.node_id for r in await _losses(reactor)} == set(NODES)
        tasks.cancel_scope.cancel()


async def test_every_call_of_a_stale_agent_is_refused_in_the_same_words_and_retried_while_the_master_starts() -> None:
    clock = FakeClock()
    async with _watched(clock, watching=False) as (reactor, liveness):
        liveness.require_live("node-0", 1)
        assert liveness.is_live("node-0", 1) and not liveness.is_live("node-0", 2)
        with pytest.raises(InvalidRequest) as stale:
            liveness.require_live("node-0", 2)
        assert str(stale.value) == ("node node-0 incarnation 2 is not a live node of job 't'; this agent is stale "
                                    "and should exit (current incarnation 1 is joined)")
        await reactor.submit(NodeLost(node_id="node-1", incarnation=1))  # relaunched: incarnation 2 is asked for
        with pytest.raises(InvalidRequest, match=r"node node-1 incarnation 1 is not a live node of job 't'; .*"
                                                 r"\(current incarnation 2 is requested\)"):
            liveness.require_live("node-1", 1)
        with pytest.raises(InvalidRequest, match=r"node-9 incarnation 1 .* should exit \(unknown node\)"):
            liveness.require_live("node-9", 1)
        liveness.serving = False  # replaying the log: nothing is known yet, the agent tries again
        with pytest.raises(RpcUnavailable, match="is starting"):
            liveness.is_live("node-0", 1)


async def test_a_late_master_sheds_registrations_with_a_retry_after_of_twice_its_lateness_at_most_30_s() -> None:
    clock = FakeClock()
    async with _watched(clock, watching=False) as (_, liveness):
        liveness.lag_s = SETTINGS.shed_lag_s
        liveness.shed_if_late()  # not over shed_lag_s: taken
        liveness.lag_s = 4.0
        with pytest.raises(Overloaded, match=r"overloaded \(its loop runs 4.0 s late\)") as refused:
            liveness.shed_if_late()
        assert refused.value.retry_after_s == 8.0
        liveness.lag_s = 100.0
        with pytest.raises(Overloaded) as refused:
            liveness.shed_if_late()
        assert refused.value.retry_after_s == 30.0 and liveness.shed == 2
