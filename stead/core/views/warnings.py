"""The warnings a job got that it would be stopped soon (Slurm's time limit's warning), for `stead status`.

Read from the log: each node's report of a warning (``job.warned``, grouped into warnings by
:func:`~stead.core.events.group_warnings`), the round's members then (``round.started``: how many nodes were to
hear it), the step the nodes persisted on it (the one the checkpoint plugin's master names to every warned node of
the round), the first time that step or a newer one was whole on disk (``ckpt.persisted``: every rank's shard of
it written), and whether that was only the stop's persist (the job ended first: the warning's own persist left no
whole step). The last :data:`SHOWN` warnings are shown.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from stead.core.events import (
    CheckpointPersisted,
    JobFailed,
    JobStopped,
    JobSucceeded,
    JobWarned,
    Record,
    RoundStarted,
    group_warnings,
)

__all__ = ["SHOWN", "warning_lines"]

#: the warnings status shows at most (the newest)
SHOWN = 3
#: how a warning's source is named in a line
_SOURCES = {"slurm": "Slurm"}


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def warning_lines(records: Iterable[Record], *, shown: int | None = SHOWN) -> list[str]:
    """One line per warning, oldest first (the last ``shown``; None: all): when it came, the time it left, the
    nodes that reported it of the round's members, and whether the step committed then was persisted."""
    members: dict[int, int] = {}
    started: dict[int, int] = {}  # round -> the seq of its (newest) start
    warned: list[tuple[Record, JobWarned]] = []
    persisted: list[tuple[Record, CheckpointPersisted]] = []
    ended: list[int] = []
    for record in records:
        event = record.event
        if isinstance(event, RoundStarted):
            members[event.round] = len(event.members)
            started[event.round] = record.seq
        elif isinstance(event, JobWarned):
            warned.append((record, event))
        elif isinstance(event, CheckpointPersisted):
            persisted.append((record, event))
        elif isinstance(event, JobStopped | JobFailed | JobSucceeded):
            ended.append(record.seq)
    recorded_at = {id(event): record.seq for record, event in warned}
    lines = []
    for warning in group_warnings(event for _, event in warned):
        first = warning.first
        told = next((e for e in warning.nodes.values() if e.time_left_s is not None), first)
        source = _SOURCES.get(first.source, first.source)
        left = (f"{told.time_left_s} s left (time limit at {_clock(told.deadline)})" if told.deadline is not None
                else told.said or "time left not said")
        heard = len(warning.nodes)
        of = members.get(first.round, 0)
        nodes = f"warned on {heard} of {of} node{'s' if of > 1 else ''}" if of >= heard else (
            f"warned on {heard} node{'s' if heard > 1 else ''}")
        kept = _kept(warning.nodes.values(), first, recorded_at[id(first)], started.get(first.round, 0), persisted,
                     ended)
        lines.append(f"by {source} at {_clock(first.warned_at)}: {left}; {nodes}; {kept}")
    return lines if shown is None else lines[-shown:]


def _kept(reports: Iterable[JobWarned], first: JobWarned, since: int, round_seq: int,
          persisted: list[tuple[Record, CheckpointPersisted]], ended: list[int]) -> str:
    """What became of the warning's persist: the step the nodes persisted on it (the one the checkpoint plugin's
    master named to them all; else, from an agent that does not say, the step committed when the first node's report
    was recorded), and the first time after the warning (the wall clocks of the master and the agents) that a step that
    new was whole on disk (``ckpt.persisted``), or that only the stop's persist put one there (the job ended first),
    or that the round had it on disk already."""
    steps = sorted({e.persisted_step for e in reports if e.persisted_step is not None})
    wanted = steps[0] if steps else first.committed_step
    if wanted is None:
        return "no step committed yet to persist"
    differ = f" (the nodes persisted steps {', '.join(map(str, steps))})" if len(steps) > 1 else ""
    done = next(((r, p) for r, p in persisted if r.at >= first.warned_at and p.step >= wanted), None)
    if done is None:
        before = [p.step for r, p in persisted if r.seq > round_seq and p.step >= wanted]
        if before:
            return f"step {before[-1]} was on disk already{differ}"
        return f"no persist of step {wanted} or later recorded{differ}"
    kept = f"step {done[1].step} persisted at {_clock(done[0].at)}{differ}"
    if any(since < seq < done[0].seq for seq in ended):
        kept += " as the job ended (no whole step persisted on the warning)"
    return kept
