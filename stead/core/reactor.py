"""The reactor: persist each event, fold it, run its effects, tell the plugins.

Order for every event: append to the log (durable first) -> fold through the
pure job machine -> run the effects -> deliver to subscribed plugins. Events are
applied one at a time in log order (one job is one entity queue here; the
machines are cheap, the store round trip dominates).

Effects run at most once across master restarts: before running an effect the
reactor creates the key ``/stead/jobs/<job>/effects/<effect id>``; an effect
whose key exists already ran. An ``Emit`` effect's key is created in the same
atomic step as the event it appends, so a follow-up event is never lost nor
appended twice. Timers are re-armed from the log on resume.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog

from stead.core.config import Settings
from stead.core.errors import CodecError, LogCorrupt, SteadError
from stead.core.events import Event, Record, TimerFired, TransitionRejected
from stead.core.events.log import EventLog, job_prefix
from stead.core.serde import from_json, to_json
from stead.core.statemachine import Effect, Emit, JobState, StartTimer, transition

__all__ = ["EffectRunner", "Reactor"]

log = structlog.get_logger("stead.reactor")


class EffectRunner(Protocol):
    """Carries out effects other than Emit and StartTimer. Must not call ``Reactor.submit`` inline."""

    async def run(self, effect: Effect) -> None: ...


class Reactor:
    def __init__(
        self,
        event_log: EventLog,
        runner: EffectRunner,
        *,
        settings: Settings,
        clock: Callable[[], float] = time.time,
        observers: Sequence[Callable[[Record, JobState], None]] = (),
    ) -> None:
        self.log = event_log
        self.runner = runner
        self.settings = settings
        self._clock = clock
        self._observers = list(observers)
        self._state = JobState()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._timers: dict[str, float] = {}
        self._scheduled: set[str] = set()
        self._timer_tasks: set[asyncio.Task[None]] = set()
        self._group: asyncio.TaskGroup | None = None
        self._since_snapshot = 0

    @property
    def state(self) -> JobState:
        return self._state

    def add_observer(self, observer: Callable[[Record, JobState], None]) -> None:
        self._observers.append(observer)

    def _effect_key(self, effect: Effect) -> str:
        return f"{job_prefix(self.log.job)}effects/{effect.id}"

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Reactor:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._group is not None
        for task in self._timer_tasks:  # pending timers die with the reactor; resume re-arms them
            task.cancel()
        await self._group.__aexit__(None, None, None)

    async def resume(self) -> JobState:
        """Rebuild the state from snapshot + log, then finish what a previous master left undone."""
        async with self._lock:
            state, timers = await self._load_snapshot()
            pending: list[Effect] = []
            for record in await self.log.read(state.seq + 1):
                result = transition(state, record.event, now=record.at, seq=record.seq)
                state = result.state if result.rejected is None else _with_seq(state, record.seq)
                self._track_timers(record.event, result.effects, timers)
                pending.extend(result.effects)
            self._state, self._timers = state, timers
            log.info("reactor_resumed", job=self.log.job, seq=state.seq, phase=state.phase.value,
                     pending_effects=len(pending))
            for effect in pending:
                await self._run_effect(effect, resuming=True)
            for name, at in self._timers.items():
                self._schedule(name, at)
        return self._state

    async def _load_snapshot(self) -> tuple[JobState, dict[str, float]]:
        try:
            snapshot = await self.log.load_snapshot()
            if snapshot is None:
                return JobState(), {}
            state = from_json(JobState, snapshot.body["state"])
            timers = {str(k): float(v) for k, v in snapshot.body.get("timers", {}).items()}
            return state, timers
        except (LogCorrupt, CodecError, KeyError, TypeError, ValueError) as exc:
            log.warning("snapshot_unusable", job=self.log.job, error=str(exc), action="replaying the whole log")
            return JobState(), {}

    # -- events ----------------------------------------------------------------

    async def submit(self, event: Event) -> Record:
        """Persist ``event`` and apply it with everything it causes."""
        (record,) = await self.submit_many([event])
        return record

    async def submit_many(self, events: Sequence[Event]) -> list[Record]:
        """Persist ``events`` in one atomic append, then apply them in order."""
        async with self._lock:
            records = await self.log.append_many(events)
            await self._process(records)
        return records

    async def _process(self, records: Sequence[Record]) -> None:
        queue = collections.deque(records)
        while queue:
            record = queue.popleft()
            result = transition(self._state, record.event, now=record.at, seq=record.seq)
            if result.rejected is not None:
                self._state = _with_seq(self._state, record.seq)
                log.warning("transition_rejected", job=self.log.job, seq=record.seq,
                            kind=record.event.type_name, reason=result.rejected)
                if not isinstance(record.event, TransitionRejected):
                    rejected = TransitionRejected(event_type=record.event.type_name, seq=record.seq,
                                                  reason=result.rejected)
                    queue.extend(await self.log.append_many([rejected]))
            else:
                self._state = result.state
            self._track_timers(record.event, result.effects, self._timers)
            for observer in self._observers:
                observer(record, self._state)
            for effect in result.effects:
                if isinstance(effect, Emit):
                    queue.extend(await self.log.append_many([effect.event], extra=[(self._effect_key(effect), b"")]))
                else:
                    await self._run_effect(effect, resuming=False)
            await self._maybe_snapshot()
        async with self._changed:
            self._changed.notify_all()

    async def _run_effect(self, effect: Effect, *, resuming: bool) -> None:
        if isinstance(effect, StartTimer):
            self._schedule(effect.name, effect.at)
            return
        key = self._effect_key(effect)
        if isinstance(effect, Emit):  # only reached on resume: append unless a previous master did
            if await self.log.store.get(key) is None:
                await self._process(await self.log.append_many([effect.event], extra=[(key, b"")]))
            return
        if not await self.log.store.compare_and_put(key, b"", expected_mod_revision=0):
            if not resuming:
                log.warning("effect_already_ran", job=self.log.job, effect=effect.id)
            return
        try:
            await self.runner.run(effect)
        except SteadError as exc:
            log.error("effect_failed", job=self.log.job, effect=effect.id, error=str(exc))

    def _track_timers(self, event: Event, effects: Sequence[Effect], timers: dict[str, float]) -> None:
        for effect in effects:
            if isinstance(effect, StartTimer):
                timers.setdefault(effect.name, effect.at)
        if isinstance(event, TimerFired):
            timers.pop(event.name, None)

    def _schedule(self, name: str, at: float) -> None:
        if name in self._scheduled or self._group is None:
            return
        self._scheduled.add(name)
        task = self._group.create_task(self._fire(name, at), name=f"timer:{name}")
        self._timer_tasks.add(task)
        task.add_done_callback(self._timer_tasks.discard)

    async def _fire(self, name: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - self._clock()))
        self._scheduled.discard(name)  # the machine may arm a timer of the same name again later
        if name in self._timers:
            await self.submit(TimerFired(name=name))

    async def _maybe_snapshot(self) -> None:
        self._since_snapshot += 1
        if self._since_snapshot < self.settings.snapshot_every:
            return
        self._since_snapshot = 0
        await self.snapshot()

    async def snapshot(self) -> None:
        """Save the folded state so a restarted master replays only what follows; bound the store's history."""
        body = {"state": to_json(self._state), "timers": dict(self._timers)}
        await self.log.save_snapshot(self._state.seq, body)
        keep = self.settings.store_history_keep
        revision = await self.log.store.revision()
        if keep and revision > keep:
            await self.log.store.compact(revision - keep)

    async def wait_until(self, predicate: Callable[[JobState], bool]) -> JobState:
        """Return the state as soon as ``predicate`` holds for it."""
        async with self._changed:
            await self._changed.wait_for(lambda: predicate(self._state))
        return self._state


def _with_seq(state: JobState, seq: int) -> JobState:
    return dataclasses.replace(state, seq=max(seq, state.seq))
