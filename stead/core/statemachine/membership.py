"""Membership: how many nodes a job runs on, and when a running round changes size.

The job aims at a *target* within MIN:MAX: ``start_nodes`` of its spec (MAX when
unset) until the scaler decides otherwise (``MembershipDecided``); ``JobState.target_nodes``
says which. These pure
functions say what a target means for the nodes:

- which nodes to request to reach it (:func:`requests`): node ids from ``node-0``
  up, new or relaunched, never one still stopping;
- which nodes to *retire* above it (:func:`surplus`): the running round's members
  are kept in their order first (their ranks hold the in-memory checkpoint), then
  ready nodes, then the rest; a retired node is stopped and never relaunched;
- whether the running round should change size (:func:`resize_reason`): it has
  fewer members than the target while more nodes are ready, or more than the
  target.

The job machine carries a resize out at a step boundary: when the job checkpoints,
at its next commit (every rank holds that step, so nothing after it is lost),
within ``resize_wait_s``, and a growing round first gives the other nodes asked for
``grow_window_s`` to come, so that it grows once; then it stops the round's workers and starts the next
round at once (every kept member is there: no last call). A resize spends no
restart.
"""

from __future__ import annotations

from collections.abc import Mapping

from stead.core.events import NodeRequested
from stead.core.statemachine.node import NodePhase, NodeState, is_ready
from stead.core.statemachine.rendezvous import natural_key
from stead.core.statemachine.state import JobState

__all__ = ["available", "coming", "growing", "requests", "resize_reason", "surplus"]


def available(state: JobState) -> list[str]:
    """The ready nodes that may train: joined, checked, not retired."""
    return [n for n, s in state.nodes.items() if is_ready(s) and n not in state.retired]


def growing(state: JobState) -> bool:
    """The running round has fewer members than the target and more nodes are ready."""
    members = len(state.rdzv.members)
    return members < state.target_nodes and len(available(state)) > members


def coming(state: JobState) -> bool:
    """Some live, unretired node is not ready yet (starting, or awaiting its health check) and the target wants it."""
    ready = len(available(state))
    waiting = sum(1 for n, s in state.nodes.items() if s.phase.alive and n not in state.retired and not is_ready(s))
    return waiting > 0 and ready < state.target_nodes


def requests(state: JobState, count: int, *, avoid_hosts: tuple[str, ...] = ()) -> list[NodeRequested]:
    """Node requests that bring the live, unretired nodes up to ``count`` (lowest free ids first); nodes that grow
    a running round join once fully warm (``warm_first``)."""
    assert state.spec is not None
    live = sum(1 for n, s in state.nodes.items() if s.phase.alive and n not in state.retired)
    wanted = count - live
    made: list[NodeRequested] = []
    for index in range(state.spec.max_nodes):
        if len(made) >= wanted:
            break
        node_id = f"node-{index}"
        node = state.nodes.get(node_id)
        if node is not None and node.phase.alive:
            continue  # live (counted), or retired and still stopping: its id is taken until it exits
        incarnation = node.incarnation + 1 if node is not None else 1
        made.append(NodeRequested(node_id=node_id, incarnation=incarnation, avoid_hosts=avoid_hosts,
                                  warm_first=state.rdzv.active))
    return made


def surplus(state: JobState, count: int) -> list[str]:
    """The live, unretired nodes beyond the first ``count`` in keeping order (members, ready, the rest)."""
    nodes: Mapping[str, NodeState] = state.nodes
    live = [n for n, s in nodes.items() if s.phase.alive and n not in state.retired]
    alive = set(live)
    members = [n for n in state.rdzv.members if n in alive]
    kept = set(members)

    def rank(node_id: str) -> tuple[int, tuple[object, ...]]:
        node = nodes[node_id]
        return (0 if is_ready(node) else 1 if node.phase is NodePhase.JOINED else 2), natural_key(node_id)

    ordered = [*members, *sorted((n for n in live if n not in kept), key=rank)]
    return ordered[count:]


def resize_reason(state: JobState) -> str | None:
    """Why the running round should change size now, or None when it should not."""
    members, wanted = len(state.rdzv.members), state.target_nodes
    if members > wanted:
        return f"scaling down from {members} to {wanted} nodes"
    ready = len(available(state))
    if members < wanted and ready > members:  # growing(), with the count already taken
        return f"growing from {members} to {min(ready, wanted)} nodes (target {wanted})"
    return None
