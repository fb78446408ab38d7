"""What the master must provide behind the agent RPC service, in plain Python types.

The master implements :class:`AgentBackend`; the RPC layer validates requests,
converts protobuf messages to the frozen dataclasses below (or to events) and
back, and maps errors to gRPC statuses. Protobuf types never leave ``stead.core.rpc``.

One convention for every report an agent sends (a worker failed, its workers
started or succeeded, its workers' stacks, its part of a health check): the
report *is* the event the master records for it. The servicer checks the
message and converts it straight to that event (``WorkerFailed``,
``WorkersStarted`` / ``WorkersSucceeded``, ``StacksDumped``,
``NodeHealthReported``), held in an :class:`AgentReport` with the node
incarnation that sent it; the backend takes that one value, checks the
incarnation is live and records the event. The client takes the same value, so
an agent builds the event itself. A message and its event spell their fields
the same way (``tests/core/rpc/test_report_shapes.py`` holds every pair to it).
Heartbeats are not reports of this kind: they are never recorded, and reach the
backend as :class:`HeartbeatInfo`; a registration is answered, and arrives as
:class:`RegisterInfo`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Generic, Protocol, TypeVar

from stead.core.events import (
    JobWarned,
    NodeHealthReported,
    NumericsReported,
    RestoreBound,
    StacksDumped,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)

__all__ = [
    "AgentBackend",
    "AgentCommand",
    "AgentReport",
    "CheckHealthCmd",
    "DumpStacksCmd",
    "HEARTBEAT_STREAM_ROUTE",
    "HeartbeatInfo",
    "MAX_ACKS_PER_BEAT",
    "MAX_BATCH_BEATS",
    "MAX_ERROR_TAIL_CHARS",
    "MAX_EVIDENCE_CHARS",
    "MAX_HEALTH_PEERS",
    "MAX_HOST_CHARS",
    "MAX_NODE_WORKERS",
    "RegisterInfo",
    "RegisterResult",
    "StartWorkersCmd",
    "StopNodeCmd",
    "StopWorkersCmd",
]


#: the longest OOM record or GPU fault line a failure report carries
MAX_EVIDENCE_CHARS = 4096
#: the longest stderr tail a failure report carries (the agent keeps the end of a longer one)
MAX_ERROR_TAIL_CHARS = 32 * 1024
#: the most heartbeats one Heartbeats call may carry (an aggregator for a rack, or a few racks)
MAX_BATCH_BEATS = 10_000
#: the most command ids one heartbeat acknowledges (an agent applies a command or two between beats; one that
#: has more waiting sends the rest with its next beats)
MAX_ACKS_PER_BEAT = 64
#: the HeartbeatStream call's route: the client opens it and the servicer serves it by hand, not through the stubs
HEARTBEAT_STREAM_ROUTE = "/stead.v1.AgentService/HeartbeatStream"
#: the longest host name an agent may announce (a DNS name)
MAX_HOST_CHARS = 253
#: the most workers one node runs (its nproc, a StacksReport's entries, a FailureReport's ranks)
MAX_NODE_WORKERS = 1024
#: the most partners a node all-reduces with in a health check: one per stage, and a check has at most three stages
MAX_HEALTH_PEERS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegisterInfo:
    """An agent announcing itself to the master."""

    node_id: str
    #: bumped each time the platform (re)launches the node; starts at 1
    incarnation: int
    host: str
    pid: int
    #: worker processes this node runs
    nproc: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegisterResult:
    """What an agent needs to know about the job once registered."""

    job: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    #: the torch TCPStore the master hosts for the workers
    store_host: str
    store_port: int
    progress_interval_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeartbeatInfo:
    """Liveness and progress of one node incarnation."""

    node_id: str
    incarnation: int
    round: int
    #: latest training step the workers reported; None before the first one
    step: int | None
    workers_alive: int
    #: resident memory of the node's workers together, bytes; None when unknown (never a made-up 0)
    rss_bytes: int | None = None
    #: CPU use of the node's workers together since the previous heartbeat, percent of one core; None when unknown
    cpu_percent: float | None = None
    #: a long phase some worker declared (``stead.phase("eval")``); "" when none
    phase: str = ""
    #: seconds per step the node's slowest rank spends on its own work (outside backward()); None before enough steps
    step_compute_s: float | None = None
    #: memory in use on the node's fullest GPU, bytes, and its GPUs' mean utilisation, percent; None when unknown
    gpu_memory_bytes: int | None = None
    gpu_util_percent: float | None = None
    #: the ids of the commands the agent applied since a heartbeat the master answered: their acknowledgement
    acked: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartWorkersCmd:
    """Start the workers of a rendezvous round with this topology."""

    id: str
    round: int
    node_rank: int
    nnodes: int
    nproc_per_node: int
    world_size: int
    restart_count: int
    master_addr: str
    master_port: int
    #: steps every rank skips (see :mod:`stead.core.worker.skipping`)
    skip_steps: tuple[int, ...] = ()
    #: what a restore may take after replica mismatches (see :class:`stead.core.events.RestoreBound`)
    restore_bounds: tuple[RestoreBound, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopWorkersCmd:
    """Stop the workers of a round (they are restarted by a later StartWorkers)."""

    id: str
    round: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopNodeCmd:
    """Stop the workers and exit the agent."""

    id: str
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class DumpStacksCmd:
    """Report every worker's Python stacks (the workers keep running)."""

    id: str
    round: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckHealthCmd:
    """Run this node's part of health check ``check`` with the other ``nodes`` and report it."""

    id: str
    check: int
    #: every node of the check, in pairing order
    nodes: tuple[str, ...]
    #: the TCPStore the pairs rendezvous in
    store_host: str
    store_port: int
    timeout_s: float


