"""Effects: what a transition asks the world to do, as data.

Each effect has a deterministic ``id`` derived from what it does, so the reactor
can record which ids ran and never run one twice, even across master restarts,
and a ``kind`` that names it in an ``EffectFailed`` event.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from stead.core.events import Event

__all__ = ["AgentOrder", "CheckHealth", "DumpStacks", "Effect", "Emit", "KillNode", "LaunchNode", "StartTimer",
           "StartWorkers", "StopNode", "StopWorkers"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchNode:
    node_id: str
    incarnation: int
    #: hosts to keep the node off (excluded as faulty)
    avoid_hosts: tuple[str, ...] = ()
    #: the agent joins once fully warm (see NodeRequested.warm_first)
    warm_first: bool = False
    #: what the platform gives it where that differs from the job's own (see NodeRequested.resources)
    resources: tuple[tuple[str, str], ...] = ()

    kind: ClassVar[str] = "launch-node"

    @property
    def id(self) -> str:
        return f"launch/{self.node_id}/{self.incarnation}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KillNode:
    node_id: str
    incarnation: int

    kind: ClassVar[str] = "kill-node"

    @property
    def id(self) -> str:
        return f"kill/{self.node_id}/{self.incarnation}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartWorkers:
    """Tell a node's agent to (re)start its workers for ``round`` with these ranks."""

    node_id: str
    incarnation: int
    round: int
    node_rank: int
    nnodes: int
    nproc_per_node: int
    restart_count: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    kind: ClassVar[str] = "start-workers"

    @property
    def id(self) -> str:
        return f"start-workers/{self.round}/{self.node_id}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopWorkers:
    node_id: str
    incarnation: int
    round: int
    reason: str

    kind: ClassVar[str] = "stop-workers"

    @property
    def id(self) -> str:
        return f"stop-workers/{self.round}/{self.node_id}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DumpStacks:
    """Ask a node's agent for its workers' Python stacks (answered by a ``StacksDumped`` event)."""

    node_id: str
    incarnation: int
    round: int
    reason: str
    #: the seq of the request it answers: every request gets its own dump
    request: int

    kind: ClassVar[str] = "dump-stacks"

    @property
    def id(self) -> str:
        return f"dump-stacks/{self.request}/{self.node_id}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckHealth:
    """Ask a node's agent to run its part of health check ``check`` (answered by a ``NodeHealthReported`` event)."""

    node_id: str
    incarnation: int
    check: int
    #: every node of the check, in pairing order
    nodes: tuple[str, ...]
    #: how long the node's part may take
    timeout_s: float

    kind: ClassVar[str] = "check-health"

    @property
    def id(self) -> str:
        return f"check-health/{self.check}/{self.node_id}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopNode:
    """Ask a node's agent to stop its workers and exit (the job has ended)."""

    node_id: str
    incarnation: int
    reason: str

    kind: ClassVar[str] = "stop-node"

    @property
    def id(self) -> str:
        return f"stop-node/{self.node_id}/{self.incarnation}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartTimer:
    """Deliver ``TimerFired(name)`` at wall-clock time ``at``."""

    name: str
    at: float

    kind: ClassVar[str] = "start-timer"

    @property
    def id(self) -> str:
        return f"timer/{self.name}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Emit:
    """Append a follow-up event (``key`` makes the id deterministic)."""

    key: str
    event: Event

    kind: ClassVar[str] = "emit"

    @property
    def id(self) -> str:
        return f"emit/{self.key}"


Effect = (LaunchNode | KillNode | StartWorkers | StopWorkers | StopNode | DumpStacks | CheckHealth | StartTimer
          | Emit)

AgentOrder = StartWorkers | StopWorkers | StopNode
"""A command an agent is told until it acknowledges it, a new master included (see :mod:`.commands`).

Stored in the job state's snapshot: decoding tries the kinds in this order, each one's fields a set the next
ones' are not (a start has no ``reason``, a stop of workers has a ``round``), so keep the order."""
