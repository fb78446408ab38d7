"""The event kind of a warning that the job will be stopped soon (``job.warned``): Slurm's time limit's warning.

A Slurm job asks for it with ``#SBATCH --signal=USR1@SECONDS`` (or ``B:USR1@SECONDS``), or someone sends it with
``scancel --signal=USR1``: SIGUSR1 reaches every process of the job's steps, so every node's agent gets it at about
the same moment. Each agent persists the newest committed step and reports what the warning announced (Slurm's
controller asked how long the job has left); the master records each node's report as one :class:`JobWarned`.

One event per node and warning, not one merged event per warning: the log is append-only and the nodes' reports
come one by one, so a merged event would either wait for every node (and be lost with a master that dies meanwhile)
or be written before the others' reports exist. A per-node record is durable at once and says which nodes heard
the warning; readers group the reports into warnings with :func:`group_warnings` (the master does the same to
record a node's report of a warning once, however often its agent retries).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from stead.core.events.base import Event, EventMark, event_kind

__all__ = ["MAX_WARNED_RECORDS", "MAX_WARNING_SAID_CHARS", "WARNING_SOURCES", "WARNING_SPREAD_S", "JobWarned",
           "JobWarning", "group_warnings", "same_warning"]

#: the ``job.warned`` events a master records at most (a warning is one a node; more is a flood, logged and dropped)
MAX_WARNED_RECORDS = 256
#: what a warning's source said, in characters at most
MAX_WARNING_SAID_CHARS = 300
#: who may send a warning stead knows: Slurm (its ``--signal`` before a time limit or a preemption)
WARNING_SOURCES = ("slurm",)
#: reports of one source whose nodes were warned within this many seconds of a warning's first report are that
#: warning (Slurm signals every step at once; the nodes' clocks and their scontrol answers differ by seconds)
WARNING_SPREAD_S = 60.0


@event_kind("job.warned", mark=EventMark.DIAGNOSIS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobWarned(Event):
    """Node ``node_id`` (``incarnation``, in ``round``) got ``signal`` from ``source`` at ``warned_at`` (its wall
    clock, seconds since the epoch): the job will be stopped soon, in ``time_left_s`` as the source said (None:
    not said), and the node's agent persists a committed step: ``persisted_step``, the one the checkpoint plugin's
    master names to every warned node of the round (None: none, or an agent without the plugin).
    ``committed_step`` is the master's newest committed step when it recorded the report (None: none yet)."""

    node_id: str
    incarnation: int
    round: int
    signal: str
    source: str
    warned_at: float
    time_left_s: int | None = None
    #: the source's words ("Slurm warned: time limit in ~118 s"), or what went wrong asking it
    said: str = ""
    committed_step: int | None = None
    persisted_step: int | None = None

    @property
    def deadline(self) -> float | None:
        """When the job will be stopped (seconds since the epoch), as the time left implies; None: not said."""
        return None if self.time_left_s is None else self.warned_at + self.time_left_s


def same_warning(first: JobWarned, other: JobWarned) -> bool:
    """Whether ``other`` reports the warning ``first`` reported (another node's report of it, or a retry)."""
    return other.source == first.source and abs(other.warned_at - first.warned_at) <= WARNING_SPREAD_S


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobWarning:
    """One warning: its first report, and each node's first report of it (the first one's included), by node."""

    first: JobWarned
    nodes: dict[str, JobWarned]


def group_warnings(events: Iterable[JobWarned]) -> list[JobWarning]:
    """The warnings ``events`` report, oldest first; a node's second report of a warning is left out."""
    warnings: list[JobWarning] = []
    for event in events:
        found = next((w for w in reversed(warnings) if same_warning(w.first, event)), None)
        if found is None:
            warnings.append(JobWarning(first=event, nodes={event.node_id: event}))
        else:
            found.nodes.setdefault(event.node_id, event)
    return warnings
