"""The master's background tasks (heartbeat watcher, progress, platform events), supervised.

Each task runs in the master's task group. One that fails is restarted with
backoff; one that failed ``master_task_max_failures`` times stops the master
with :class:`MasterTaskFailed` instead of leaving a job that no longer notices
lost nodes. The state store being away is not a failure of the task: it waits
for the store to answer again (for up to ``retry_deadline_s``), then starts
again, so an outage of the store costs the job nothing but the records that
could not be written meanwhile. A store that answers but keeps failing one
task's requests is given the same deadline, with backoff between tries.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from stead.core.config import Settings
from stead.core.errors import MasterTaskFailed, RetryableError, StoreUnavailable
from stead.core.retry import Backoff, retrying
from stead.core.store import StateStore
from stead.core.tasks import TaskOwner

__all__ = ["MasterTasks"]

log = structlog.get_logger("stead.master")


class MasterTasks:
    """The master's background tasks in one task group: a failed task is restarted with backoff; one that failed
    ``master_task_max_failures`` times raises MasterTaskFailed, which stops the master.

    A failure that is the state store being away is not counted: the task waits until the store answers again
    (retried with backoff for ``retry_deadline_s``) and starts again. A store that stays away past the deadline
    raises MasterTaskFailed saying so."""

    def __init__(self, settings: Settings, *, store: StateStore) -> None:
        self._settings = settings
        self._store = store
        self._tasks = TaskOwner()

    async def __aenter__(self) -> MasterTasks:
        await self._tasks.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._tasks.__aexit__(*exc)

    def start(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        self._tasks.start(self._supervise, name, run, name=f"master:{name}")

    async def _supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        failures = 0
        backoff, store_backoff = Backoff(self._settings), Backoff(self._settings)
        deadline = self._settings.retry_deadline_s
        # since when the store has failed this task's requests while it answered the probe at once (a store that
        # is up but refuses, say, a large range): that counts against retry_deadline_s like an outage does
        refusing_since: float | None = None
        started = time.monotonic()
        while True:
            try:
                await run()
                return
            except StoreUnavailable as exc:
                if await self._wait_for_store(name, exc) or time.monotonic() - started > deadline:
                    refusing_since = None  # an outage that ended, or a failure after a long good run: a new start
                    store_backoff.reset()
                elif refusing_since is None:
                    refusing_since = time.monotonic()
                elif time.monotonic() - refusing_since > deadline:
                    log.error("master_task_failed", task=name, error=str(exc), action="stopping the master")
                    raise MasterTaskFailed(
                        f"the state store answers but has failed the master's {name} task for longer than "
                        f"retry_deadline_s={deadline:g} s (last: {exc}); the master stopped and left the job's nodes "
                        "running: look at the store's health (its load, its request limits), then run `stead run` "
                        "with the same job name"
                    ) from exc
                await store_backoff.wait()
                started = time.monotonic()
                continue
            except Exception as exc:
                failures += 1
                if failures >= self._settings.master_task_max_failures:
                    log.error("master_task_failed", task=name, failures=failures, error=repr(exc),
                              action="stopping the master")
                    raise MasterTaskFailed(f"the master's {name} task failed {failures} times (last: {exc!r}); "
                                           "the master stopped so that a new one can take over: restart it "
                                           "(the job resumes from its log)") from exc
                log.error("master_task_failed", task=name, failures=failures, error=repr(exc), action="restarting",
                          exc_info=True)
            await backoff.wait()
            started = time.monotonic()

    async def _wait_for_store(self, name: str, exc: StoreUnavailable) -> bool:
        """Until the store answers again: True when it was away (False: it answered at once); MasterTaskFailed when
        it has not answered within retry_deadline_s."""
        try:
            await self._store.revision()
            return False
        except RetryableError:
            pass
        deadline = self._settings.retry_deadline_s
        log.warning("master_task_paused", task=name, error=str(exc),
                    action=f"waiting up to retry_deadline_s={deadline:g} s for the state store to answer; the "
                           "workers keep training")
        try:
            await retrying(self._store.revision, self._settings, what="state store")
        except RetryableError as gone:
            log.error("store_gone", task=name, deadline_s=deadline, error=str(gone), action="stopping the master")
            raise MasterTaskFailed(
                f"the state store has not answered for retry_deadline_s={deadline:g} s (last: {gone}); the master "
                "stopped and left the job's nodes running: bring the store back (`stead run` starts a new master, "
                "which waits for it as long again), or run `stead run` with the same job name once it is back"
            ) from gone
        log.info("master_task_resumed", task=name, reason="the state store answers again")
        return True
