"""The rendezvous machine: which nodes form each round, and with which ranks.

The master alone decides rounds (no TCPStore on a training node is the source of
truth). A round's node rank is the node's index in ``members``; nodes of the
previous round keep their order so that every rank lands on the node that holds
its in-memory checkpoint.

Phases of one round::

    WAITING ──round started──▶ ACTIVE ──all members' workers up──▶ COMPLETED
       ▲                          │                                    │
       └──────── failure / node lost (the round is broken) ◀───────────┘
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence

from stead.core.events import LastCall, RoundCompleted, RoundStarted, WorkersStarted, WorkersSucceeded
from stead.core.statemachine.base import Transition, reject
from stead.core.statemachine.effects import Effect, Emit, StartTimer, StartWorkers

__all__ = [
    "RendezvousEvent", "RendezvousState", "natural_key", "order_members", "plan_round", "round_key", "transition",
]

RendezvousEvent = RoundStarted | WorkersStarted | RoundCompleted | WorkersSucceeded


@dataclasses.dataclass(frozen=True, kw_only=True)
class RendezvousState:
    round: int = 0
    members: tuple[str, ...] = ()
    active: bool = False
    completed: bool = False
    started: frozenset[str] = frozenset()
    succeeded: frozenset[str] = frozenset()

    @property
    def all_succeeded(self) -> bool:
        return self.active and bool(self.members) and self.succeeded >= set(self.members)


def natural_key(node_id: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", node_id))


def order_members(previous: Sequence[str], joined: Sequence[str], max_nodes: int) -> tuple[str, ...]:
    """Previous members that are still here keep their order; newcomers follow in natural order."""
    here = set(joined)
    kept = [n for n in previous if n in here]
    old = set(kept)
    fresh = sorted((n for n in here if n not in old), key=natural_key)
    return tuple([*kept, *fresh][:max_nodes])


def round_key(round_: int, seq: int) -> str:
    """The emission key of a round's start, planned at record ``seq``.

    Keyed by the planning record too: records persisted together are folded in order, so a round's start can
    be folded after the loss of one of its members and be refused; the round is then planned again, at a
    later record, under a key of its own (a key per round only would make that impossible).
    """
    return f"round/{round_}/at/{seq}"


def plan_round(
    rdzv: RendezvousState,
    *,
    joined: Sequence[str],
    min_nodes: int,
    max_nodes: int,
    nproc_per_node: int,
    restart_count: int,
    last_call_timeout_s: float,
    now: float,
    seq: int = 0,
    gone: Collection[str] = (),
) -> tuple[Effect, ...]:
    """Start the next round now, arm the last-call timer, or keep waiting.

    A round starts at once when MAX nodes are here, or when every member of the
    previous round is still here (a restart needs no last call), not counting the
    members ``gone`` for good (lost and not replaced, or retired); with at least
    MIN nodes it starts when the last-call timer fires.
    """
    if rdzv.active:
        return ()
    upcoming = rdzv.round + 1
    count = len(joined)  # the names are listed only when a round may start
    previous_all_here = (bool(rdzv.members) and count >= min_nodes and len(gone) < len(rdzv.members)
                         and set(rdzv.members) - set(gone) <= set(joined))
    if count >= max_nodes or previous_all_here:
        members = order_members(rdzv.members, joined, max_nodes)
        started = RoundStarted(
            round=upcoming, members=members, nproc_per_node=nproc_per_node, restart_count=restart_count
        )
        return (Emit(key=round_key(upcoming, seq), event=started),)
    if count >= min_nodes:
        return (StartTimer(name=LastCall(round=upcoming), at=now + last_call_timeout_s),)
    return ()


def transition(
    rdzv: RendezvousState, event: RendezvousEvent, *, incarnations: Mapping[str, int]
) -> Transition[RendezvousState]:
    """Apply a rendezvous event; ``incarnations`` maps member node ids to their current incarnation."""
    match event:
        case RoundStarted():
            if event.round != rdzv.round + 1:
                return reject(rdzv, f"round {event.round} cannot start after round {rdzv.round}")
            missing = [n for n in event.members if n not in incarnations]
            if missing or not event.members:
                return reject(rdzv, f"round {event.round} names unknown nodes {missing or '(none)'}")
            state = RendezvousState(round=event.round, members=event.members, active=True)
            effects: tuple[Effect, ...] = tuple(
                StartWorkers(
                    node_id=node,
                    incarnation=incarnations[node],
                    round=event.round,
                    node_rank=rank,
                    nnodes=len(event.members),
                    nproc_per_node=event.nproc_per_node,
                    restart_count=event.restart_count,
                )
                for rank, node in enumerate(event.members)
            )
            return Transition(state, effects)
        case _ if event.round != rdzv.round or not rdzv.active:
            return Transition(rdzv)  # about an older round: stale, ignored
        case WorkersStarted():
            if event.node_id not in rdzv.members:
                return reject(rdzv, f"node {event.node_id} is not a member of round {rdzv.round}")
            started = rdzv.started | {event.node_id}
            done = started >= set(rdzv.members) and not rdzv.completed
            completed = Emit(key=f"round-completed/{rdzv.round}", event=RoundCompleted(round=rdzv.round))
            return Transition(dataclasses.replace(rdzv, started=started), (completed,) if done else ())
        case RoundCompleted():
            return Transition(dataclasses.replace(rdzv, completed=True))
        case WorkersSucceeded():
            if event.node_id not in rdzv.members:
                return reject(rdzv, f"node {event.node_id} is not a member of round {rdzv.round}")
            return Transition(dataclasses.replace(rdzv, succeeded=rdzv.succeeded | {event.node_id}))
