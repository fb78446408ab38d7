"""The time a master's loops wait on: ``now()``, ``sleep()``, ``sleep_until()`` and ``fail_after()``.

The reactor asks a :class:`Clock` (its timers, the pause before a timer the store
could not record is tried again, an effect's ``effect_timeout_s``) instead of
``time`` and anyio, so that a test can hold time still and move it on by hand
(:class:`stead.testing.FakeClock`): a 30 s decision timer fires in a test that
takes no time. :data:`WALL_CLOCK`, the default everywhere, is the real one: the
seconds since the epoch of ``time.time()`` (the event log's record times, which
the job machine's timers are set from) and anyio's sleeps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Protocol

import anyio

__all__ = ["WALL_CLOCK", "Clock", "WallClock"]


class Clock(Protocol):
    """Seconds since the epoch, and waits measured in them."""

    def now(self) -> float:
        """The time now (seconds since the epoch, as the event log's records have it)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return ``seconds`` from now (at once for 0 or less, after a checkpoint)."""
        ...

    async def sleep_until(self, at: float) -> None:
        """Return at time ``at`` (at once, after a checkpoint, when it has passed)."""
        ...

    def fail_after(self, seconds: float) -> contextlib.AbstractAsyncContextManager[None]:
        """``async with clock.fail_after(s):`` cancels its body and raises TimeoutError once ``s`` have passed."""
        ...


class WallClock:
    """The real time: ``time.time()`` and anyio's sleeps and deadlines."""

    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(max(0.0, seconds))

    async def sleep_until(self, at: float) -> None:
        await anyio.sleep(max(0.0, at - time.time()))

    @contextlib.asynccontextmanager
    async def fail_after(self, seconds: float) -> AsyncIterator[None]:
        with anyio.fail_after(seconds):
            yield


#: the clock of every component that is not given one
WALL_CLOCK: Clock = WallClock()
