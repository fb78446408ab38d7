"""The master's background tasks: restarted when they fail, patient while the store is away."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from stead.core.config import Settings
from stead.core.errors import MasterTaskFailed, StoreUnavailable
from stead.core.master.tasks import MasterTasks

pytestmark = pytest.mark.anyio

#: fast retries: these tests are about what is retried, not how long it takes
FAST = {"retry_initial_s": 0.001, "retry_max_s": 0.002, "master_task_max_failures": 2}


class _Store:
    """A store whose ``revision()`` is unavailable for the first ``away`` calls (or always, with None)."""

    def __init__(self, away: int | None) -> None:
        self.away = away
        self.probes = 0

    async def revision(self) -> int:
        self.probes += 1
        if self.away is None or self.probes <= self.away:
            raise StoreUnavailable("etcd at etcd://127.0.0.1:1 is unavailable")
        return 7


async def _run(tasks_settings: Settings, store: _Store, task: Callable[[], Awaitable[None]],
               until: anyio.Event | None = None) -> None:
    """Run ``task`` supervised until ``until`` is set (None: until the supervision raises)."""
    with anyio.fail_after(30):  # a guard against a hang, not a measured duration
        async with MasterTasks(tasks_settings, store=store) as tasks:  # type: ignore[arg-type]
            tasks.start("progress", task)
            await (until.wait() if until is not None else anyio.sleep_forever())


async def test_a_task_that_fails_while_the_store_is_away_waits_for_it_and_is_not_counted_as_failing() -> None:
    store = _Store(away=3)
    runs = 0
    done = anyio.Event()

    async def task() -> None:
        nonlocal runs
        runs += 1
        if runs <= 5:  # more store failures than master_task_max_failures allows for real ones
            raise StoreUnavailable("the store is away")
        done.set()

    await _run(Settings(**FAST), store, task, until=done)
    assert runs == 6
    assert store.probes == 3 + 5  # the first wait probed through the outage; each later one answered at once


async def test_a_store_away_past_retry_deadline_s_stops_the_master_saying_so() -> None:
    async def task() -> None:
        raise StoreUnavailable("the store is away")

    with pytest.raises(ExceptionGroup) as raised:
        await _run(Settings(**FAST, retry_deadline_s=0.05), _Store(away=None), task)
    (failed,) = raised.value.exceptions
    assert isinstance(failed, MasterTaskFailed)
    assert "has not answered for retry_deadline_s=0.05 s" in str(failed)
    assert "left the job's nodes running" in str(failed) and "with the same job name" in str(failed)


async def test_other_failures_still_count_and_stop_the_master_after_master_task_max_failures() -> None:
    runs = 0

    async def task() -> None:
        nonlocal runs
        runs += 1
        raise RuntimeError("the platform's watch broke")

    with pytest.raises(ExceptionGroup) as raised:
        await _run(Settings(**FAST), _Store(away=0), task)
    (failed,) = raised.value.exceptions
    assert isinstance(failed, MasterTaskFailed) and "progress task failed 2 times" in str(failed)
    assert runs == 2


async def test_a_store_that_answers_but_keeps_failing_a_task_stops_the_master_after_retry_deadline_s() -> None:
    store = _Store(away=0)  # the probe always answers
    runs = 0

    async def task() -> None:
        nonlocal runs
        runs += 1
        raise StoreUnavailable("etcdserver: request timed out")

    with pytest.raises(ExceptionGroup) as raised:
        await _run(Settings(**FAST, retry_deadline_s=0.05), store, task)
    (failed,) = raised.value.exceptions
    assert isinstance(failed, MasterTaskFailed)
    assert "answers but has failed the master's progress task" in str(failed)
    assert "request timed out" in str(failed) and "left the job's nodes running" in str(failed)
    assert runs > 2  # retried with backoff until the deadline, not counted as master_task_max_failures
