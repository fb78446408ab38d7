"""Polling, for what a test cannot await: a real process, a file another process writes, a count a server keeps.

A short loop with a hang guard: when the guard expires, the test fails saying what never happened (never an
assert on the clock, never a bare TimeoutError). What a test can drive instead (the master's timers, its plugins'
periodic tasks, retry backoffs) runs on a :class:`stead.testing.FakeClock`, not on a poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest

__all__ = ["PATIENCE_S", "until", "wait_until"]

#: the longest a poll waits (a guard against a hung test, not a measured time)
PATIENCE_S = 30.0
#: the pause between two looks
_LOOK_EVERY_S = 0.02


async def until(holds: Callable[[], bool], what: str, *, within_s: float = PATIENCE_S) -> None:
    """Return once ``holds()``; fail the test saying that ``what`` never happened once ``within_s`` have passed."""
    deadline = time.monotonic() + within_s
    while not holds():
        _guard(deadline, what, within_s)
        await anyio.sleep(_LOOK_EVERY_S)


def wait_until(holds: Callable[[], bool], what: str, *, within_s: float = PATIENCE_S) -> None:
    """:func:`until` for a test (or a thread) without an event loop."""
    deadline = time.monotonic() + within_s
    while not holds():
        _guard(deadline, what, within_s)
        time.sleep(_LOOK_EVERY_S)


def _guard(deadline: float, what: str, within_s: float) -> None:
    if time.monotonic() > deadline:
        pytest.fail(f"never happened within {within_s:g} s: {what}")
