"""The core event kinds: job, node, worker, rendezvous, progress, plugins.

Field names are part of the stored schema: add fields with defaults, never
rename; bump the version for an incompatible change.
"""

from __future__ import annotations

import dataclasses
import enum

from stead.core.events.base import Event, EventMark, event_kind
from stead.core.events.names import EffectId, TimerName

__all__ = [
    "CheckpointCommitted",
    "CheckpointPersisted",
    "CheckpointRestored",
    "CommandAck",
    "CommandsAcked",
    "EffectFailed",
    "HealthCheckStarted",
    "HealthChecked",
    "HealthVerdict",
    "JobFailed",
    "JobResumed",
    "JobStopped",
    "JobSubmitted",
    "JobSucceeded",
    "MembershipDecided",
    "NodeExited",
    "NodePending",
    "RoomFound",
    "NodeResourcesDecided",
    "NodeHealthReported",
    "NodeJoined",
    "NodeLost",
    "NodeRequested",
    "NodeStarted",
    "PeerCollective",
    "PluginFailed",
    "PluginsStarted",
    "RecoveryAction",
    "RecoveryDecided",
    "RelaunchRequested",
    "RestartRequested",
    "RoundCompleted",
    "RoundStarted",
    "StackSample",
    "StacksDumped",
    "StacksRequested",
    "StepProgress",
    "TimerFired",
    "TransitionRejected",
    "WorkerFailed",
    "WorkersStarted",
    "WorkersSucceeded",
]



# -- job ---------------------------------------------------------------------


