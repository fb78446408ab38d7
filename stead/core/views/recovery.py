"""One typed view of a job's recoveries, folded from its event log. Pure.

Tracing (:mod:`stead.core.views.tracing`), the goodput ledger (:mod:`stead.core.views.goodput`), the
metrics and the report all read recoveries from :class:`RecoveryFold`, so they tell one story.

A recovery begins with a failure of the running round (the round last started, before its
workers finished):

- ``WorkerFailed`` of that round: phases ``detect`` (the agent saw the worker end -> the record;
  none long when it did not say when), then ``decide``;
- ``NodeLost`` or ``NodeExited`` of one of its members (a killed agent is recorded as exited, at
  once, never as lost): straight to ``restart`` (the job machine relaunches it, no decision);
- ``RestartRequested`` or ``RelaunchRequested`` of it (a hang, a straggler): ``detect`` (the time
  since the last step report: the detector's latency), then ``restart``.

It goes on through the phases of :class:`RecoveryPhase` and ends at the first step report of the
round it restarted into (:attr:`RecoveryOutcome.RECOVERED`), at the job's end (``succeeded``,
``failed``, ``stopped``: a recovery the job never finished), at the job's resumption under a new
runner (``resumed``), or at a failure of the round it restarted into (``interrupted``): that second
fault begins a recovery of its own, so each recovery has one cause and its phases in order. A
failure of the round that already failed (another rank of it, the lost node's agent exiting) is the
same failure seen again and changes nothing.

``detect`` never starts before the job was submitted (or resumed), its last step report, or the
phase it interrupts: a worker cannot have ended before the log shows it alive, so an agent's clock
ahead of the master's shortens ``detect`` instead of overlapping what came before. Phases tile a
recovery: each begins where the one before ended, and they add up to its length.

Settled here (tracing and the ledger disagreed before this fold): a member's ``NodeExited`` and a
plugin's restart or relaunch request start a recovery (the ledger counted them, tracing did not);
a failure before the job's first step starts one too (tracing counted it, the ledger called it
start-up); a late step report of the failed round does not end a recovery (the ledger ended it).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping

from stead.core.events import (
    CheckpointRestored,
    JobFailed,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    NodeExited,
    NodeLost,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RelaunchRequested,
    RestartRequested,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    WorkerFailed,
    WorkersSucceeded,
)

__all__ = ["Failure", "Folded", "PhaseSpan", "Recovery", "RecoveryCause", "RecoveryFold", "RecoveryOutcome",
           "RecoveryPhase", "recoveries"]

#: the events that begin a recovery
Failure = WorkerFailed | NodeLost | NodeExited | RestartRequested | RelaunchRequested


class RecoveryPhase(enum.StrEnum):
    """A recovery's phases, in order (the values are the span names, JSON keys and report labels)::

        WorkerFailed ---> [DETECT] -> DECIDE --RecoveryDecided--> RESTART
        NodeLost, NodeExited -----------------------------------> RESTART
        Restart/RelaunchRequested -> [DETECT] ------------------> RESTART
        DECIDE, RESTART --RoundStarted--> RENDEZVOUS --RoundCompleted--> FIRST_STEP --StepProgress--> (recovered)

    A round started again before the first step (it grew by a late node) goes back to RENDEZVOUS; a step
    report of the new round ends the recovery from any phase.
    """

    DETECT = "detect"
    DECIDE = "decide"
    RESTART = "restart"
    RENDEZVOUS = "rendezvous"
    FIRST_STEP = "first_step"


class RecoveryCause(enum.StrEnum):
    """What began a recovery (the value is the trace's ``stead.cause``)."""

    WORKER_FAILED = "worker_failed"
    NODE_LOST = "node_lost"
    NODE_EXITED = "node_exited"
    RESTART_REQUESTED = "restart_requested"
    RELAUNCH_REQUESTED = "relaunch_requested"


class RecoveryOutcome(enum.StrEnum):
    """How a recovery ended (the value is the trace's ``stead.outcome``); ONGOING: it has not."""

    RECOVERED = "recovered"
    INTERRUPTED = "interrupted"
    RESUMED = "resumed"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    ONGOING = "ongoing"


_CAUSES: Mapping[type[Failure], RecoveryCause] = {
    WorkerFailed: RecoveryCause.WORKER_FAILED, NodeLost: RecoveryCause.NODE_LOST,
    NodeExited: RecoveryCause.NODE_EXITED, RestartRequested: RecoveryCause.RESTART_REQUESTED,
    RelaunchRequested: RecoveryCause.RELAUNCH_REQUESTED,
}
_ENDS: Mapping[type[JobSucceeded | JobFailed | JobStopped], RecoveryOutcome] = {
    JobSucceeded: RecoveryOutcome.SUCCEEDED, JobFailed: RecoveryOutcome.FAILED, JobStopped: RecoveryOutcome.STOPPED,
}


@dataclasses.dataclass(frozen=True)
class PhaseSpan:
    """``phase`` from ``start`` to ``end`` (wall-clock seconds, from the log's record times)."""

    phase: RecoveryPhase
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One recovery: its failure, the round it hit, its phases in order and how it ended."""

    failure: Failure
    #: the round the failure hit
    round: int
    #: its phases, each beginning where the one before ended (a phase it skipped has none)
    spans: tuple[PhaseSpan, ...]
    outcome: RecoveryOutcome
    #: the round it restarted into (None before one started)
    new_round: int | None = None
    #: what was decided for a worker failure (None: no decision recorded)
    action: RecoveryAction | None = None
    #: the step the new round first reported (None before it did)
    first_step: int | None = None
    #: the decision's failure class and rule, e.g. ``numerical (replica-mismatch)`` ("" where none was given)
    decided: str = ""
    #: what the new round's workers restored and from where, e.g. ``step 41: memory 1, peer 1`` ("": not reported)
    restored: str = ""

    @property
    def cause(self) -> str:
        """The failure in words, as ``stead status`` and the report show it."""
        event = self.failure
        match event:
            case WorkerFailed():
                said = f": {self.decided}" if self.decided else ""
                return f"worker failed on {event.node_id} (rank {event.rank}){said}"
            case NodeLost():
                return f"node {event.node_id} lost: {event.reason}"
            case NodeExited():
                how = f"signal {event.signal}" if event.signal is not None else f"exit code {event.exit_code}"
                return f"node {event.node_id} exited ({how})"
            case RestartRequested() | RelaunchRequested():
                return f"{event.by}: {event.reason}"

    @property
    def kind(self) -> RecoveryCause:
        return _CAUSES[type(self.failure)]

    @property
    def at(self) -> float:
        """When its first phase began: the failure (a crash's exit, a hang's last step report) or its record."""
        return self.spans[0].start

    @property
    def end(self) -> float:
        return self.spans[-1].end

    @property
    def seconds(self) -> float:
        return self.end - self.at

    @property
    def phases(self) -> dict[RecoveryPhase, float]:
        """Seconds per phase, in the order they first came (a phase gone through twice is summed)."""
        totals: dict[RecoveryPhase, float] = {}
        for span in self.spans:
            totals[span.phase] = totals.get(span.phase, 0.0) + span.seconds
        return totals

    @property
    def ended(self) -> bool:
        """It reached the new round's first step."""
        return self.outcome is RecoveryOutcome.RECOVERED


@dataclasses.dataclass(frozen=True)
class Folded:
    """What one record did: the recoveries it ended (an interrupted one and its successor's start can come
    together) and the one it began."""

    closed: tuple[Recovery, ...] = ()
    began: Recovery | None = None


@dataclasses.dataclass
class _Open:
    failure: Failure
    round: int
    spans: list[PhaseSpan]
    phase: RecoveryPhase
    since: float
    new_round: int | None = None
    action: RecoveryAction | None = None
    decided: str = ""
    restored: str = ""
    #: the decision's restore bound (a replica mismatch's: the last step whose fingerprints agreed)
    bound: int | None = None

    def enter(self, phase: RecoveryPhase, at: float) -> None:
        at = max(at, self.since)
        self.spans.append(PhaseSpan(self.phase, self.since, at))
        self.phase, self.since = phase, at

    def view(self, outcome: RecoveryOutcome, until: float, first_step: int | None = None) -> Recovery:
        last = PhaseSpan(self.phase, self.since, max(until, self.since))
        return Recovery(failure=self.failure, round=self.round, spans=(*self.spans, last), outcome=outcome,
                        new_round=self.new_round, action=self.action, first_step=first_step, decided=self.decided,
                        restored=self.restored)


class RecoveryFold:
    """Feed it a job's records in log order (:meth:`apply`); it says when a recovery begins and ends.

    A fold that starts in the middle of a log (a master that took over) knows no round until the next
    one starts (or it is told, :meth:`join`), and begins no recovery before then.
    """

    def __init__(self) -> None:
        self._open: _Open | None = None
        #: the round last started, its members, and whether its workers are still meant to run
        self._round: int | None = None
        self._members: tuple[str, ...] = ()
        self._finishing = False
        self._ended = False
        #: no failure began before this: the job's submission or its last step report
        self._floor = float("-inf")
        self._last_at = float("-inf")

    @property
    def current(self) -> Recovery | None:
        """The recovery under way, its last phase up to the last record; None when none is."""
        return self.ongoing(self._last_at)

    def ongoing(self, until: float) -> Recovery | None:
        """The recovery under way, its last phase up to ``until``; None when none is."""
        if self._open is None:
            return None
        return self._open.view(RecoveryOutcome.ONGOING, until)

    def join(self, round_: int, members: tuple[str, ...]) -> None:
        """A fold that starts in the middle of a log: ``round_`` (of ``members``) runs; no effect once it read a
        record."""
        if self._last_at == float("-inf") and round_ > 0:
            self._round, self._members = round_, members

    def apply(self, record: Record) -> Folded:
        event, at = record.event, record.at
        self._last_at = max(self._last_at, at)
        rec = self._open
        match event:
            case JobSubmitted():  # (JobResumed too): a new runner starts the job again
                self._round, self._members, self._finishing, self._ended, self._floor = None, (), False, False, at
                if rec is not None:
                    self._open = None
                    return Folded(closed=(rec.view(RecoveryOutcome.RESUMED, at),))
            case JobSucceeded() | JobFailed() | JobStopped():
                self._round, self._ended = None, True
                if rec is not None:
                    self._open = None
                    return Folded(closed=(rec.view(_ENDS[type(event)], at),))
            case RoundStarted() if not self._ended:  # (a round recorded after the job's end starts nothing)
                self._round, self._members, self._finishing = event.round, event.members, False
                if rec is not None and event.round > max(rec.round, rec.new_round or 0):
                    rec.new_round = event.round
                    if rec.phase is not RecoveryPhase.RENDEZVOUS:
                        rec.enter(RecoveryPhase.RENDEZVOUS, at)
            case RoundCompleted() if rec is not None and rec.phase is RecoveryPhase.RENDEZVOUS:
                if event.round == rec.new_round:
                    rec.enter(RecoveryPhase.FIRST_STEP, at)
            case RecoveryDecided() if rec is not None and rec.phase is RecoveryPhase.DECIDE:
                if event.round == rec.round:
                    rec.action = event.action
                    rec.decided = f"{event.failure_class} ({event.rule})" if event.failure_class else ""
                    rec.bound = event.restore_at_most
                    rec.enter(RecoveryPhase.RESTART, at)
            case CheckpointRestored() if rec is not None and event.round == rec.new_round:
                rec.restored = restored_from(event) + (
                    f" (bounded to step {rec.bound} or before: replicas' fingerprints last agreed there)"
                    if rec.bound is not None else "")
            case StepProgress():
                self._floor = max(self._floor, at)
                if rec is not None and event.round == rec.new_round:
                    self._open = None
                    return Folded(closed=(rec.view(RecoveryOutcome.RECOVERED, at, first_step=event.step),))
            case WorkersSucceeded() if event.round == self._round:
                self._finishing = True
            case WorkerFailed() | NodeLost() | NodeExited() | RestartRequested() | RelaunchRequested():
                if self._hits_running_round(event):
                    return self._begin(event, at)
            case _:
                pass
        return Folded()

    def _hits_running_round(self, event: Failure) -> bool:
        if self._round is None or self._finishing:
            return False
        rec = self._open
        if rec is not None and rec.new_round != self._round:
            return False  # the round that failed, seen failing again: the same recovery
        match event:
            case WorkerFailed() | RestartRequested():
                return event.round == self._round
            case NodeLost() | NodeExited() | RelaunchRequested():
                return event.node_id in self._members

    def _begin(self, event: Failure, at: float) -> Folded:
        interrupted = self._open
        floor = self._floor if interrupted is None else max(self._floor, interrupted.since)
        start = at
        if isinstance(event, WorkerFailed):
            phase = RecoveryPhase.DECIDE
            if event.exited_at is not None and event.exited_at <= at:
                start = max(event.exited_at, floor)
        elif isinstance(event, (RestartRequested, RelaunchRequested)):
            phase = RecoveryPhase.RESTART
            start = floor if floor > float("-inf") else at
        else:
            phase = RecoveryPhase.RESTART
        start = min(start, at)
        assert self._round is not None
        rec = _Open(failure=event, round=self._round, spans=[], phase=phase, since=at)
        if phase is not RecoveryPhase.RESTART or start < at:  # (a worker's failure is detected, if at once)
            rec.phase, rec.since = RecoveryPhase.DETECT, start
            rec.enter(phase, at)
        self._open = rec
        closed = (interrupted.view(RecoveryOutcome.INTERRUPTED, start),) if interrupted is not None else ()
        return Folded(closed=closed, began=rec.view(RecoveryOutcome.ONGOING, at))


def restored_from(event: CheckpointRestored) -> str:
    """``step 41: memory 1, peer 1`` (ranks per tier: their own memory, a peer host's replica, disk; or resharded
    from the old ranks' slots in memory when the world size changed), and how the step stands to the newest
    replicated step R and the newest commit where the record says: ``(replicated)``,
    ``(newer than replicated step 40)``, ``(replicated; the newest commit, 42, was not)``, ``(older than replicated
    step 40: no copy of it was left)``."""
    if event.step < 0:
        return "nothing (a fresh start)"
    tiers = [f"{name} {count}" for name, count in (("memory", event.memory_ranks), ("peer", event.peer_ranks),
                                                    ("disk", event.disk_ranks)) if count]
    if event.resharded_ranks:
        tiers.insert(0, f"resharded from memory {event.resharded_ranks} (the old ranks' slots read: own memory "
                        f"{event.reshard_own_parts}, peer replicas {event.reshard_peer_parts}, other nodes "
                        f"{event.reshard_remote_parts})")
    said = f"step {event.step}: {', '.join(tiers)}" if tiers else f"step {event.step}"
    replicated = event.replicated_step
    if replicated < 0:
        return said
    if event.step > replicated:
        return f"{said} (newer than replicated step {replicated})"
    if event.step < replicated:
        return f"{said} (older than replicated step {replicated}: no copy of it was left)"
    if event.committed_step > replicated:
        return f"{said} (replicated; the newest commit, {event.committed_step}, was not yet)"
    return f"{said} (replicated)"


def recoveries(records: Iterable[Record], *, now: float | None = None) -> list[Recovery]:
    """Every recovery of a job's records (in log order); one under way runs to ``now`` (else the last record)."""
    fold = RecoveryFold()
    found: list[Recovery] = []
    for record in records:
        found.extend(fold.apply(record).closed)
    ongoing = fold.current if now is None else fold.ongoing(now)
    return [*found, *([ongoing] if ongoing is not None else [])]
