"""What follows a node's end: its relaunch (with the resources decided for it), or the job's end.

Pure functions of the job machine (:mod:`.job`), kept apart from it: a live node that
is lost or exits breaks its round and is relaunched within ``max_node_relaunches``
(away from the excluded hosts); one its platform killed for its memory waits for its
resources to be decided first (``NodeResourcesDecided``, or ``decision_timeout_s``);
one the platform cannot start as specified fails the job at once; past its budget the
job goes on with the survivors while MIN hold, else it fails.
"""

from __future__ import annotations

import dataclasses

from stead.core.events import JobFailed, NodeRequested, NodeResourcesDecided, ResourcesTimeout
from stead.core.statemachine import rounds
from stead.core.statemachine.base import Transition, reject
from stead.core.statemachine.effects import Effect, Emit, StartTimer, StopWorkers
from stead.core.statemachine.node import NodePhase, NodeState
from stead.core.statemachine.state import JobPhase, JobState

__all__ = ["cannot_start", "node_gone", "relaunch", "resources_decided", "resources_timeout"]


def relaunch(state: JobState, node: NodeState, resources: tuple[tuple[str, str], ...], *,
              now: float) -> list[Effect]:
    """The node's next incarnation, away from the excluded hosts, with ``resources``; it must join in time, or the
    job goes on without it (at least MIN) or fails (fewer)."""
    assert state.spec is not None
    requested = NodeRequested(node_id=node.node_id, incarnation=node.incarnation + 1,
                              avoid_hosts=tuple(sorted(state.excluded_hosts)), resources=resources)
    return [Emit(key=f"request/{node.node_id}/{node.incarnation + 1}", event=requested),
            StartTimer(name=rounds.rejoin_timer(requested), at=now + state.spec.join_timeout_s)]


def _resources_timer(node: NodeState) -> ResourcesTimeout:
    return ResourcesTimeout(node_id=node.node_id, incarnation=node.incarnation)


def resources_decided(state: JobState, event: NodeResourcesDecided, *, now: float) -> Transition[JobState]:
    """The relaunch of a node killed for its memory goes out with the resources decided for it."""
    node = state.nodes.get(event.node_id)
    if node is None or node.incarnation != event.incarnation or event.node_id not in state.awaiting_resources:
        return reject(state, f"no relaunch of node {event.node_id} incarnation {event.incarnation} waits for its "
                             "resources")
    waiting = dataclasses.replace(state, awaiting_resources=state.awaiting_resources - {event.node_id})
    return Transition(waiting, tuple(relaunch(waiting, node, event.resources or node.resources, now=now)))


def cannot_start(state: JobState, node_id: str, why: str) -> Emit:
    """The job fails at once: the platform cannot start this node as it is specified, and a relaunch of the same
    spec would fail the same way (rather than spend every relaunch, and the user's time, on it)."""
    failed = JobFailed(reason=f"node {node_id} cannot be started: {why}; fix the job's specification (image, "
                              "command, resources) and run it again", node_id=node_id)
    return Emit(key=state.end_key, event=failed)


def node_gone(state: JobState, node: NodeState, *, now: float, oom: bool = False) -> tuple[JobState, list[Effect]]:
    """A live node was lost or exited: break its round, relaunch it or fail the job. A node its platform killed
    for its memory (``oom``) is relaunched once its resources are decided (NodeResourcesDecided), or after
    decision_timeout_s with the same ones."""
    spec = state.spec
    assert spec is not None
    effects: list[Effect] = []
    if node.node_id in state.retired:
        return state, effects  # stopped because the job shrank: not relaunched, not a failure
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
    if node.incarnation - state.resumed_at.get(node.node_id, 0) <= spec.max_node_relaunches:
        if oom:
            effects.append(StartTimer(name=_resources_timer(node), at=now + spec.decision_timeout_s))
            return dataclasses.replace(state, awaiting_resources=state.awaiting_resources | {node.node_id}), effects
        return state, effects + relaunch(state, node, node.resources, now=now)
    alive = sum(1 for n, s in state.nodes.items() if s.phase.alive and n not in state.retired)
    if alive < spec.min_nodes:
        failed = JobFailed(
            reason=f"node {node.node_id} was {node.phase.value} "
            f"{node.incarnation - state.resumed_at.get(node.node_id, 0)} times "
            f"(max_node_relaunches={spec.max_node_relaunches}) and fewer than {spec.min_nodes} "
            "nodes remain",
            node_id=node.node_id,
        )
        effects.append(Emit(key=state.end_key, event=failed))
        return state, effects
    return state, effects + list(rounds.plan(state, now=now))


def resources_timeout(state: JobState, timer: ResourcesTimeout, *, now: float) -> Transition[JobState]:
    """No plugin decided the resources of a node killed for its memory in time: it is relaunched with the same."""
    node_id = timer.node_id
    node = state.nodes.get(node_id)
    if node is None or node_id not in state.awaiting_resources or node.incarnation != timer.incarnation:
        return Transition(state)  # decided meanwhile, or about an older incarnation
    waiting = dataclasses.replace(state, awaiting_resources=state.awaiting_resources - {node_id})
    return Transition(waiting, tuple(relaunch(waiting, node, node.resources, now=now)))
