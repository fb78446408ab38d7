"""The job machine: the whole job's state, folded from its event log.

Phases and allowed transitions::

    NEW ──submitted──▶ STARTING ──round started──▶ RUNNING ◀──round started──┐
                                                     │                        │
                                                     └──worker failed /──▶ RECOVERING
                                                        node lost
    STARTING | RUNNING | RECOVERING ──▶ SUCCEEDED | FAILED | STOPPED   (terminal: absorb every later event)

The job machine owns the node machines (one per node id) and the rendezvous
machine, routes each event to them, and adds the job-level decisions: when to
start a round, when the job succeeded, when the restart budget is spent.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from stead.core.events import (
    CheckpointCommitted,
    Event,
    JobFailed,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    NodeExited,
    NodeJoined,
    NodeLost,
    NodeRequested,
    NodeStarted,
    RecoveryAction,
    RecoveryDecided,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    TimerFired,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.statemachine import node as node_machine
from stead.core.statemachine import rendezvous as rdzv_machine
from stead.core.statemachine.base import Transition, reject
from stead.core.statemachine.effects import Effect, Emit, StartTimer, StopNode, StopWorkers
from stead.core.statemachine.node import NodePhase, NodeState
from stead.core.statemachine.rendezvous import RendezvousState

__all__ = ["JobPhase", "JobState", "node_ids", "transition"]


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
    #: seq of the last event folded in (0 before any)
    seq: int = 0

    @property
    def joined(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.nodes.items() if s.phase is NodePhase.JOINED)


def node_ids(count: int) -> tuple[str, ...]:
    return tuple(f"node-{i}" for i in range(count))


def transition(state: JobState, event: Event, *, now: float, seq: int = 0) -> Transition[JobState]:
    """Fold ``event`` (the log's record ``seq``) into ``state``: pure, no IO, no clock."""
    result = _transition(dataclasses.replace(state, seq=max(seq, state.seq)), event, now=now)
    if result.rejected is not None:
        return Transition(state, (), result.rejected)
    return result


def _transition(state: JobState, event: Event, *, now: float) -> Transition[JobState]:
    if state.phase.terminal:
        return _absorb(state, event, now=now)
    if state.phase is JobPhase.NEW and not isinstance(event, JobSubmitted):
        if isinstance(event, (JobFailed, JobStopped)):
            return _end(state, event)
        return reject(state, f"{event.type_name} before the job was submitted")
    match event:
        case JobSubmitted():
            return _submit(state, event, now=now)
        case NodeRequested() | NodeStarted() | NodeJoined() | NodeLost() | NodeExited():
            return _node_event(state, event, now=now)
        case RoundStarted():
            return _round_started(state, event)
        case WorkersStarted() | RoundCompleted():
            return _rdzv_event(state, event)
        case WorkersSucceeded():
            result = _rdzv_event(state, event)
            if result.rejected is None and result.state.rdzv.all_succeeded:
                done = Emit(key="job-end", event=JobSucceeded())
                return Transition(result.state, (*result.effects, done))
            return result
        case WorkerFailed():
            if event.round != state.rdzv.round or not state.rdzv.active or state.awaiting_decision:
                return Transition(state)  # a late or follow-on failure of a round already being handled
            return Transition(
                dataclasses.replace(state, phase=JobPhase.RECOVERING, awaiting_decision=True, last_failure=event)
            )
        case RecoveryDecided():
            return _decided(state, event, now=now)
        case TimerFired():
            return _timer(state, event, now=now)
        case StepProgress():
            return Transition(dataclasses.replace(state, step=max(event.step, state.step or 0)))
        case CheckpointCommitted():
            # the latest commit, not the highest: after a rollback to an older step, that step is in force
            return Transition(dataclasses.replace(state, checkpoint_step=event.step))
        case JobSucceeded() | JobFailed() | JobStopped():
            return _end(state, event)
        case _:
            return Transition(state)  # plugin events and error reports do not change the job


def _absorb(state: JobState, event: Event, *, now: float) -> Transition[JobState]:
    """A finished job stays finished; it only keeps track of its nodes going away."""
    if isinstance(event, (NodeExited, NodeLost)):
        result = node_machine.transition(state.nodes.get(event.node_id), event, now=now)
        if result.rejected is None and result.state is not None:
            return Transition(_with_node(state, result.state), result.effects)  # a lost node is still killed
    return Transition(state)


def _submit(state: JobState, event: JobSubmitted, *, now: float) -> Transition[JobState]:
    if state.phase is not JobPhase.NEW:
        return reject(state, f"job {event.job!r} was already submitted")
    problem = _spec_problem(event)
    if problem:
        return reject(state, f"job {event.job!r} cannot run: {problem}")
    effects: list[Effect] = [
        Emit(key=f"request/{node}/1", event=NodeRequested(node_id=node, incarnation=1))
        for node in node_ids(event.max_nodes)
    ]
    effects.append(StartTimer(name="join-timeout", at=now + event.join_timeout_s))
    return Transition(dataclasses.replace(state, phase=JobPhase.STARTING, spec=event), tuple(effects))


def _spec_problem(spec: JobSubmitted) -> str:
    if spec.min_nodes < 1 or spec.max_nodes < spec.min_nodes:
        return f"nodes {spec.min_nodes}:{spec.max_nodes} must satisfy 1 <= MIN <= MAX"
    if spec.nproc_per_node < 1:
        return f"nproc_per_node {spec.nproc_per_node} must be at least 1"
    if spec.max_restarts < 0 or spec.max_node_relaunches < 0:
        return "max_restarts and max_node_relaunches must not be negative"
    return ""


def _with_node(state: JobState, node: NodeState) -> JobState:
    return dataclasses.replace(state, nodes={**state.nodes, node.node_id: node})


def _node_event(
    state: JobState, event: NodeRequested | NodeStarted | NodeJoined | NodeLost | NodeExited, *, now: float
) -> Transition[JobState]:
    before = state.nodes.get(event.node_id)
    result = node_machine.transition(before, event, now=now)
    if result.rejected is not None or result.state is None:
        return reject(state, result.rejected or "node event rejected")
    after = result.state
    new = _with_node(state, after)
    effects = list(result.effects)
    if isinstance(event, NodeJoined):
        effects += _plan(new, now=now)
    went_away = before is not None and before.phase.alive and not after.phase.alive
    if went_away:
        new, more = _node_gone(new, after, now=now)
        effects += more
    return Transition(new, tuple(effects))


def _node_gone(state: JobState, node: NodeState, *, now: float) -> tuple[JobState, list[Effect]]:
    """A live node was lost or exited: break its round, relaunch it or fail the job."""
    spec = state.spec
    assert spec is not None
    effects: list[Effect] = []
    if node.node_id in state.rdzv.members and state.rdzv.active:
        reason = f"node {node.node_id} {node.phase.value}"
        effects += [
            StopWorkers(node_id=m, incarnation=state.nodes[m].incarnation, round=state.rdzv.round, reason=reason)
            for m in state.rdzv.members
            if m != node.node_id and state.nodes[m].phase is NodePhase.JOINED
        ]
        state = dataclasses.replace(  # a decision still pending for a failure stays pending
            state,
            phase=JobPhase.RECOVERING,
            rdzv=dataclasses.replace(state.rdzv, active=False),
        )
    if node.incarnation <= spec.max_node_relaunches:
        relaunch = NodeRequested(node_id=node.node_id, incarnation=node.incarnation + 1)
        effects.append(Emit(key=f"request/{node.node_id}/{node.incarnation + 1}", event=relaunch))
        return state, effects
    alive = sum(1 for s in state.nodes.values() if s.phase.alive)
    if alive < spec.min_nodes:
        failed = JobFailed(
            reason=f"node {node.node_id} was {node.phase.value} {node.incarnation} times "
            f"(max_node_relaunches={spec.max_node_relaunches}) and fewer than {spec.min_nodes} "
            "nodes remain",
            node_id=node.node_id,
        )
        effects.append(Emit(key="job-end", event=failed))
        return state, effects
    return state, effects + list(_plan(state, now=now))


def _plan(state: JobState, *, now: float) -> tuple[Effect, ...]:
    spec = state.spec
    if spec is None or state.awaiting_decision or state.phase not in (JobPhase.STARTING, JobPhase.RECOVERING):
        return ()
    return rdzv_machine.plan_round(
        state.rdzv,
        joined=state.joined,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        nproc_per_node=spec.nproc_per_node,
        restart_count=state.restarts,
        last_call_timeout_s=spec.last_call_timeout_s,
        now=now,
    )


def _round_started(state: JobState, event: RoundStarted) -> Transition[JobState]:
    if state.phase not in (JobPhase.STARTING, JobPhase.RECOVERING) or state.awaiting_decision:
        return reject(state, f"round {event.round} cannot start while the job is {state.phase.value}")
    not_joined = [n for n in event.members if n not in state.joined]
    if not_joined:
        return reject(state, f"round {event.round} names nodes that have not joined: {not_joined}")
    incarnations = {n: s.incarnation for n, s in state.nodes.items()}
    result = rdzv_machine.transition(state.rdzv, event, incarnations=incarnations)
    if result.rejected is not None:
        return reject(state, result.rejected)
    return Transition(dataclasses.replace(state, phase=JobPhase.RUNNING, rdzv=result.state), result.effects)


def _rdzv_event(
    state: JobState, event: WorkersStarted | RoundCompleted | WorkersSucceeded
) -> Transition[JobState]:
    incarnations = {n: s.incarnation for n, s in state.nodes.items()}
    result = rdzv_machine.transition(state.rdzv, event, incarnations=incarnations)
    if result.rejected is not None:
        return reject(state, result.rejected)
    return Transition(dataclasses.replace(state, rdzv=result.state), result.effects)


def _decided(state: JobState, event: RecoveryDecided, *, now: float) -> Transition[JobState]:
    assert state.spec is not None
    if not state.awaiting_decision or event.round != state.rdzv.round:
        return reject(state, f"no failure of round {event.round} is waiting for a decision")
    failure = state.last_failure
    if event.action is RecoveryAction.FAIL or state.restarts >= state.spec.max_restarts:
        reason = event.reason
        if event.action is RecoveryAction.RESTART:
            reason = f"max restarts exhausted ({state.spec.max_restarts}); last failure: {event.reason}"
        failed = JobFailed(
            reason=reason,
            message=event.message or (failure.error_tail if failure else ""),
            node_id=event.node_id if event.node_id is not None else (failure.node_id if failure else None),
            rank=event.rank if event.rank is not None else (failure.rank if failure else None),
        )
        return Transition(dataclasses.replace(state, awaiting_decision=False), (Emit(key="job-end", event=failed),))
    restarted = dataclasses.replace(
        state,
        awaiting_decision=False,
        restarts=state.restarts + 1,
        rdzv=dataclasses.replace(state.rdzv, active=False),
    )
    return Transition(restarted, _plan(restarted, now=now))


def _timer(state: JobState, event: TimerFired, *, now: float) -> Transition[JobState]:
    spec = state.spec
    assert spec is not None
    if event.name == "join-timeout":
        if state.phase is JobPhase.STARTING:
            failed = JobFailed(
                reason=f"only {len(state.joined)} of at least {spec.min_nodes} nodes joined within "
                f"{spec.join_timeout_s:g} s; check the nodes' logs or raise the join timeout (--rdzv-conf)"
            )
            return Transition(state, (Emit(key="job-end", event=failed),))
        return Transition(state)
    if event.name == f"last-call/{state.rdzv.round + 1}" and not state.rdzv.active and not state.awaiting_decision:
        joined = state.joined
        if len(joined) >= spec.min_nodes and state.phase in (JobPhase.STARTING, JobPhase.RECOVERING):
            members = rdzv_machine.order_members(state.rdzv.members, joined, spec.max_nodes)
            started = RoundStarted(
                round=state.rdzv.round + 1,
                members=members,
                nproc_per_node=spec.nproc_per_node,
                restart_count=state.restarts,
            )
            return Transition(state, (Emit(key=f"round/{started.round}", event=started),))
    return Transition(state)  # a timer of a round that has already started


def _end(state: JobState, event: JobSucceeded | JobFailed | JobStopped) -> Transition[JobState]:
    phase = {JobSucceeded: JobPhase.SUCCEEDED, JobFailed: JobPhase.FAILED, JobStopped: JobPhase.STOPPED}[type(event)]
    message = event.message if isinstance(event, JobFailed) else ""
    ended = dataclasses.replace(
        state,
        phase=phase,
        reason=event.reason,
        message=message,
        awaiting_decision=False,
        rdzv=dataclasses.replace(state.rdzv, active=False),
    )
    effects = tuple(
        StopNode(node_id=n.node_id, incarnation=n.incarnation, reason=f"job {phase.value}")
        for n in state.nodes.values()
        if n.phase.alive
    )
    return Transition(ended, effects)
