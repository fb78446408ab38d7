"""The warnings a job got that it would be stopped soon (Slurm's time limit's warning), for `stead status`.

Read from the log: each node's report of a warning (``job.warned``, grouped into warnings by
:func:`~stead.core.events.group_warnings`), the round's members then (``round.started``: how many nodes were to
hear it), and the first step persisted after it (``ckpt.persisted``: every rank's shard of the step on disk) that is
the step committed when the warning came, or a newer one, and whether that was only the stop's persist (the job
ended before it: the warning's own persist left no whole step). The last :data:`SHOWN` warnings are shown.
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
    warned: list[tuple[Record, JobWarned]] = []
    persisted: list[tuple[Record, CheckpointPersisted]] = []
    ended: list[int] = []
    for record in records:
        event = record.event
        if isinstance(event, RoundStarted):
            members[event.round] = len(event.members)
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
        since = recorded_at[id(first)]
        if first.committed_step is None:
            kept = "no step committed yet to persist"
        else:
            done = next(((r, p) for r, p in persisted if r.seq > since and p.step >= first.committed_step), None)
            if done is None:
                kept = f"no persist of step {first.committed_step} or later recorded"
            else:
                kept = f"step {done[1].step} persisted at {_clock(done[0].at)}"
                if any(since < seq < done[0].seq for seq in ended):
                    kept += " as the job ended (no whole step persisted on the warning)"
        lines.append(f"by {source} at {_clock(first.warned_at)}: {left}; {nodes}; {kept}")
    return lines if shown is None else lines[-shown:]