@event_kind("job.submitted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSubmitted(Event):
    """A job was submitted: its shape, its restart budget and its entrypoint."""

    job: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int = 3
    entrypoint: tuple[str, ...] = ()
    last_call_timeout_s: float = 1.0
    join_timeout_s: float = 600.0
    max_node_relaunches: int = 3
    #: a worker failure left undecided this long is decided by the built-in default policy
    decision_timeout_s: float = 3.0
    #: which joining nodes must pass a health check before they train: ``off``, ``relaunched`` or ``all``
    health_check: str = "off"
    #: a node's check that has not reported after this long fails it
    health_timeout_s: float = 60.0
    #: a node whose matmul takes more than this many times the other nodes' median fails its check
    health_slow_factor: float = 2.0
    #: nodes to start with, within MIN:MAX (None: MAX); the scaler changes the target later (MembershipDecided)
    start_nodes: int | None = None
    #: a resize waits for the next checkpoint commit (a step boundary) at most this long, then goes ahead
    resize_wait_s: float = 30.0
    #: a running round grows by every node that becomes ready within this long of the first one
    grow_window_s: float = 5.0


@event_kind("job.resumed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobResumed(JobSubmitted):
    """A job that ended (or whose runner died) runs again under the same name, with this spec.

    Its nodes start again as new incarnations, its rounds go on numbering from the last
    one (so the workers' checkpoints and data cursors of earlier rounds stay valid),
    and its restart and relaunch budgets start afresh. ``changed``: what differs from
    the previous spec (resumed with ``--force``), empty when nothing does.
    """

    changed: tuple[str, ...] = ()

    def submitted(self) -> JobSubmitted:
        """The spec alone, as a submission states it."""
        return JobSubmitted(**{f.name: getattr(self, f.name) for f in dataclasses.fields(JobSubmitted)})


@event_kind("job.succeeded")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSucceeded(Event):
    reason: str = "all workers exited 0"


@event_kind("job.failed", mark=EventMark.FAILURE)
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobFailed(Event):
    reason: str
    message: str = ""
    node_id: str | None = None
    rank: int | None = None


@event_kind("job.stopped")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JobStopped(Event):
    reason: str = "stopped by user"
    #: why the stop was asked for, as the scheduler says ("Slurm's time limit (TIMEOUT)", "preempted (PREEMPTED)",
    #: "cancel cause unknown: ..."); "" when nobody was asked (a Ctrl-C, an older record). ``reason`` includes it
    cause: str = ""


# -- nodes -------------------------------------------------------------------


@event_kind("node.requested")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeRequested(Event):
    """The master wants a node (first launch or relaunch, ``incarnation`` counts them)."""

    node_id: str
    incarnation: int
    #: hosts the node must not be placed on (a host excluded as faulty); a platform with one host says so
    avoid_hosts: tuple[str, ...] = ()
    #: it grows a running job: its agent joins once fully warm, so that the resized round does not wait for it
    warm_first: bool = False
    #: what its platform gives it, where that differs from the job's own (``(("memory", "12Gi"),)``: a larger
    #: memory limit after an out-of-memory kill); empty: the job's own
    resources: tuple[tuple[str, str], ...] = ()


@event_kind("node.started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeStarted(Event):
    """The platform reports the node's agent process or pod running."""

    node_id: str
    incarnation: int
    host: str = ""
    pid: int | None = None
    #: what the platform gave it, where it tells (a pod's memory and CPU limits): ``(("memory", "8Gi"), ...)``
    resources: tuple[tuple[str, str], ...] = ()


@event_kind("node.joined")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeJoined(Event):
    """The node's agent registered with the master and can take a round."""

    node_id: str
    incarnation: int
    host: str = ""
    nproc: int = 1


@event_kind("node.lost", mark=EventMark.FAILURE)
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeLost(Event):
    """The node stopped answering (heartbeat timeout) or its pod vanished."""

    node_id: str
    incarnation: int
    reason: str = "heartbeat timeout"


@event_kind("node.exited")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeExited(Event):
    """The platform reports the node's agent gone, with its exit code or signal."""

    node_id: str
    incarnation: int
    exit_code: int | None = None
    signal: int | None = None
    #: what the platform says of the end ("OOMKilled", "Evicted: ...", "NodeLost: ...", "pod deleted"); "" when it
    #: says nothing more than the exit code (the diagnosis rules match it as ``platform_reason``)
    reason: str = ""
    #: the node cannot start as specified (an image that does not exist, a configuration the platform refuses): a
    #: relaunch would fail the same way, so the job fails with ``reason`` instead of spending its relaunches
    permanent: bool = False
    #: the platform killed it for using more memory than it was given (a pod's OOMKilled): its relaunch waits (up
    #: to decision_timeout_s) for a plugin to decide its resources (NodeResourcesDecided)
    oom: bool = False


@event_kind("node.resources_decided")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeResourcesDecided(Event):
    """What a node's next incarnation gets (the scaler: more memory after an out-of-memory kill); the relaunch that
    waited for this decision goes out with it. Empty ``resources``: the same as before."""

    node_id: str
    #: the incarnation that ended
    incarnation: int
    resources: tuple[tuple[str, str], ...] = ()
    reason: str = ""
    by: str = ""


@event_kind("node.pending")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodePending(Event):
    """The platform has not found room for the node for ``pending_s`` (no capacity, every host excluded): the
    node is capacity that is not there, which the scaler decides about instead of a rendezvous timing out."""

    node_id: str
    incarnation: int
    pending_s: float
    #: the platform's reason and message ("Unschedulable: 0/3 nodes are available: ...")
    reason: str = ""


@event_kind("platform.room")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RoomFound(Event):
    """The platform has room for another node now (a host offered itself and runs none): capacity that a
    NodePending said was not there may be back, and the scaler asks for it at once instead of at its next retry."""

    reason: str = ""


# -- workers and rounds --------------------------------------------------------


@event_kind("worker.failed", mark=EventMark.FAILURE)
@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerFailed(Event):
    """A worker process exited non-zero or by a signal."""

    node_id: str
    round: int
    local_rank: int
    rank: int
    exit_code: int | None = None
    signal: int | None = None
    step: int | None = None
    error_tail: str = ""
    #: wall-clock time the agent saw the worker end (the start of the recovery's ``detect`` span)
    exited_at: float | None = None
    #: the kernel's record that it OOM-killed the process (kernel log line or memory cgroup counter); "" when none
    oom: str = ""
    #: GPU faults the agent saw on its node when the worker ended (XID, ECC, a lost GPU); "" when none or no GPU
    gpu: str = ""
    #: ranks of the same node that exited 0 earlier in the round, while this one still ran (an early exit breaks
    #: the others' collectives)
    exited_ok_ranks: tuple[int, ...] = ()


@event_kind("workers.started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkersStarted(Event):
    """A node's agent started all its workers for ``round``."""

    node_id: str
    round: int


@event_kind("workers.succeeded")
@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkersSucceeded(Event):
    """All of a node's workers for ``round`` exited 0."""

    node_id: str
    round: int


class RecoveryAction(enum.Enum):
    #: restart the round's workers (one restart of the budget)
    RESTART = "restart"
    #: the job fails
    FAIL = "fail"
    #: replace the failed worker's node (its host avoided from then on) and restart the round
    RELAUNCH = "relaunch"


@event_kind("recovery.decided", mark=EventMark.DECISION)
@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryDecided(Event):
    """What a failure in ``round`` leads to, decided by a plugin (diagnosis) or by the default policy."""

    round: int
    action: RecoveryAction
    reason: str
    message: str = ""
    node_id: str | None = None
    rank: int | None = None
    #: who decided: a plugin's name, or ``default`` (the built-in policy, when no plugin decided in time)
    decided_by: str = ""
    #: the failure's class (``user_error``, ``oom``, ``hardware``, ``node_lost``, ``collective``, ``transient``)
    failure_class: str = ""
    #: the classification rule that matched, and what it matched on
    rule: str = ""
    evidence: str = ""
    #: steps every rank skips from the restarted round on (their batches caused a numerical fault): restart only
    skip_steps: tuple[int, ...] = ()
    #: the newest step the restarted round may restore, after a replica mismatch: the last step whose fingerprints
    #: agreed (-1: the script's initial state); no copy of a later step saved in ``round`` or before is restored from
    #: then on (see :class:`stead.core.events.RestoreBound`); None: no bound
    restore_at_most: int | None = None


@event_kind("request.restart", mark=EventMark.DECISION)
@dataclasses.dataclass(frozen=True, kw_only=True)
class RestartRequested(Event):
    """A plugin asks to restart the workers of the running ``round`` (a hang, say); costs one restart."""

    round: int
    reason: str
    by: str


@event_kind("request.relaunch", mark=EventMark.DECISION)
@dataclasses.dataclass(frozen=True, kw_only=True)
class RelaunchRequested(Event):
    """A plugin asks to replace a node (a straggler, a sick host): it is killed and relaunched."""

    node_id: str
    incarnation: int
    reason: str
    by: str


@event_kind("membership.decided")
@dataclasses.dataclass(frozen=True, kw_only=True)
class MembershipDecided(Event):
    """How many nodes the job should run on, within MIN:MAX: nodes are requested or retired to match, and a
    running round is resized at its next step boundary. Decided by the scaler's policy (``by``)."""

    target: int
    reason: str
    by: str


@event_kind("round.started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundStarted(Event):
    """The master fixed a round's membership; node rank = index in ``members``."""

    round: int
    members: tuple[str, ...]
    nproc_per_node: int
    restart_count: int = 0


@event_kind("round.completed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundCompleted(Event):
    """Every member of the round has its workers running."""

    round: int


@event_kind("progress.step")
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepProgress(Event):
    """The slowest rank of ``round`` has finished ``step``; ``phase``: a long phase some worker is in."""

    round: int
    step: int
    #: a long phase a worker declared (``stead.phase("eval")``): no step is expected until it ends; "" when none
    phase: str = ""


@event_kind("request.stacks")
@dataclasses.dataclass(frozen=True, kw_only=True)
class StacksRequested(Event):
    """A plugin asks every node of the running ``round`` for its workers' Python stacks (they keep running)."""

    round: int
    reason: str
    by: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackSample:
    """One worker's Python stacks (faulthandler's text, most recent call first) and its last reported step."""

    rank: int
    local_rank: int
    step: int | None
    stack: str


@event_kind("node.stacks")
@dataclasses.dataclass(frozen=True, kw_only=True)
class StacksDumped(Event):
    """A node's workers' stacks, answering ``StacksRequested``; ``error`` says what could not be taken."""

    node_id: str
    round: int
    workers: tuple[StackSample, ...]
    method: str
    error: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandAck:
    """A node incarnation's agent applied the command ``command_id``."""

    node_id: str
    incarnation: int
    command_id: str


@event_kind("commands.acked")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandsAcked(Event):
    """Agents acknowledged these commands: a master no longer resends them (many nodes' acks in one record)."""

    acks: tuple[CommandAck, ...]


@event_kind("timer.fired")
@dataclasses.dataclass(frozen=True, kw_only=True)
class TimerFired(Event):
    """An armed timer's time came (stored as its name's string form, ``decision/3``)."""

    name: TimerName


# -- node health checks ---------------------------------------------------------


@event_kind("health.started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthCheckStarted(Event):
    """Health check ``check`` of ``nodes`` (in pairing order): ``checked`` ones are under check, the rest partners."""

    check: int
    nodes: tuple[str, ...]
    checked: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerCollective:
    """One pairwise all-reduce of a health check: with ``peer``, ``seconds`` when it worked, else ``error``."""

    peer: str
    seconds: float | None = None
    error: str = ""


@event_kind("node.health")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeHealthReported(Event):
    """One node's part of health check ``check``: its figures, or what went wrong."""

    node_id: str
    incarnation: int
    check: int
    #: the best time of the matmul benchmark; None when it failed
    matmul_s: float | None = None
    collectives: tuple[PeerCollective, ...] = ()
    #: where the benchmark ran ("cpu", "cuda:0 NVIDIA H100 ...")
    device: str = ""
    error: str = ""
    #: the whole check on this node, start-up included
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthVerdict:
    node_id: str
    incarnation: int
    reason: str


@event_kind("health.checked", mark=EventMark.DIAGNOSIS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthChecked(Event):
    """The verdict of health check ``check``: ``failed`` nodes are relaunched elsewhere, the others may train."""

    check: int
    nodes: tuple[str, ...]
    failed: tuple[HealthVerdict, ...] = ()
    median_matmul_s: float | None = None
    #: the check could not run (why): its nodes were let in unchecked
    skipped: str = ""


# -- checkpoints, plugins, errors ----------------------------------------------


@event_kind("checkpoint.committed", mark=EventMark.CHECKPOINT)
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(Event):
    step: int
    tier: str = "memory"
    #: how long the slowest rank's save() took to copy the step (None: not reported)
    save_s: float | None = None


# the flash checkpoint plugin records these (``ckpt.*``); they are core kinds because the goodput ledger and the
# metrics read their fields


@event_kind("ckpt.persisted", mark=EventMark.CHECKPOINT)
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointPersisted(Event):
    """Every rank of the world wrote its shard of ``step`` to ``path`` (loadable by torch.distributed.checkpoint)."""

    step: int
    path: str
    world_size: int
    #: how long the slowest rank took to write its files (None: not reported)
    persist_s: float | None = None


@event_kind("ckpt.restored", mark=EventMark.CHECKPOINT)
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRestored(Event):
    """The workers of ``round`` restored ``step`` (-1: started fresh); ranks counted by where they read it."""

    round: int
    step: int
    memory_ranks: int = 0
    disk_ranks: int = 0
    #: ranks that restored a replica fetched from another host's memory (their own memory was lost with a host)
    peer_ranks: int = 0
    #: ranks that resharded the step from the old ranks' slots in memory (the world size changed), and how many
    #: slots they read it from, summed over them: surviving ranks' own slots and peers' replicas on their nodes, and
    #: slots read from other nodes' memory over their replica ports
    resharded_ranks: int = 0
    reshard_own_parts: int = 0
    reshard_peer_parts: int = 0
    reshard_remote_parts: int = 0
    #: the newest step replicated everywhere ("R": every rank's copy in another host's memory) and the newest
    #: committed step when the workers restored (-1: none, or not said)
    replicated_step: int = -1
    committed_step: int = -1


@event_kind("plugin.failed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class PluginFailed(Event):
    plugin: str
    event_type: str
    error: str
    disabled: bool = False


@event_kind("plugins.started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class PluginsStarted(Event):
    """The master's plugins are running; ``deciders`` decide worker failures (none: the default policy does)."""

    plugins: tuple[str, ...]
    deciders: tuple[str, ...] = ()


@event_kind("effect.failed")
@dataclasses.dataclass(frozen=True, kw_only=True)
class EffectFailed(Event):
    """An effect could not be carried out; the job machine decides what follows (relaunch, restart, fail)."""

    #: the failed effect's id (stored as its string form, ``launch/node-1/2``)
    effect_id: EffectId
    #: ``launch-node``, ``kill-node``, ``start-workers``, ``stop-workers`` or ``stop-node``
    kind: str
    error: str
    #: the platform refused it as specified (``PlatformRejected``): carrying it out again cannot succeed
    permanent: bool = False
    node_id: str | None = None
    incarnation: int | None = None
    round: int | None = None


@event_kind("transition.rejected")
@dataclasses.dataclass(frozen=True, kw_only=True)
class TransitionRejected(Event):
    """An event was illegal in the state it arrived in; the state was not changed."""

    event_type: str
    seq: int
    reason: str
