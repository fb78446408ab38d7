"""The reactor: a job's whole control loop, one record at a time.

Every event, whoever submits it (an agent's RPC, the platform, a timer, a
plugin), goes through the same four steps, in this order::

    submit(event) ─▶ inbox ─▶ 1. persist  append to the event log: durable before anything acts on it
                              2. fold     the pure job machine (statemachine.fold): new state + effects
                              3. act      StartTimer: armed (the armed timers are part of the state)
                                          the others: made once through the effect journal (.journal):
                                          Emit's event appended with its effect key, atomically; the
                                          rest claimed in the store, run by the executor, marked done
                              4. tell     observers and plugins get (record, the state at that record)

Follow-up records (an emitted event, an ``EffectFailed``, a ``TransitionRejected``)
go through the same steps before the next submission. One task of the reactor's
own runs the loop, so a caller that is cancelled while it waits does not leave a
record persisted but not folded: the record is processed anyway, the caller just
stops waiting. Submissions waiting together are appended in one store write, as
many as fit in one (at most ``_MAX_BATCH`` events and the store's
``max_write_bytes``). An event that could never be written (its record larger than
one store write) or never encoded is refused to its submitter at once, before the
store is asked, and the others go on.

A resumed master re-derives the effects of the records after its snapshot and hands
them to the journal, which skips what a previous master finished and runs again
what it left running (:mod:`stead.core.master.journal`). An effect that fails
comes back as an ``EffectFailed`` event, recorded and folded as any other. A store
that stays unreachable while the loop must write (past ``retry_deadline_s``) stops
the reactor with the error: the master fails loudly and its successor replays the log.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import anyio
import anyio.abc
import structlog

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings
from stead.core.errors import (
    CodecError,
    LogConflict,
    LogCorrupt,
    ReactorStopped,
    RetryableError,
    SteadError,
    WriteTooLarge,
)
from stead.core.events import Event, Record, TimerFired, TimerName, TransitionRejected
from stead.core.events.base import EncodedEvent
from stead.core.events.log import EventLog
from stead.core.master.journal import EffectJournal, EffectRunner
from stead.core.retry import Backoff, retrying
from stead.core.serde import from_json, to_json
from stead.core.statemachine import Effect, Emit, JobState, StartTimer, fold
from stead.core.tasks import TaskOwner

__all__ = ["EffectRunner", "PluginSink", "Reactor", "ReactorStopped"]

log = structlog.get_logger("stead.reactor")

#: most events appended in one store write (an emitted event's effect key rides along); fewer when their records
#: would make the write larger than the store takes (EventLog.append_budget)
_MAX_BATCH = 64

T = TypeVar("T")


class PluginSink(Protocol):
    """Where records go after they are processed (the plugin host): must not block."""

    def deliver(self, record: Record, state: JobState) -> None: ...


Observer = Callable[[Record, JobState], None]


@dataclasses.dataclass
class _Submission:
    events: Sequence[EncodedEvent]
    done: asyncio.Future[list[Record]]
    #: what its records add to an append's store write (EventLog.cost)
    cost: int


class Reactor:
    """``async with Reactor(log, executor, settings=...) as r: await r.resume(); await r.submit(event)``.

    ``clock``: what its timers and effect timeouts wait on (the real time by default; a test's
    :class:`stead.testing.FakeClock`, also given to the event log, moves only when the test says).
    """

    def __init__(
        self,
        event_log: EventLog,
        executor: EffectRunner,
        *,
        settings: Settings,
        plugins: PluginSink | None = None,
        observers: Sequence[Observer] = (),
        clock: Clock = WALL_CLOCK,
    ) -> None:
        self.log = event_log
        self.journal = EffectJournal(event_log, executor, settings=settings, clock=clock)
        self.settings = settings
        self.plugins = plugins
        self._observers = list(observers)
        self._clock = clock
        self._state = JobState()
        self._inbox: collections.deque[_Submission] = collections.deque()
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._scheduled: set[TimerName] = set()
        self._tasks = TaskOwner()
        self._since_snapshot = 0
        self._stopped: BaseException | None = None
        #: paces timers that could not be recorded while the store is away (reset by the next one recorded)
        self._timer_backoff = Backoff(settings)

    @property
    def state(self) -> JobState:
        return self._state

    @property
    def failure(self) -> BaseException | None:
        """What stopped the loop (the store away past ``retry_deadline_s``, another master's write); None while it
        runs or after a clean stop."""
        stopped = self._stopped
        return None if stopped is None or isinstance(stopped, asyncio.CancelledError | ReactorStopped) else stopped

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Reactor:
        await self._tasks.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self._tasks.__aexit__(*exc)
        finally:
            self._fail_waiting(ReactorStopped(f"the master of job {self.log.job!r} stopped before it recorded "
                                              "this; retry against the next master"))

    async def resume(self, *, before_acting: Callable[[JobState], Awaitable[None]] | None = None) -> JobState:
        """Rebuild the state from snapshot + log, finish what a previous master left undone, then serve.

        ``before_acting(state)`` runs between the replay and the first effect (the master adopts the nodes
        that still run there, so that a pending kill or stop reaches them).
        """
        assert self._tasks.running, "use the reactor inside `async with`"
        state = await self._load_snapshot()
        pending: list[Effect] = []
        for record in await self.log.read(state.seq + 1):
            result = fold(state, record)
            state = result.state
            pending.extend(result.effects)
        self._state = state
        log.info("reactor_resumed", job=self.log.job, seq=state.seq, phase=state.phase.value,
                 pending_effects=len(pending))
        if before_acting is not None:
            await before_acting(state)
        queue: collections.deque[Record] = collections.deque()
        await self._act(pending, queue, resuming=True)
        await self._process(queue)
        self._arm_timers()
        self._tasks.start(self._serve, name=f"reactor:{self.log.job}")
        self._notify()
        return self._state

    async def _load_snapshot(self) -> JobState:
        try:
            snapshot = await self.log.load_snapshot()
            if snapshot is None:
                return JobState()
            state = from_json(JobState, snapshot.body["state"])
            older_timers = snapshot.body.get("timers")  # snapshots before timers were part of the state
            if older_timers and not state.timers:
                state = dataclasses.replace(state, timers=from_json(JobState, {"timers": older_timers}).timers)
            return state
        except (LogCorrupt, CodecError, KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("snapshot_unusable", job=self.log.job, error=str(exc), action="replaying the whole log")
            return JobState()

    # -- submissions --------------------------------------------------------------

    async def submit(self, event: Event) -> Record:
        """Persist ``event`` and apply it with everything it causes; returns its record."""
        (record,) = await self.submit_many([event])
        return record

    async def submit_many(self, events: Sequence[Event]) -> list[Record]:
        """Persist ``events`` with consecutive seqs, then apply them in order (a cancelled caller's events too).

        Raises CodecError or WriteTooLarge, with nothing recorded, when one of them cannot be encoded or they are
        more than one store write takes.
        """
        if self._stopped is not None:
            raise ReactorStopped(f"the master of job {self.log.job!r} has stopped: {self._stopped}")
        encoded = [self.log.encode(event) for event in events]
        cost = sum(self.log.cost(e) for e in encoded)
        if cost > self.log.append_budget:
            raise WriteTooLarge(f"{len(encoded)} events submitted together to job {self.log.job!r} take {cost} "
                                f"bytes, more than one write to {self.log.store.url} takes "
                                f"({self.log.append_budget} bytes for records); nothing was recorded: submit them "
                                "in smaller groups")
        submission = _Submission(encoded, asyncio.get_running_loop().create_future(), cost)
        self._inbox.append(submission)
        self._wake.set()
        return await asyncio.shield(submission.done)

    async def _serve(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._inbox:
                    await self._take_batch()
        except BaseException as exc:
            self._stopped = exc
            self._notify()
            raise

    async def _take_batch(self) -> None:
        batch = next(_batches(self._inbox, count=lambda s: len(s.events), cost=lambda s: s.cost,
                              budget=self.log.append_budget))
        for _ in batch:
            self._inbox.popleft()
        try:
            records = await self.log.append_many([e for s in batch for e in s.events])
        except LogConflict:
            raise  # another master writes this log: this one must stop
        except SteadError as exc:  # nothing was persisted: the caller gets the error (and may retry)
            if len(batch) == 1:
                _settle(batch[0].done, exc=exc)
            else:  # one bad event (not encodable, too large for the store) must not fail the others
                self._inbox.extendleft(reversed(batch))
                await self._take_one()
            return
        await self._apply(batch, records)

    async def _take_one(self) -> None:
        submission = self._inbox.popleft()
        try:
            records = await self.log.append_many(submission.events)
        except LogConflict:
            raise
        except SteadError as exc:
            _settle(submission.done, exc=exc)
            return
        await self._apply([submission], records)

    async def _apply(self, batch: list[_Submission], records: list[Record]) -> None:
        queue = collections.deque(records)
        try:
            await self._process(queue)
        except BaseException as exc:
            for submission in batch:
                _settle(submission.done, exc=ReactorStopped(f"the master failed while applying this event: {exc!r}"))
            raise
        at = 0
        for submission in batch:
            _settle(submission.done, result=records[at:at + len(submission.events)])
            at += len(submission.events)
        self._notify()  # after the submitters got their records: a waiter sees the whole submission applied

    def _fail_waiting(self, exc: BaseException) -> None:
        self._stopped = self._stopped or exc
        while self._inbox:
            _settle(self._inbox.popleft().done, exc=exc)
        self._notify()

    # -- the four steps -------------------------------------------------------------

    async def _process(self, queue: collections.deque[Record]) -> None:
        """Fold, act and tell for every record in ``queue`` and for the records they cause."""
        while queue:
            record = queue.popleft()
            result = fold(self._state, record)
            self._state = result.state
            if result.rejected is not None:
                log.warning("transition_rejected", job=self.log.job, seq=record.seq,
                            kind=record.event.type_name, reason=result.rejected)
                if not isinstance(record.event, TransitionRejected):
                    rejected = TransitionRejected(event_type=record.event.type_name, seq=record.seq,
                                                  reason=result.rejected)
                    queue.extend(await self._write(functools.partial(self.log.append_many, [rejected])))
            await self._act(result.effects, queue, resuming=False)
            self._tell(record)
            await self._maybe_snapshot()

    async def _act(self, effects: Sequence[Effect], queue: collections.deque[Record], *, resuming: bool) -> None:
        """Emits appended (in order), timers armed, the other effects run concurrently; what they record (emitted
        events, the failures) joins ``queue``."""
        others: list[Effect] = []
        for effect in effects:
            if isinstance(effect, StartTimer):
                continue  # armed from the state's timers
            if isinstance(effect, Emit):
                queue.extend(await self.journal.emit(effect, resuming=resuming))
            else:
                others.append(effect)
        self._arm_timers()
        if not others:
            return
        failures = await self.journal.run(others, resuming=resuming)
        if failures:
            queue.extend(await self._append_own(failures))

    async def _append_own(self, events: Sequence[Event]) -> list[Record]:
        """Append events of the loop's own (a round's EffectFailed, one per member), in as many writes as they
        take: each part is persisted before the next, and a failure stops the loop as any of its writes does."""
        encoded = [self.log.encode(event) for event in events]
        records: list[Record] = []
        for part in _batches(encoded, count=lambda _: 1, cost=self.log.cost, budget=self.log.append_budget):
            records += await self._write(functools.partial(self.log.append_many, part))
        return records

    def _tell(self, record: Record) -> None:
        for observer in self._observers:
            try:
                observer(record, self._state)
            except Exception:  # an observer (tracing) must never stop the job
                log.exception("observer_failed", job=self.log.job, seq=record.seq)
        if self.plugins is not None:
            self.plugins.deliver(record, self._state)

    async def _write(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A store call the loop cannot skip: retried while the store is away, fatal past the deadline."""
        return await retrying(call, self.settings, what=f"event log of job {self.log.job}")

    # -- timers ------------------------------------------------------------------------

    def _arm_timers(self) -> None:
        if not self._tasks.running:
            return
        for name, at in self._state.timers.items():
            if name not in self._scheduled:
                self._scheduled.add(name)
                self._tasks.start(self._fire, name, at, name=f"timer:{name}")

    async def _fire(self, name: TimerName, at: float) -> None:
        await self._clock.sleep_until(at)
        self._scheduled.discard(name)  # the machine may arm a timer of the same name again later
        if name in self._state.timers:
            try:
                await self.submit(TimerFired(name=name))
            except RetryableError as exc:  # the store is away: fire again once it is back, not in a tight loop
                pause = self._timer_backoff.next()
                log.warning("timer_not_recorded", job=self.log.job, timer=str(name), error=str(exc),
                            retry_in_s=round(pause, 2))
                self._scheduled.add(name)  # no second attempt at it while this one waits
                await self._clock.sleep(pause)
                self._scheduled.discard(name)
                self._arm_timers()
            else:
                self._timer_backoff.reset()

    # -- snapshots and waiting ------------------------------------------------------------

    async def _maybe_snapshot(self) -> None:
        self._since_snapshot += 1
        # a snapshot's size grows with the nodes: taken every snapshot_every records, or every 2 records per node
        # when there are more, its cost per record stays bounded (at 10,000 nodes, every 500 records was 40% of
        # the master's time while they joined), and a replay reads at most that many records more
        if self._since_snapshot < max(self.settings.snapshot_every, 2 * len(self._state.nodes)):
            return
        self._since_snapshot = 0
        await self._write(self.snapshot)

    async def snapshot(self) -> None:
        """Save the folded state so a restarted master replays only what follows; bound the store's history."""
        await self.log.save_snapshot(self._state.seq, {"state": to_json(self._state)})
        keep = self.settings.store_history_keep
        revision = await self.log.store.revision()
        if keep and revision > keep:
            await self.log.store.compact(revision - keep)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[JobState], bool], *, timeout_s: float = math.inf) -> JobState:
        """The state as soon as ``predicate`` holds for it; TimeoutError after ``timeout_s``."""
        with anyio.fail_after(timeout_s):
            while not predicate(self._state) and self._stopped is None:
                await self._changed.wait()
        if not predicate(self._state):
            raise ReactorStopped(f"the master of job {self.log.job!r} stopped ({self._stopped!r}) before "
                                 "the awaited state was reached")
        return self._state


def _batches(items: Iterable[T], *, count: Callable[[T], int], cost: Callable[[T], int],
             budget: int) -> Iterator[list[T]]:
    """``items`` in order, in groups of at most ``_MAX_BATCH`` events costing at most ``budget`` together (an item
    past either alone makes a group of its own); lazy, so that taking the first group reads no further."""
    group: list[T] = []
    events = spent = 0
    for item in items:
        n, c = count(item), cost(item)
        if group and (events + n > _MAX_BATCH or spent + c > budget):
            yield group
            group, events, spent = [], 0, 0
        group.append(item)
        events += n
        spent += c
    if group:
        yield group


def _settle(future: asyncio.Future[list[Record]], *, result: list[Record] | None = None,
            exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
        future.exception()  # a caller that went away must not leave "exception never retrieved" behind
    else:
        future.set_result(result or [])