#: a command from the master to one agent; ``id`` is deterministic, so a repeated command can be recognised
AgentCommand = StartWorkersCmd | StopWorkersCmd | StopNodeCmd | DumpStacksCmd | CheckHealthCmd


class _FromNode(Protocol):
    """An event about one node (every event an agent reports is one)."""

    @property
    def node_id(self) -> str: ...


E = TypeVar("E", bound=_FromNode, covariant=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentReport(Generic[E]):
    """What a node's agent reports: the event the master records for it, and the node incarnation that sent it.

    The incarnation tells a live node's report from a stale one (an agent from before its node was relaunched);
    the event need not carry it.
    """

    incarnation: int
    event: E

    def __post_init__(self) -> None:
        own = getattr(self.event, "incarnation", self.incarnation)
        if own != self.incarnation:
            raise ValueError(f"a report of incarnation {self.incarnation} holds an event of incarnation {own}: "
                             "report an event with the incarnation of the node that sends it")

    @property
    def node_id(self) -> str:
        return self.event.node_id


class AgentBackend(Protocol):
    """The master side of the agent protocol.

    Methods may raise :class:`~stead.core.errors.InvalidRequest` (answered as
    INVALID_ARGUMENT), :class:`~stead.core.errors.Unauthenticated`
    (UNAUTHENTICATED) or a :class:`~stead.core.errors.RetryableError`
    (UNAVAILABLE: the agent retries); anything else is answered as INTERNAL.
    """

    async def register(self, info: RegisterInfo) -> RegisterResult: ...

    async def heartbeat(self, info: HeartbeatInfo) -> bool:
        """False when the node incarnation is unknown: the agent must register again."""
        ...

    async def heartbeats(self, beats: Sequence[HeartbeatInfo]) -> Sequence[str]:
        """Many nodes' heartbeats (from an aggregator); returns the node ids among them that must register again."""
        ...

    def commands(self, node_id: str, incarnation: int) -> AsyncIterator[AgentCommand]:
        """The commands for one node incarnation, in order; ends when the node must stop listening."""
        ...

    async def report_failure(self, report: AgentReport[WorkerFailed]) -> None: ...

    async def report_workers(self, report: AgentReport[WorkersStarted | WorkersSucceeded]) -> None: ...

    async def report_stacks(self, report: AgentReport[StacksDumped]) -> None: ...

    async def report_health(self, report: AgentReport[NodeHealthReported]) -> None: ...

    async def report_numerics(self, report: AgentReport[NumericsReported]) -> None: ...

    async def report_warned(self, report: AgentReport[JobWarned]) -> None:
        """The node was warned that the job will be stopped soon (Slurm's warning before a time limit)."""
        ...
