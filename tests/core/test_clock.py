"""The clocks: the real one waits; the fake one (stead.testing.FakeClock) moves only when advanced, in order, and
a master given one (plugin_master(clock=)) fires its timers and its plugins' waits by it."""

from __future__ import annotations

import time

import anyio
import pytest

from stead.core.clock import WALL_CLOCK
from stead.core.events import JobSubmitted, NodeJoined, PluginFailed, Record, RoundStarted
from stead.core.plugins import NoSettings, Plugin, PluginContext
from stead.testing import FakeClock, plugin_master, settle

pytestmark = pytest.mark.anyio


async def test_the_wall_clock_tells_the_epoch_time_and_its_deadline_raises_timeout() -> None:
    assert abs(WALL_CLOCK.now() - time.time()) < 60
    with pytest.raises(TimeoutError):
        async with WALL_CLOCK.fail_after(0):
            await anyio.sleep_forever()


async def test_sleepers_wake_only_when_advanced_past_their_time_earliest_first() -> None:
    clock, woke = FakeClock(start=100.0), list[tuple[str, float]]()

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    async with anyio.create_task_group() as tg:
        for name, seconds in (("late", 30.0), ("early", 10.0), ("same-time-second", 30.0)):
            tg.start_soon(sleeper, name, seconds)
        await clock.advance(9.5)
        assert woke == [] and clock.now() == 109.5 and clock.next_wake == 110.0
        await clock.advance(100)
    assert woke == [("early", 110.0), ("late", 130.0), ("same-time-second", 130.0)]
    assert clock.now() == 209.5 and clock.next_wake is None


async def test_a_sleep_begun_by_a_woken_sleeper_within_the_advance_is_woken_in_the_same_advance() -> None:
    clock, woke = FakeClock(start=0.0), list[float]()

    async def chain() -> None:
        for _ in range(3):  # a timer that arms the next one when it fires
            await clock.sleep(5)
            woke.append(clock.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(chain)
        await clock.advance(12)
        assert woke == [5.0, 10.0]
        await clock.advance(3)
    assert woke == [5.0, 10.0, 15.0]


async def test_a_cancelled_sleeper_is_forgotten() -> None:
    clock = FakeClock()
    with anyio.move_on_after(0):  # cancelled at once, before the fake time moves
        await clock.sleep(10)
    assert clock.next_wake is None


async def test_its_deadline_fires_on_its_own_time_and_not_before() -> None:
    clock, finished = FakeClock(), anyio.Event()
    outcome: list[str] = []

    async def guarded(seconds: float) -> None:
        try:
            async with clock.fail_after(seconds):
                await finished.wait()
            outcome.append("finished")
        except TimeoutError as exc:
            outcome.append(str(exc))

    async with anyio.create_task_group() as tg:
        tg.start_soon(guarded, 30.0)
        await clock.advance(29)
        assert outcome == []
        await clock.advance(1)
        assert outcome == ["did not finish within 30 s of the fake clock"]
        tg.start_soon(guarded, 30.0)
        await clock.advance(10)
        finished.set()
    assert outcome[1] == "finished" and clock.next_wake is None  # its deadline's sleeper went with it


async def test_an_error_inside_its_deadline_comes_out_as_itself() -> None:
    with pytest.raises(KeyError):
        async with FakeClock().fail_after(30):
            raise KeyError("x")


async def test_time_does_not_go_back() -> None:
    with pytest.raises(ValueError, match="cannot go back"):
        await FakeClock().advance(-1)


class _Pause(Plugin[NoSettings]):
    """Waits 10 s of the master's clock after each round starts, then says so."""

    name = "pause"
    subscriptions = (RoundStarted,)

    async def handle(self, *, record: Record, ctx: PluginContext[NoSettings]) -> None:
        await ctx.clock.sleep(10)
        await ctx.emit(PluginFailed(plugin=self.name, event_type="round.started", error="paused 10 s"))


async def test_a_master_on_a_fake_clock_fires_its_timers_and_its_plugins_waits_when_advanced() -> None:
    clock = FakeClock()
    async with plugin_master(_Pause(settings=NoSettings()), clock=clock) as master:
        await master.submit(JobSubmitted(job="test", min_nodes=2, max_nodes=3, nproc_per_node=1,
                                         last_call_timeout_s=30))
        for i in range(2):
            await master.submit(NodeJoined(node_id=f"node-{i}", incarnation=1))
        await clock.advance(29)
        assert master.state.rdzv.round == 0  # the last call is still open
        await clock.advance(1)
        assert master.state.rdzv.round == 1
        await clock.advance(9.9)
        assert not _paused(await master.reactor.log.read())  # the plugin still waits
        await clock.advance(0.1)
        await settle(master)
        assert _paused(await master.reactor.log.read())


def _paused(records: list[Record]) -> bool:
    return any(isinstance(r.event, PluginFailed) and r.event.error == "paused 10 s" for r in records)
