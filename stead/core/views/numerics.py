"""The numerical faults of a job, for ``stead status``: steps skipped (decided and done), loss spikes, notes dropped,
restores bounded after a replica mismatch (decided, and the step restored).

Read from the log: the decisions' ``skip_steps`` and ``restore_at_most`` (``recovery.decided``), the workers' notes
(``numerics.reported``) and the restore that followed a bound (``ckpt.restored``). The last :data:`SHOWN` lines are
shown, with a count of the others.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable

from stead.core.events import (
    NOTE_KINDS,
    CheckpointRestored,
    NumericsNote,
    NumericsReported,
    Record,
    RecoveryDecided,
)

__all__ = ["SHOWN", "NumericsCounts", "numerics_counts", "numerics_lines"]

#: the lines status shows at most (the newest)
SHOWN = 10
_HOST = re.compile(r"on rank \d+ \(host ([^)]+)\)")
#: the host a ReplicaMismatchError blames ("replica mismatch: rank 1 (host h1) at step 8")
_ODD_HOST = re.compile(r"replica mismatch: rank \d+ \(host ([^)]+)\)")


def numerics_lines(records: Iterable[Record], *, shown: int | None = SHOWN) -> list[str]:
    """One line per step skipped, loss spike, restore bounded and batch of notes dropped, oldest first (the last
    ``shown``; None: all, as the HTML report shows them)."""
    lines: list[str] = []
    skips: dict[tuple[int, int], _Skip] = {}
    dropped = 0
    bounded: RecoveryDecided | None = None  # the last bound decided, until a later round restores
    for record in records:
        event = record.event
        if isinstance(event, RecoveryDecided) and event.restore_at_most is not None:
            bounded = event
            lines.append(_bound_line(event))
        elif isinstance(event, CheckpointRestored) and bounded is not None and event.round > bounded.round:
            lines.append(_bounded_restore_line(event, bounded))
            bounded = None
        if isinstance(event, RecoveryDecided) and event.skip_steps:
            host = _HOST.search(event.evidence)
            cause = "a loss spike" if event.rule == "loss-spike" else "a non-finite gradient"
            steps = ", ".join(map(str, event.skip_steps))
            lines.append(f"step {steps} skipped from round {event.round + 1} on: {cause} on rank {event.rank}"
                         f"{f' (host {host[1]})' if host else ''} ({event.rule})")
        elif isinstance(event, NumericsReported):
            for note in event.notes:
                round_ = event.round if note.round is None else note.round
                if note.kind != "step_skipped":
                    lines.append(_note_line(note, round_))
                    continue
                skip = skips.get((round_, note.step))
                if skip is None:  # every rank of the round says so: one line for them all, where the first said it
                    skip = skips[round_, note.step] = _Skip(round_, note.step, len(lines))
                    lines.append("")
                skip.add(note)
                lines[skip.line] = skip.text()
            dropped += event.dropped
    if shown is not None and len(lines) > shown:
        lines = [f"({len(lines) - shown} earlier: stead events --job JOB | grep -e numerics -e skip_steps)",
                 *lines[-shown:]]
    if dropped:
        lines.append(f"{dropped} note(s) of the workers dropped by their agents (malformed or over their bounds: "
                     "the agents' logs say which)")
    return lines


@dataclasses.dataclass(frozen=True)
class NumericsCounts:
    """A job's numerical faults in figures (its metrics)."""

    #: numerical faults decided, by the rule that matched (a NaN/Inf gradient, a loss spike, a replica mismatch, the
    #: budget spent, a repeat)
    faults: Counter[str]
    #: steps every rank skips, as decided
    steps_skipped: int
    #: the workers' notes recorded, by kind (:data:`NOTE_KINDS`), and those their agents dropped
    notes: Counter[str]
    notes_dropped: int
    #: restores bounded after a replica mismatch
    bounded_restores: int


def numerics_counts(records: Iterable[Record]) -> NumericsCounts:
    """The figures of :class:`NumericsCounts`, from the job's records."""
    faults: Counter[str] = Counter()
    notes: Counter[str] = Counter(dict.fromkeys(NOTE_KINDS, 0))
    skipped: set[int] = set()
    dropped = bounded = 0
    for record in records:
        event = record.event
        if isinstance(event, RecoveryDecided) and event.failure_class == "numerical":
            faults[event.rule or "unknown"] += 1
        if isinstance(event, RecoveryDecided):
            skipped.update(event.skip_steps)
            bounded += event.restore_at_most is not None
        elif isinstance(event, NumericsReported):
            notes.update(note.kind for note in event.notes)
            dropped += event.dropped
    return NumericsCounts(faults=faults, steps_skipped=len(skipped), notes=notes, notes_dropped=dropped,
                          bounded_restores=bounded)


