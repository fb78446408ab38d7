"""The master's garbage collector: long-lived objects frozen out of CPython's full collections.

A master of 10,000 nodes holds millions of long-lived objects: each node's
connection, its streams, its state. CPython's collector scans every one of them in
each full collection, and starts one whenever the survivors grew by a quarter: at
that size a pause of one to three seconds, during which no heartbeat is read (the
heartbeat p99 and the time to notice a lost node both pay for it; measured by
bench/master_scale.py).

So the master, every ``gc_freeze_every_s``, collects the young generations and
freezes what survived them (:func:`gc.freeze`): the collector no longer scans those
objects, which still die by reference counting as usual. CPython's own full
collections are turned off meanwhile (a burst of work, a round of 10,000 nodes
starting, would still promote enough between two freezes to start one). A cycle of
objects frozen before it became garbage would never be collected, so every
``gc_full_every_s`` the master thaws everything and runs one full collection (one
pause, logged with its length). When the master stops it thaws everything, leaving
the process's collector as it found it (a process running several masters: each
freezes and thaws the whole process; the last one to stop restores the thresholds).
Both periods run on the master's clock (a test's :class:`stead.testing.FakeClock`
moves them on by hand).
"""

from __future__ import annotations

import gc
import time

import structlog

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings

__all__ = ["steward_gc"]

log = structlog.get_logger("stead.gc")

#: a count of young collections that never comes: CPython starts no full collection of its own
_NEVER = 1 << 30


async def steward_gc(settings: Settings, *, clock: Clock = WALL_CLOCK) -> None:
    """Run for the master's life (a task of its own); ``gc_freeze_every_s`` = 0 leaves the collector alone."""
    if settings.gc_freeze_every_s <= 0:
        return
    full_at = clock.now() + settings.gc_full_every_s
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)  # the full collections are this task's (below), not CPython's
    try:
        while True:
            await clock.sleep(settings.gc_freeze_every_s)
            if clock.now() >= full_at:
                full_at = clock.now() + settings.gc_full_every_s
                _collect_all()
            gc.collect(1)  # the young garbage first: what is frozen should be what lives on
            gc.freeze()
    finally:
        gc.unfreeze()
        gc.set_threshold(young, middle, old)


def _collect_all() -> None:
    frozen = gc.get_freeze_count()
    started = time.perf_counter()
    gc.unfreeze()
    collected = gc.collect()
    log.info("gc_full_collection", objects=frozen, collected=collected,
             pause_s=round(time.perf_counter() - started, 3))
