"""The job's state: what the job machine (:mod:`.job`) folds its events into. Frozen; changed with replace.

The values every part of the machine reads, and nothing that acts on them: the modules that do (:mod:`.health`,
:mod:`.membership`, :mod:`.rounds`, :mod:`.commands`, ...) import this one, never the other way round.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from stead.core.events import JobSubmitted, NodeHealthReported, RestoreBound, TimerName, WorkerFailed
from stead.core.statemachine.effects import AgentOrder
from stead.core.statemachine.node import NodePhase, NodeState, is_ready
from stead.core.statemachine.rendezvous import RendezvousState

__all__ = ["HealthState", "JobPhase", "JobState"]


class JobPhase(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthState:
    """The nodes' health checks (run by :mod:`.health`)."""

    #: the number of the latest check (0 before the first)
    check: int = 0
    #: the running check's nodes, in order (their index is their place in the pairings); () when none runs
    nodes: tuple[str, ...] = ()
    #: each node's incarnation when the check started
    incarnations: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: the nodes under check (the others are partners that already train)
    checked: frozenset[str] = frozenset()
    reports: Mapping[str, NodeHealthReported] = dataclasses.field(default_factory=dict)

    @property
    def running(self) -> bool:
        return bool(self.nodes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobState:
    phase: JobPhase = JobPhase.NEW
    spec: JobSubmitted | None = None
    nodes: Mapping[str, NodeState] = dataclasses.field(default_factory=dict)
    rdzv: RendezvousState = dataclasses.field(default_factory=RendezvousState)
    restarts: int = 0
    #: a worker failure of the current round waits for the diagnosis' decision
    awaiting_decision: bool = False
    last_failure: WorkerFailed | None = None
    step: int | None = None
    checkpoint_step: int | None = None
    reason: str = ""
    message: str = ""
    #: the running plugins that decide worker failures; None until a master announced its plugins
    deciders: frozenset[str] | None = None
    #: armed timers: name -> wall-clock time it fires
    timers: Mapping[TimerName, float] = dataclasses.field(default_factory=dict)
    #: how many times the job was resumed (``JobResumed``): once-per-run effects are keyed by it
    life: int = 0
    #: each node's incarnation when the job was last resumed: its relaunch budget counts from there
    resumed_at: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: hosts a relaunch decision excluded (a faulty GPU, say): relaunched nodes avoid them
    excluded_hosts: frozenset[str] = frozenset()
    #: steps every rank skips (their batches caused a numerical fault), as the recovery decisions said: every
    #: round's workers are told (``StartWorkers``)
    skip_steps: frozenset[int] = frozenset()
    #: the replica mismatches' bounds on what a restore may take (every round's workers are told them all)
    restore_bounds: tuple[RestoreBound, ...] = ()
    #: ``numerics.reported`` records so far (the master records a bounded number of them)
    numerics_reports: int = 0
    #: the nodes' health checks (see :mod:`.health`)
    health: HealthState = dataclasses.field(default_factory=HealthState)
    #: the nodes the job aims at, as the scaler last decided (None: the spec's start_nodes, else MAX)
    target: int | None = None
    #: nodes stopped because the job shrank: never relaunched (requested again when it grows)
    retired: frozenset[str] = frozenset()
    #: the running round changes size at the next checkpoint commit (or when resize_wait_s runs out)
    resizing: bool = False
    #: nodes killed for using too much memory whose relaunch waits for their resources to be decided
    #: (NodeResourcesDecided, or decision_timeout_s)
    awaiting_resources: frozenset[str] = frozenset()
    #: node id -> the command its agent was last given and has not acknowledged (see :mod:`.commands`)
    commands: Mapping[str, AgentOrder] = dataclasses.field(default_factory=dict)
    #: seq of the last event folded in (0 before any)
    seq: int = 0

    @property
    def joined(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.nodes.items() if s.phase is NodePhase.JOINED)

    @property
    def target_nodes(self) -> int:
        """The nodes the job aims at now (see :mod:`.membership`): the scaler's last decision, else the spec's
        ``start_nodes`` (MAX when unset); 0 before the job was submitted."""
        if self.spec is None:
            return 0
        return self.target if self.target is not None else (self.spec.start_nodes or self.spec.max_nodes)

    @property
    def end_key(self) -> str:
        """The emission key of the job's end: one per run of the job (a resumed job ends again)."""
        return "job-end" if self.life == 0 else f"job-end/{self.life}"

    @property
    def ready(self) -> tuple[str, ...]:
        """The joined nodes that may train: no health check pending for them."""
        return tuple(n for n, s in self.nodes.items() if is_ready(s))