#: the ranges of a dataset a skipped step's line names at most
_RANGES_SHOWN = 4


class _Skip:
    """The ranks' notes of one step skipped in one round, and the samples they held, as one line."""

    def __init__(self, round_: int, step: int, line: int) -> None:
        self.round, self.step, self.line = round_, step, line
        self.ranks: set[int] = set()
        self.unknown: set[int] = set()  # ranks whose samples are not known (no stead sampler)
        self.counts: Counter[str] = Counter()
        self.ranges: dict[str, set[tuple[int, int, int]]] = {}

    def add(self, note: NumericsNote) -> None:
        if note.rank in self.ranks:
            return  # the same rank again (a note forwarded twice)
        self.ranks.add(note.rank)
        if note.samples is None:
            self.unknown.add(note.rank)
            return
        for part in note.samples:
            self.counts[part.dataset] += part.count
            self.ranges.setdefault(part.dataset, set()).update(part.ranges)

    def text(self) -> str:
        says = f"rank {next(iter(self.ranks))} says" if len(self.ranks) == 1 else f"{len(self.ranks)} ranks say"
        held = [f"{count} samples (dataset {name}: {_slots(self.ranges[name], count)})"
                for name, count in sorted(self.counts.items())]
        if self.unknown == self.ranks:
            held.append("samples unknown (not read with stead's sampler)")
        elif self.unknown:
            who = f"rank {next(iter(self.unknown))}" if len(self.unknown) == 1 else f"{len(self.unknown)} ranks"
            held.append(f"samples of {who} unknown (not read with stead's sampler)")
        return (f"step {self.step} skipped by the workers of round {self.round} ({says})"
                f"{': ' + '; '.join(held) if held else ''}")


def _slots(ranges: set[tuple[int, int, int]], count: int) -> str:
    merged: list[tuple[int, int, int]] = []
    for part, start, end in sorted(ranges):
        if merged and merged[-1][0] == part and merged[-1][2] >= start:
            merged[-1] = (part, merged[-1][1], max(end, merged[-1][2]))
        else:
            merged.append((part, start, end))
    shown = ", ".join(f"{'' if i and merged[i - 1][0] == part else f'part {part} slots '}{start}-{end - 1}"
                      for i, (part, start, end) in enumerate(merged[:_RANGES_SHOWN]))
    more = [f"{len(merged) - _RANGES_SHOWN} more range(s)"] if len(merged) > _RANGES_SHOWN else []
    unnamed = count - sum(end - start for _, start, end in merged)
    if unnamed > 0:
        more.append(f"{unnamed} not named")
    return ", ".join([shown, *more]) if shown else ", ".join(more) or "none named"


def _note_line(note: NumericsNote, round_: int) -> str:
    loss = "not finite" if note.loss is None else f"{note.loss:.4g}"
    above = (f", {note.score:.1f} robust std above the median {note.median:.4g}"
             if note.score is not None and note.median is not None else "")
    done = {"skip": "rolled back, its batch skipped", "record": "recorded"}.get(note.action, note.action or "?")
    return f"loss spike at step {note.step} on rank {note.rank} (round {round_}): loss {loss}{above}; {done}"


def _bound_line(event: RecoveryDecided) -> str:
    host = _ODD_HOST.search(event.evidence)
    at = event.restore_at_most
    where = "the initial state" if at is not None and at < 0 else f"step {at}"
    return (f"restore bounded to {where} from round {event.round + 1} on: a replica mismatch on rank {event.rank}"
            f"{f' (host {host[1]})' if host else ''}, fingerprints last agreed there ({event.rule})")


def _bounded_restore_line(event: CheckpointRestored, bound: RecoveryDecided) -> str:
    if event.step < 0 and (bound.restore_at_most or 0) < 0:
        return f"round {event.round} started from the initial state, as bounded"
    if event.step < 0:
        return (f"round {event.round} restored nothing: no checkpoint at or before step {bound.restore_at_most} was "
                "left in memory or on disk; it started from the initial state")
    return f"round {event.round} restored step {event.step} (bounded to step {bound.restore_at_most} or before)"
