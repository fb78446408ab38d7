"""The master's garbage-collector steward: survivors frozen, CPython's full collections its own, frozen cycles freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import anyio
import pytest

from stead.core.config import Settings
from stead.core.master.gcsteward import steward_gc

pytestmark = pytest.mark.anyio


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def _until(done: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not done():  # noqa: ASYNC110 -- the collector's state has no event to wait on
            await anyio.sleep(0.05)


def _frozen(obj: object) -> bool:
    """Tracked by the collector but in none of its generations: in the permanent one."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


async def test_survivors_are_frozen_while_it_runs_and_the_collector_is_as_it_was_after() -> None:
    before = gc.get_threshold()
    survivor = _Cycle()
    async with anyio.create_task_group() as tg:
        tg.start_soon(steward_gc, Settings(gc_freeze_every_s=0.05))
        await _until(lambda: _frozen(survivor))
        assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > 1_000_000  # no full collection
        tg.cancel_scope.cancel()                                                           # of CPython's own
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0 and not _frozen(survivor)


async def test_a_cycle_that_became_garbage_after_it_was_frozen_is_freed_by_the_periodic_full_collection() -> None:
    held = [_Cycle()]
    gone = weakref.ref(held[0])
    async with anyio.create_task_group() as tg:
        tg.start_soon(steward_gc, Settings(gc_freeze_every_s=0.05, gc_full_every_s=1.0))
        await _until(lambda: _frozen(held[0]))
        held.clear()
        await anyio.sleep(0.2)
        assert gone() is not None  # frozen garbage: the young collections cannot free it
        await _until(lambda: gone() is None)
        tg.cancel_scope.cancel()


async def test_zero_leaves_the_collector_alone() -> None:
    before = gc.get_threshold()
    with anyio.fail_after(5):
        await steward_gc(Settings(gc_freeze_every_s=0))
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
