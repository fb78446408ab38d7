"""The master's garbage-collector steward: survivors frozen, CPython's full collections its own, frozen cycles freed.

Its periods run on a FakeClock: each test moves time to the freeze or the full collection it looks at."""

from __future__ import annotations

import functools
import gc
import weakref

import anyio
import pytest

from stead.core.config import Settings
from stead.core.master.gcsteward import steward_gc
from stead.testing import FakeClock

pytestmark = pytest.mark.anyio


class _Cycle:
    def __init__(self) -> None:
        self.me = self


#: a freeze every second, a full collection every ten
SETTINGS = Settings(gc_freeze_every_s=1.0, gc_full_every_s=10.0)


def _frozen(obj: object) -> bool:
    """Tracked by the collector but in none of its generations: in the permanent one."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


async def test_survivors_are_frozen_while_it_runs_and_the_collector_is_as_it_was_after() -> None:
    before, clock, survivor = gc.get_threshold(), FakeClock(), _Cycle()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(steward_gc, SETTINGS, clock=clock))
        await clock.advance(SETTINGS.gc_freeze_every_s - 0.1)
        assert not _frozen(survivor)  # not before its period
        await clock.advance(0.1)
        assert _frozen(survivor)
        assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > 1_000_000  # no full collection
        tg.cancel_scope.cancel()                                                           # of CPython's own
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0 and not _frozen(survivor)


async def test_a_cycle_that_became_garbage_after_it_was_frozen_is_freed_by_the_periodic_full_collection() -> None:
    clock, held = FakeClock(), [_Cycle()]
    gone = weakref.ref(held[0])
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(steward_gc, SETTINGS, clock=clock))
        await clock.advance(SETTINGS.gc_freeze_every_s)
        assert _frozen(held[0])
        held.clear()
        last_freeze_before_the_full_collection = SETTINGS.gc_full_every_s - 2 * SETTINGS.gc_freeze_every_s
        await clock.advance(last_freeze_before_the_full_collection)
        assert gone() is not None  # frozen garbage: the young collections cannot free it
        await clock.advance(SETTINGS.gc_freeze_every_s)  # the full collection
        assert gone() is None
        tg.cancel_scope.cancel()


async def test_zero_leaves_the_collector_alone() -> None:
    before = gc.get_threshold()
    with anyio.fail_after(5):
        await steward_gc(Settings(gc_freeze_every_s=0))
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
