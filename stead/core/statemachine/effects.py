"""Effects: what a transition asks the world to do, as data.

Each effect has a deterministic id derived from what it does, so the reactor
can record which ids ran and never run one twice, even across master restarts,
and a ``kind`` that names it in an ``EffectFailed`` event. ``ref`` is the id as a
typed value (:data:`~stead.core.events.names.EffectId`, what ``EffectFailed`` carries);
``id`` its string form (the store's effect keys, the agents' command ids).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

from stead.core.events import (
    CheckHealthId,
    DumpStacksId,
    EmitId,
    Event,
    KillId,
    LaunchId,
    StartWorkersId,
    StopNodeId,
    StopWorkersId,
    TimerId,
    TimerName,
)

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
    def ref(self) -> LaunchId:
        return LaunchId(node_id=self.node_id, incarnation=self.incarnation)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KillNode:
    node_id: str
    incarnation: int

    kind: ClassVar[str] = "kill-node"

    @property
    def ref(self) -> KillId:
        return KillId(node_id=self.node_id, incarnation=self.incarnation)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


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
    def ref(self) -> StartWorkersId:
        return StartWorkersId(round=self.round, node_id=self.node_id)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopWorkers:
    node_id: str
    incarnation: int
    round: int
    reason: str

    kind: ClassVar[str] = "stop-workers"

    @property
    def ref(self) -> StopWorkersId:
        return StopWorkersId(round=self.round, node_id=self.node_id)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


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
    def ref(self) -> DumpStacksId:
        return DumpStacksId(request=self.request, node_id=self.node_id)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


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
    def ref(self) -> CheckHealthId:
        return CheckHealthId(check=self.check, node_id=self.node_id)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopNode:
    """Ask a node's agent to stop its workers and exit (the job has ended)."""

    node_id: str
    incarnation: int
    reason: str

    kind: ClassVar[str] = "stop-node"

    @property
    def ref(self) -> StopNodeId:
        return StopNodeId(node_id=self.node_id, incarnation=self.incarnation)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartTimer:
    """Deliver ``TimerFired(name)`` at wall-clock time ``at``."""

    name: TimerName
    at: float

    kind: ClassVar[str] = "start-timer"

    @property
    def ref(self) -> TimerId:
        return TimerId(timer=self.name)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Emit:
    """Append a follow-up event (``key`` makes the id deterministic)."""

    key: str
    event: Event

    kind: ClassVar[str] = "emit"

    @property
    def ref(self) -> EmitId:
        return EmitId(key=self.key)

    @functools.cached_property
    def id(self) -> str:
        return str(self.ref)


Effect = (LaunchNode | KillNode | StartWorkers | StopWorkers | StopNode | DumpStacks | CheckHealth | StartTimer
          | Emit)

AgentOrder = StartWorkers | StopWorkers | StopNode
"""A command an agent is told until it acknowledges it, a new master included (see :mod:`.commands`).

Stored in the job state's snapshot: decoding tries the kinds in this order, each one's fields a set the next
ones' are not (a start has no ``reason``, a stop of workers has a ``round``), so keep the order."""
