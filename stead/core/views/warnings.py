"""The warnings a job got that it would be stopped soon (Slurm's time limit's warning), for `stead status`.

Read from the log: each node's report of a warning (``job.warned``, grouped into warnings by
:func:`~stead.core.events.group_warnings`), the round's members then (``round.started``: how many nodes were to
hear it), and the first step persisted after it (``ckpt.persisted``: every rank's shard of the step on disk) that is
the step committed when the warning came, or a newer one. The last :data:`SHOWN` warnings are shown.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from stead.core.events import CheckpointPersisted, JobWarned, Record, RoundStarted, group_warnings

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
    persisted: list[tuple[int, CheckpointPersisted]] = []
    for record in records:
        event = record.event
        if isinstance(event, RoundStarted):
            members[event.round] = len(event.members)
        elif isinstance(event, JobWarned):
            warned.append((record, event))
        elif isinstance(event, CheckpointPersisted):
            persisted.append((record.seq, event))
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
        nodes = f"warned on {heard} of {of} nodes" if of >= heard else f"warned on {heard} nodes"
        since = recorded_at[id(first)]
        if first.committed_step is None:
            kept = "no step committed yet to persist"
        else:
            done = next((p for seq, p in persisted if seq > since and p.step >= first.committed_step), None)
            kept = (f"step {done.step} persisted" if done is not None
                    else f"no persist of step {first.committed_step} or later recorded")
        lines.append(f"by {source} at {_clock(first.warned_at)}: {left}; {nodes}; {kept}")
    return lines if shown is None else lines[-shown:]
