"""A clock that moves only when a test moves it: :class:`FakeClock`.

Give it to what waits on a :class:`stead.core.clock.Clock` (the reactor's timers
and effect timeouts) and to the event log (``EventLog(store, job, clock=clock.now)``:
the job machine sets its timers from the records' times), then move time on with
``await clock.advance(seconds)``::

    clock = FakeClock()
    async with Reactor(EventLog(store, "job", clock=clock.now), executor, settings=settings,
                       clock=clock) as reactor:
        await reactor.resume()
        await reactor.submit(JobSubmitted(..., last_call_timeout_s=30))
        ...
        await clock.advance(30)            # the last call fires now, in no time at all
        assert reactor.state.rdzv.round == 1

``advance`` wakes the sleepers due by the new time one at a time, earliest first
(those due at the same time in the order they went to sleep), each at its own
time, and lets every task run until all of them wait again before it wakes the
next: what a timer does (the record it submits, the timer it arms) is done before
a later timer fires, and a sleep begun meanwhile that falls due by the new time
is woken too. Asyncio only (stead's loop). Tasks blocked on a thread (a sqlite
store's calls) count as waiting: use a ``memory://`` store with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
from collections.abc import AsyncIterator

import anyio

__all__ = ["FakeClock"]

#: turns of the event loop a settle takes before it also lets real time pass (a task that spins on sleep(0))
_SPINS_BEFORE_PAUSING = 1000
#: the pause of a settle past that (a guard against spinning the CPU, not a measured duration)
_PAUSE_S = 0.001


@dataclasses.dataclass(order=True)
class _Sleeper:
    at: float
    order: int
    wake: asyncio.Event = dataclasses.field(compare=False)


class FakeClock:
    """Time that stands still until :meth:`advance` moves it; see the module docstring."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        """``start``: the time at first, in seconds since the epoch (far from 0, which code may read as "unset")."""
        self._now = start
        self._sleepers: list[_Sleeper] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    @property
    def next_wake(self) -> float | None:
        """When the earliest sleeper is due (None when nothing sleeps)."""
        return self._sleepers[0].at if self._sleepers else None

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self._now + seconds)

    async def sleep_until(self, at: float) -> None:
        if at <= self._now:
            await asyncio.sleep(0)
            return
        sleeper = _Sleeper(at, next(self._order), asyncio.Event())
        heapq.heappush(self._sleepers, sleeper)
        try:
            await sleeper.wake.wait()
        finally:
            if not sleeper.wake.is_set():  # cancelled while asleep: no longer due to anyone
                self._sleepers.remove(sleeper)
                heapq.heapify(self._sleepers)

    @contextlib.asynccontextmanager
    async def fail_after(self, seconds: float) -> AsyncIterator[None]:
        """``anyio.fail_after`` on this clock: TimeoutError once ``seconds`` of it have passed."""
        body = anyio.CancelScope()
        expired = False

        async def expire() -> None:
            nonlocal expired
            await self.sleep(seconds)
            expired = True
            body.cancel()

        deadline = asyncio.ensure_future(expire())  # owned by this block: cancelled and awaited as it ends
        try:
            with body:
                yield
        finally:
            deadline.cancel()
            await asyncio.wait([deadline])
        if expired and body.cancelled_caught:
            raise TimeoutError(f"did not finish within {seconds:g} s of the fake clock")

    async def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``, waking every sleeper due by then in order; see the module docstring."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds:g} s asked for); give advance() 0 or more seconds")
        target = self._now + seconds
        await self.settle()  # what is about to sleep (a timer just armed) sleeps first
        while self._sleepers and self._sleepers[0].at <= target:
            sleeper = heapq.heappop(self._sleepers)
            self._now = max(self._now, sleeper.at)
            sleeper.wake.set()
            await self.settle()
        self._now = target

    async def settle(self) -> None:
        """Return once every other task waits (on a sleep, an event, a lock, IO) and the loop has no callback due
        (anyio delivers a cancellation by one): nothing can run until time moves or IO answers."""
        me = asyncio.current_task()
        loop = asyncio.get_running_loop()
        spins = 0
        while True:
            spins += 1
            await (asyncio.sleep(0) if spins <= _SPINS_BEFORE_PAUSING else asyncio.sleep(_PAUSE_S))
            if not _callbacks_due(loop) and all(task is me or _waiting(task) for task in asyncio.all_tasks()):
                return


def _waiting(task: asyncio.Task[object]) -> bool:
    waiter = getattr(task, "_fut_waiter", None)  # what the task awaits (asyncio's own bookkeeping, as anyio reads it)
    return waiter is not None and not waiter.done()


def _callbacks_due(loop: asyncio.AbstractEventLoop) -> bool:
    return bool(getattr(loop, "_ready", ()))  # asyncio's queue of callbacks to run at its next turn
