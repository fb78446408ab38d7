"""Event kinds of numerical faults the workers report (``numerics.*``): loss spikes, steps skipped.

A worker writes a note (:mod:`stead.core.worker.notes`), its agent forwards the new ones with each report
(:mod:`stead.core.agent.notes`), and the master records them, at most :data:`MAX_NOTES_PER_REPORT` a report and
:data:`MAX_NUMERICS_RECORDS` reports a job (past that it counts what it drops, see the gateway). The decision to
skip a step is the ``recovery.decided`` event's ``skip_steps``; a ``step_skipped`` note says the workers did.

A replica mismatch's decision bounds the restore (``recovery.decided``'s ``restore_at_most``): the job state keeps
each bound as a :class:`RestoreBound` and every round's workers are told them all, so that no copy a corruption may
have reached is ever restored, in that round or any later one.
"""

from __future__ import annotations

import dataclasses

from stead.core.events.base import Event, EventMark, event_kind

__all__ = ["MAX_NOTES_PER_REPORT", "MAX_NUMERICS_RECORDS", "MAX_SAMPLE_RANGES", "MAX_SAMPLE_SETS", "NOTE_KINDS",
           "NumericsNote", "NumericsReported", "RestoreBound", "StepSamples"]

#: the notes one report carries at most (the agent sends the rest with its next reports)
MAX_NOTES_PER_REPORT = 32
#: the reports a job records at most; the master counts the notes of any later ones and drops them
MAX_NUMERICS_RECORDS = 200
#: ``loss_spike``: a rank's loss spiked (``action`` record or skip); ``step_skipped``: the workers skipped ``step``
NOTE_KINDS = ("loss_spike", "step_skipped")
#: the datasets a ``step_skipped`` note names at most, and the ranges it names of each (a note is one line of at most
#: 1 KiB, see :mod:`stead.core.worker.notes`; a dataset's samples past the ranges named are counted, not named)
MAX_SAMPLE_SETS = 4
MAX_SAMPLE_RANGES = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSamples:
    """The samples of one dataset that one rank's step trained on (or skipped), as stead's sampler handed them out.

    ``ranges`` are ``(part, start, end)`` slots of the sharding ledger: ``part`` an epoch and ``[start, end)``
    positions of that epoch's shuffled order (a dataset), or a partition and its offsets (a streaming source).
    ``count`` is every sample of the dataset the step held; the ranges name them all, or the first ones when they
    were more than :data:`MAX_SAMPLE_RANGES` ranges."""

    dataset: str
    count: int
    ranges: tuple[tuple[int, int, int], ...] = ()

    @property
    def named(self) -> int:
        """The samples the ranges name."""
        return sum(end - start for _, start, end in self.ranges)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NumericsNote:
    """One worker's note: what (``kind``, one of :data:`NOTE_KINDS`), on which global rank, at which step."""

    kind: str
    rank: int
    step: int
    #: a loss spike's loss, and the median of the recent losses it was judged against (None: not finite / none)
    loss: float | None = None
    median: float | None = None
    #: robust standard deviations above the median (None: a non-finite loss)
    score: float | None = None
    #: what the worker did: ``record`` (a warning) or ``skip`` (it failed the step for a rollback)
    action: str = ""
    #: the round the worker wrote it in (its report may come in a later round); None: not said
    round: int | None = None
    #: ``step_skipped``: the samples this rank's skipped step held, per dataset read with stead's sampler; None: not
    #: known (the script reads its data otherwise, or the note is of another kind)
    samples: tuple[StepSamples, ...] | None = None


@event_kind("numerics.reported", mark=EventMark.DIAGNOSIS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class NumericsReported(Event):
    """Notes of a node's workers in ``round``; ``dropped``: notes its agent refused or could not send (malformed,
    over its bounds)."""

    node_id: str
    round: int
    notes: tuple[NumericsNote, ...]
    dropped: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoreBound:
    """A replica mismatch seen in ``round``: the replicas' fingerprints last agreed at ``step``, and every step after it
    that the round saved may hold the corruption (the all-reduce spreads one rank's wrong gradients to every
    replica before the next fingerprint shows it). No copy of a step after ``step`` saved in ``round`` or an earlier
    round is restored again, from any tier; copies that later rounds saved are not concerned."""

    step: int
    round: int

    def excludes(self, step: int, round_: int) -> bool:
        """Whether the copy of ``step`` saved in ``round_`` may hold the corruption."""
        return step > self.step and round_ <= self.round
