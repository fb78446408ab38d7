"""Which round comes next: planning it, and resizing a running one to the job's membership target.

:func:`plan` starts the next round (or arms its last call) once enough nodes are ready,
for every policy of :mod:`.membership`. The rest carries out the target: a
``MembershipDecided`` requests or retires nodes (:func:`decided`); a running round that is
not the size it should be is resized at its next checkpoint commit (:func:`maybe_resize`,
:func:`resize`); a replacement that never joins fails the job only below MIN
(:func:`rejoin_timeout`). The job machine (:mod:`.job`) calls these from its transitions.
"""

from __future__ import annotations

import dataclasses

from stead.core.events import (
    GrowWindow,
    JobFailed,
    MembershipDecided,
    NodeLost,
    NodeRequested,
    RejoinTimeout,
    ResizeWait,
)
from stead.core.statemachine import health as health_machine
from stead.core.statemachine import membership
from stead.core.statemachine import rendezvous as rdzv_machine
from stead.core.statemachine.base import Transition, reject
from stead.core.statemachine.effects import Effect, Emit, StartTimer, StopNode, StopWorkers
from stead.core.statemachine.node import NodePhase
from stead.core.statemachine.node_counts import Ready
from stead.core.statemachine.state import JobPhase, JobState

__all__ = ["decided", "maybe_resize", "plan", "plan_or_grow", "rejoin_timeout", "rejoin_timer", "resize", "retire"]


def plan(state: JobState, *, now: float) -> tuple[Effect, ...]:
    """The next round: its health checks and its start now, a last-call timer, or nothing yet."""
    spec = state.spec
    if spec is None or state.awaiting_decision or state.phase not in (JobPhase.STARTING, JobPhase.RECOVERING):
        return ()
    return health_machine.plan(state) + rdzv_machine.plan_round(
        state.rdzv,
        joined=membership.available(state) if state.retired else Ready(state),
        min_nodes=spec.min_nodes,
        max_nodes=state.target_nodes,
        nproc_per_node=spec.nproc_per_node,
        restart_count=state.restarts,
        last_call_timeout_s=spec.last_call_timeout_s,
        now=now,
        seq=state.seq,
        gone=[m for m in state.rdzv.members if m in state.retired or not state.nodes[m].phase.alive],
    )


def decided(state: JobState, event: MembershipDecided, *, now: float) -> Transition[JobState]:
    """Aim at ``event.target`` nodes: request the missing ones, retire the surplus, resize the running round."""
    spec = state.spec
    assert spec is not None
    if not spec.min_nodes <= event.target <= spec.max_nodes:
        return reject(state, f"{event.by} decided {event.target} nodes, outside MIN:MAX {spec.min_nodes}:"
                             f"{spec.max_nodes}; the job stays at {state.target_nodes}")
    new = dataclasses.replace(state, target=event.target)
    made = membership.requests(new, event.target, avoid_hosts=tuple(sorted(state.excluded_hosts)))
    new = dataclasses.replace(new, retired=new.retired - {r.node_id for r in made})
    effects: list[Effect] = [Emit(key=f"request/{r.node_id}/{r.incarnation}", event=r) for r in made]
    if new.phase is JobPhase.RUNNING:
        gone: tuple[Effect, ...] = ()
        if len(new.rdzv.members) <= event.target:  # only nodes outside the round are surplus: they go now
            new, gone = retire(new, reason=f"the job shrank to {event.target} nodes")
        new, more = maybe_resize(new, now=now)
        return Transition(new, (*effects, *gone, *more))
    new, more = retire(new, reason=f"the job shrank to {event.target} nodes")
    return Transition(new, (*effects, *more, *plan(new, now=now)))


def plan_or_grow(state: JobState, *, now: float) -> tuple[JobState, tuple[Effect, ...]]:
    """A node joined or became ready: plan the next round, or grow the running one (a node that joins it and
    must pass a health check first is checked now, a node that trains as its partner)."""
    if state.phase is JobPhase.RUNNING:
        checks = health_machine.plan(state) if not state.awaiting_decision else ()
        grown, effects = maybe_resize(state, now=now)
        return grown, (*checks, *effects)
    return state, plan(state, now=now)


