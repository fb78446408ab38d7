"""Retrying a call that failed with a retryable error: exponential backoff up to a deadline.

Used wherever stead talks to something that may be briefly away: the state store
at start, the master from an agent. Only :class:`RetryableError` is retried.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import structlog

from stead.core.config import Settings
from stead.core.errors import RetryableError

__all__ = ["Backoff", "retrying"]

log = structlog.get_logger("stead.retry")

T = TypeVar("T")


async def retrying(
    call: Callable[[], Awaitable[T]],
    settings: Settings,
    *,
    what: str = "rpc",
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    clock: Callable[[], float] = time.monotonic,
    deadline_s: float | None = None,
    rng: random.Random | None = None,
) -> T:
    """``await call()``, retrying a RetryableError with exponential backoff.

    The delay starts at ``settings.retry_initial_s`` and doubles up to
    ``settings.retry_max_s``; each wait is drawn between half the delay and the delay, and
    is never shorter than the error's ``retry_after_s`` (a master shedding load says it).
    After ``deadline_s`` (default ``settings.retry_deadline_s``) the last error is raised.
    Other errors are raised at once.
    """
    backoff = Backoff(settings, rng=rng)
    limit = settings.retry_deadline_s if deadline_s is None else deadline_s
    deadline = clock() + limit
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except RetryableError as exc:
            remaining = deadline - clock()
            if remaining <= 0:
                log.error("retry_gave_up", what=what, attempts=attempt, error=str(exc))
                exc.add_note(f"gave up after {attempt} attempts over {limit:g} s")
                raise
            pause = min(backoff.next(at_least=exc.retry_after_s), remaining)
            log.warning("retrying", what=what, attempt=attempt, delay_s=round(pause, 3), error=str(exc))
            await sleep(pause)


class Backoff:
    """Delays for a loop that retries for as long as it runs: ``await wait()`` after a failure, ``reset()`` after a
    success. Starts at ``retry_initial_s`` and doubles up to ``retry_max_s``; each wait is drawn between half the
    delay and the delay, so that many agents that lost their master at once do not come back in step."""

    def __init__(self, settings: Settings, *, rng: random.Random | None = None) -> None:
        self._settings = settings
        self._rng = rng or random.Random()
        self.delay = settings.retry_initial_s

    def next(self, *, at_least: float = 0.0) -> float:
        """The next pause: the delay jittered, never shorter than ``at_least`` (a shedding master's retry-after);
        the delay doubles for the one after."""
        pause = max(min(self.delay, self._settings.retry_max_s) * self._rng.uniform(0.5, 1.0), at_least)
        self.delay = min(self.delay * 2, self._settings.retry_max_s)
        return pause

    async def wait(self, *, at_least: float = 0.0) -> None:
        """Sleep the next pause (see :meth:`next`)."""
        await anyio.sleep(self.next(at_least=at_least))

    def reset(self) -> None:
        self.delay = self._settings.retry_initial_s
