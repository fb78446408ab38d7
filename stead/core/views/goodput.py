"""The goodput ledger: a job's wall time split by what it was spent on, folded from its event log. Pure.

Wall time runs from the job's submission to its end (or ``now`` for a running job) and is
split, every second of it exactly once, into:

- ``useful``: steps whose work counts (a step recomputed after a rollback counts once);
- ``lost``: steps done and then thrown away, because a failure rolled the job back to an
  older checkpoint, or because they were never reported before the failure;
- ``recovery``: from a failure to the next round's first step, in phases ``detect`` (the
  failure happened -> the master knew), ``decide``, ``restart`` (-> the next round started,
  a relaunched node included), ``rendezvous`` (-> every worker started) and ``first_step``:
  the recoveries of :mod:`stead.core.views.recovery`, which tracing and the metrics read too;
- ``checkpoint``: phases a worker declared for checkpointing (``stead.phase("checkpoint")``,
  or any phase named ``ckpt``/``save``/``persist``), ``phases``: other declared phases (eval);
- ``waiting``: start-up, from the submission to the first step (nodes launched, joined,
  checked, the first round formed);
- ``idle``: the tail after the last worker finished, and the time between a job's end and
  its resumption.

Step progress reaches the log at most once per ``progress_interval_s``: the time after the
last report is counted when the next report (useful), a failure (lost) or the end (useful
up to the first node's success, idle after) says what it was. The same records give the
same ledger, from a live master's store or a finished job's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from stead.core.events import (
    CheckpointRestored,
    JobFailed,
    JobResumed,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    Record,
    StepProgress,
    WorkerFailed,
    WorkersSucceeded,
)
from stead.core.events.log import BadRecord
from stead.core.views.recovery import Recovery, RecoveryFold, RecoveryOutcome, RecoveryPhase, restored_from

__all__ = ["PARTS", "RECOVERY_PHASES", "Ledger", "Recovery", "ledger", "step_rates"]

PARTS = ("useful", "lost", "recovery", "checkpoint", "phases", "waiting", "idle")
#: the recovery phases' names, in order (:class:`~stead.core.views.recovery.RecoveryPhase`)
RECOVERY_PHASES = tuple(phase.value for phase in RecoveryPhase)
_CHECKPOINT_PHASES = ("checkpoint", "ckpt", "save", "persist")


@dataclasses.dataclass(frozen=True)
class Ledger:
    wall_s: float
    #: seconds per part of :data:`PARTS`; they add up to ``wall_s``
    parts: Mapping[str, float]
    #: seconds per recovery phase, all recoveries together
    recovery_phases: Mapping[RecoveryPhase, float]
    recoveries: tuple[Recovery, ...]
    #: steps that count (rolled-back ones excluded)
    useful_steps: int
    #: the job has ended (else the ledger runs to ``now``)
    ended: bool
    #: what could not be accounted for, in words (unreadable records, no step progress, ...)
    missing: tuple[str, ...]

    @property
    def goodput(self) -> float:
        """Useful time over wall time, 0..1 (0 before any wall time)."""
        return self.parts["useful"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        """``goodput`` (0..1), ``wall_s``, one ``<part>_s`` key per part, the recovery phases, and what is missing."""
        return {"goodput": round(self.goodput, 4), "wall_s": round(self.wall_s, 3),
                **{f"{part}_s": round(seconds, 3) for part, seconds in self.parts.items()},
                "recovery_phases_s": {k.value: round(v, 3) for k, v in self.recovery_phases.items()},
                "recoveries": len(self.recoveries), "useful_steps": self.useful_steps, "ended": self.ended,
                "missing": list(self.missing)}


@dataclasses.dataclass
class _Segment:
    """Steps (``after``, ``upto``] of one round and the seconds they took (moved to lost on a rollback)."""

    round: int
    after: int
    upto: int
    seconds: float


class _Fold:
    def __init__(self) -> None:
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.mode = "none"  # none | waiting | running | recovering | finishing | idle
        self.cursor: float | None = None
        self.start: float | None = None
        self.pending = 0.0  # running time since the last step report, not yet attributed
        self.segments: list[_Segment] = []
        self.round = 0
        self.last_step: int | None = None
        self.phase = ""
        self.restored: dict[int, int] = {}
        #: round -> what its workers restored and from where (:func:`restored_from`)
        self.restored_from: dict[int, str] = {}
        self.recoveries: list[Recovery] = []
        self.fold = RecoveryFold()
        self.ended = False
        self.missing: list[str] = []
        self.progress_seen = False
        #: the steps a failure cut short after the last report (counted lost until a restore shows them kept)
        self.unreported: _Segment | None = None
        #: (round, step) of rounds that went on past step 0 with nothing restored by stead: the script's own
        #: checkpoint, whose age stead does not know
        self.own_resumes: list[tuple[int, int]] = []

    # -- time ---------------------------------------------------------------------

    def advance(self, t: float) -> None:
        """Attribute the time since the cursor to what the job was doing."""
        if self.cursor is None:
            return
        t = max(t, self.cursor)
        span = t - self.cursor
        self.cursor = t
        if span <= 0:
            return
        match self.mode:
            case "running":
                self.pending += span
            case "recovering":
                self.parts["recovery"] += span
            case "waiting":
                self.parts["waiting"] += span
            case "finishing" | "idle":
                self.parts["idle"] += span

    def settle(self, part: str) -> None:
        """The running time since the last report was ``part``."""
        self.parts[part] += self.pending
        self.pending = 0.0

    # -- transitions -------------------------------------------------------------------

    def begin_recovery(self, recovery: Recovery) -> None:
        """A recovery began at ``recovery.at``: the time since was its detection, not steps or start-up."""
        assert self.cursor is not None
        late = max(0.0, self.cursor - recovery.at)
        if self.mode in ("waiting", "finishing"):  # (a failure before the first step, or as the workers end)
            self.parts["waiting" if self.mode == "waiting" else "idle"] -= late
        elif self.mode == "running":
            last = self.last_step or 0
            failed_step = recovery.failure.step if isinstance(recovery.failure, WorkerFailed) else None
            self.pending -= late
            self.unreported = _Segment(self.round, last, max(last, failed_step or last), self.pending)
            self.settle("lost")
        else:  # (a failure that interrupts a recovery: the time since it was recovery already)
            return
        self.parts["recovery"] += late
        self.mode = "recovering"

    def first_step(self, event: StepProgress) -> None:
        """A round's first step report: start-up or a recovery ends; a rollback throws work away."""
        self.settle("lost")  # another round began with no failure on record: the last report's work is gone
        if event.round not in self.restored and event.step > 0 and self.segments:
            self.own_resumes.append((event.round, event.step))
        restored = self.restored.get(event.round, event.step - 1)
        cut = self.unreported
        if cut is not None and cut.round < event.round and restored > cut.after:
            kept = restored - cut.after  # done after the last report, saved, not done again
            if restored <= cut.upto:
                share = cut.seconds * kept / (cut.upto - cut.after)
            else:  # the round goes on past what the failure said (a lost node says nothing): the saved steps took
                # their usual time, the rest of the time (a step cut short) is lost
                pace = next((s.seconds / (s.upto - s.after) for s in reversed(self.segments)
                             if s.round == cut.round and s.upto > s.after), None)
                share = cut.seconds if pace is None else min(cut.seconds, kept * pace)
            self.parts["lost"] -= share
            self.parts["useful"] += share
            self.segments.append(_Segment(cut.round, cut.after, cut.after + kept, share))
        self.unreported = None
        for segment in self.segments:  # (one that an earlier rollback emptied has nothing left to lose)
            if segment.round < event.round and segment.upto > max(segment.after, restored):
                redo = segment.upto - max(segment.after, restored)
                share = segment.seconds * redo / (segment.upto - segment.after)
                self.parts["useful"] -= share
                self.parts["lost"] += share
                segment.seconds -= share
                segment.upto = max(segment.after, restored)
        self.mode, self.round, self.last_step, self.phase = "running", event.round, event.step, event.phase

    def step(self, event: StepProgress) -> None:
        if self.phase:
            named = self.phase.lower()
            self.settle("checkpoint" if any(word in named for word in _CHECKPOINT_PHASES) else "phases")
        elif self.last_step is not None and event.step > self.last_step:
            self.segments.append(_Segment(event.round, self.last_step, event.step, self.pending))
            self.settle("useful")
        self.last_step = max(event.step, self.last_step or 0)
        self.phase = event.phase

    def apply(self, record: Record) -> None:
        event, at = record.event, record.at
        if isinstance(event, (JobSubmitted, JobResumed)):
            if self.start is None:
                self.start = self.cursor = at
            self.advance(at)
            if self.mode == "running":
                self.settle("lost")  # the previous run's runner died mid-round
            self.recoveries.extend(self.fold.apply(record).closed)
            self.mode, self.ended, self.round, self.last_step = "waiting", False, 0, None
            return
        if self.cursor is None:
            return  # nothing before the submission counts
        self.advance(at)
        folded = self.fold.apply(record)
        self.recoveries.extend(folded.closed)
        if folded.began is not None:
            self.begin_recovery(folded.began)
        match event:
            case StepProgress() if self.mode != "idle":  # a late report after the end changes nothing
                self.progress_seen = True
                recovered = any(r.outcome is RecoveryOutcome.RECOVERED for r in folded.closed)
                if recovered or self.mode == "waiting" or (self.mode != "recovering" and event.round != self.round):
                    self.first_step(event)
                elif self.mode == "running":
                    self.step(event)
            case WorkersSucceeded() if self.mode == "running":
                self.settle("useful")  # the steps after the last report, up to the first node's end
                self.mode = "finishing"
            case JobSucceeded() | JobFailed() | JobStopped():
                if self.mode == "running":
                    self.settle("useful" if isinstance(event, JobSucceeded) else "lost")
                self.mode, self.ended = "idle", True
            case CheckpointRestored():
                self.restored[event.round] = event.step
                self.restored_from[event.round] = restored_from(event)
                # the last rank's restore can be recorded after the round's first step report: that round went on
                # where stead's checkpoint left it, not the script's own
                self.own_resumes = [(r, s) for r, s in self.own_resumes if r != event.round]
            case _:
                pass

    def result(self, now: float | None) -> Ledger:
        if self.cursor is None:
            return Ledger(wall_s=0.0, parts=dict(self.parts), recovery_phases=dict.fromkeys(RecoveryPhase, 0.0),
                          recoveries=(),
                          useful_steps=0, ended=False, missing=(*self.missing, "the job was never submitted"))
        if not self.ended and now is not None:
            self.advance(now)
            if self.mode == "running":
                self.settle("useful")  # still stepping: the time since the last report, provisionally
        self.settle("lost")  # (nothing left by now: every way out of running settles what was pending)
        ongoing = self.fold.ongoing(self.cursor)
        recoveries = [r if r.restored or r.new_round not in self.restored_from
                      else dataclasses.replace(r, restored=self.restored_from[r.new_round])  # (recorded late)
                      for r in [*self.recoveries, *([ongoing] if ongoing is not None else [])]]
        phases = dict.fromkeys(RecoveryPhase, 0.0)
        for recovery in recoveries:
            for phase, seconds in recovery.phases.items():
                phases[phase] += seconds
        missing = list(self.missing)
        if self.own_resumes:
            round_, step = self.own_resumes[0]
            missing.append(f"{len(self.own_resumes)} round(s) went on where the script's own checkpoint left it "
                           f"(round {round_} at step {step}), stead restored nothing: the steps done again since that "
                           "checkpoint was written are not known, and count as useful")
        if not self.progress_seen:
            missing.append("no step progress was recorded: no time can be counted as useful")
        assert self.start is not None
        wall = self.cursor - self.start
        steps = sum(s.upto - s.after for s in self.segments)
        return Ledger(wall_s=wall, parts=dict(self.parts), recovery_phases=phases,
                      recoveries=tuple(recoveries), useful_steps=steps, ended=self.ended, missing=tuple(missing))


def ledger(records: Iterable[Record | BadRecord], *, now: float | None = None) -> Ledger:
    """The ledger of a job's records (in log order); ``now``: where a running job's wall time ends."""
    fold = _Fold()
    bad = 0
    for record in records:
        if isinstance(record, BadRecord):
            bad += 1
            continue
        fold.apply(record)
    if bad:
        fold.missing.append(f"{bad} unreadable record(s) were skipped; the figures around them may be off")
    return fold.result(now)


def step_rates(records: Iterable[Record | BadRecord]) -> list[tuple[int, float, float]]:
    """(round, time, steps per second since the round's previous report) for each step report after a round's
    first; a report that follows a declared phase (eval, a checkpoint) or no new step gives none."""
    rates: list[tuple[int, float, float]] = []
    before: Record | None = None
    for record in records:
        if not isinstance(record, Record) or not isinstance(record.event, StepProgress):
            continue
        event, last = record.event, before.event if before is not None else None
        if (before is not None and isinstance(last, StepProgress) and last.round == event.round and not last.phase
                and record.at > before.at and event.step > last.step):
            rates.append((event.round, record.at, (event.step - last.step) / (record.at - before.at)))
        before = record
    return rates
