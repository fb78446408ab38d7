"""The round's step progress, folded from heartbeats into ``step.progress`` records: the first step and a phase's
start or end at once, later steps once per progress interval, on a fake clock beside a real reactor."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest
from _running_job import NODES, running_job

from stead.core.config import Settings
from stead.core.events import StepProgress
from stead.core.master.reactor import Reactor
from stead.core.master.step_progress import ProgressRecorder
from stead.core.rpc import HeartbeatInfo
from stead.testing import FakeClock

pytestmark = pytest.mark.anyio

SETTINGS = Settings(progress_interval_s=5.0)


@contextlib.asynccontextmanager
async def _running(clock: FakeClock) -> AsyncIterator[tuple[Reactor, ProgressRecorder]]:
    """A running job on ``clock``'s time and its progress recorder, watching."""
    async with running_job(clock, SETTINGS) as reactor, anyio.create_task_group() as tasks:
        progress = ProgressRecorder(settings=SETTINGS, submit=reactor.submit, get_state=lambda: reactor.state,
                                    clock=clock)
        tasks.start_soon(progress.watch)
        yield reactor, progress
        tasks.cancel_scope.cancel()


async def _recorded(reactor: Reactor) -> list[tuple[int, str, float]]:
    """(step, phase, time) of each StepProgress on record."""
    return [(r.event.step, r.event.phase, r.at) for r in await reactor.log.read() if isinstance(r.event, StepProgress)]


async def _beat(progress: ProgressRecorder, node: str, step: int | None, phase: str = "") -> None:
    """One heartbeat's steps taken in, and recorded at once when they should be (as the gateway does)."""
    if progress.heard(HeartbeatInfo(node_id=node, incarnation=1, round=1, step=step, workers_alive=1, phase=phase)):
        await progress.record()


async def test_the_rounds_first_step_is_recorded_once_every_member_has_one_later_steps_once_per_interval() -> None:
    clock = FakeClock()
    async with _running(clock) as (reactor, progress):
        start = clock.now()
        await _beat(progress, "node-0", 0)
        await clock.settle()
        assert await _recorded(reactor) == []  # node-1 has no step yet
        await _beat(progress, "node-1", 0)
        assert await _recorded(reactor) == [(0, "", start)]  # at once: it ends the recovery
        for second in range(1, 12):  # a step a second from both
            await clock.advance(1)
            for node in NODES:
                await _beat(progress, node, second)
        # not a record a heartbeat: the watcher's looks at 5 s and 10 s, each the slowest member's step then
        assert await _recorded(reactor) == [(0, "", start), (4, "", start + 5), (9, "", start + 10)]


async def test_a_phase_is_recorded_as_it_starts_and_ends_and_a_restarted_node_has_no_step_in_its_new_round() -> None:
    clock = FakeClock()
    async with _running(clock) as (reactor, progress):
        start = clock.now()
        for node in NODES:
            await _beat(progress, node, 3)
        await clock.advance(1)
        await _beat(progress, "node-1", 3, phase="checkpoint")
        await clock.advance(1)
        await _beat(progress, "node-1", 3)
        assert await _recorded(reactor) == [(3, "", start), (3, "checkpoint", start + 1), (3, "", start + 2)]
        progress.workers_started("node-0", 1, 1)  # its workers restarted in the round: no step until it says one
        await clock.advance(SETTINGS.progress_interval_s)
        await _beat(progress, "node-1", 4)
        await clock.advance(SETTINGS.progress_interval_s)
        assert len(await _recorded(reactor)) == 3
        await _beat(progress, "node-0", 5)
        await clock.advance(SETTINGS.progress_interval_s)
        assert (await _recorded(reactor))[3:] == [(4, "", start + 15)]  # at the watcher's next look