def maybe_resize(state: JobState, *, now: float, gathered: bool = False) -> tuple[JobState, tuple[Effect, ...]]:
    """Resize the running round when it is not the size it should be: now, or at the next checkpoint commit.

    A round grows by every node that comes within ``grow_window_s`` of the first (``gathered``: that window is
    over), not by one resize per node.
    """
    assert state.spec is not None
    if state.resizing or state.awaiting_decision or not state.rdzv.active or membership.resize_reason(state) is None:
        return state, ()
    window = GrowWindow(round=state.rdzv.round)
    if not gathered and membership.growing(state) and membership.coming(state):
        if window in state.timers:
            return state, ()  # more nodes are on their way: the window's end resizes for all of them
        return state, (StartTimer(name=window, at=now + state.spec.grow_window_s),)
    if state.checkpoint_step is None:  # the job does not checkpoint: no boundary to wait for
        result = resize(state, now=now)
        return result.state, result.effects
    timer = StartTimer(name=ResizeWait(round=state.rdzv.round), at=now + state.spec.resize_wait_s)
    return dataclasses.replace(state, resizing=True), (timer,)


def resize(state: JobState, *, now: float) -> Transition[JobState]:
    """Stop the running round, retire the surplus and start the next round at the new size (no restart spent)."""
    reason = membership.resize_reason(state)
    if reason is None or not state.rdzv.active:
        return Transition(dataclasses.replace(state, resizing=False))  # nothing to change any more
    new, retired = retire(state, reason=reason)
    stops = tuple(
        StopWorkers(node_id=m, incarnation=new.nodes[m].incarnation, round=new.rdzv.round, reason=reason)
        for m in new.rdzv.members if new.nodes[m].phase is NodePhase.JOINED and m not in new.retired)
    new = dataclasses.replace(new, phase=JobPhase.RECOVERING, resizing=False,
                              rdzv=dataclasses.replace(new.rdzv, active=False))
    return Transition(new, (*stops, *retired, *plan(new, now=now)))


def retire(state: JobState, *, reason: str) -> tuple[JobState, tuple[Effect, ...]]:
    """Stop the live nodes beyond the target: a joined one is told to stop, one still starting is dropped."""
    extra = membership.surplus(state, state.target_nodes)
    if not extra:
        return state, ()
    effects: list[Effect] = []
    for node_id in extra:
        node = state.nodes[node_id]
        if node.phase is NodePhase.JOINED:
            effects.append(StopNode(node_id=node_id, incarnation=node.incarnation, reason=reason))
        else:
            lost = NodeLost(node_id=node_id, incarnation=node.incarnation, reason=f"retired: {reason}")
            effects.append(Emit(key=f"retire/{node_id}/{node.incarnation}", event=lost))
    return dataclasses.replace(state, retired=state.retired | set(extra)), tuple(effects)


def rejoin_timer(request: NodeRequested) -> RejoinTimeout:
    return RejoinTimeout(node_id=request.node_id, incarnation=request.incarnation)


def rejoin_timeout(state: JobState, timer: RejoinTimeout) -> Transition[JobState]:
    """A relaunched node did not join in time: below MIN with no round running, the job fails."""
    spec = state.spec
    assert spec is not None
    node_id = timer.node_id
    node = state.nodes.get(node_id)
    if (node is None or node.incarnation != timer.incarnation or not node.phase.alive
            or node.phase is NodePhase.JOINED or state.rdzv.active or state.phase is not JobPhase.RECOVERING):
        return Transition(state)  # it joined, was replaced again, or the job goes on without it
    ready = len(membership.available(state))
    if ready >= spec.min_nodes:
        return Transition(state)
    pending = f" ({node.pending})" if node.pending else ""
    failed = JobFailed(reason=f"node {node_id} was not replaced within {spec.join_timeout_s:g} s (join_timeout_s)"
                              f"{pending} and only {ready} of at least {spec.min_nodes} nodes are ready; check the "
                              "platform's capacity and the node's log, or lower --nnodes MIN", node_id=node_id)
    return Transition(state, (Emit(key=state.end_key, event=failed),))
