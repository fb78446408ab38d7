"""Table tests of the rendezvous machine, its round planning and its member order."""

from __future__ import annotations

import pytest

from stead.core.events import LastCall, RoundCompleted, RoundStarted, WorkersStarted, WorkersSucceeded
from stead.core.statemachine import Emit, RendezvousState, StartTimer, StartWorkers
from stead.core.statemachine.rendezvous import RendezvousEvent, order_members, plan_round, transition

INCARNATIONS = {"node-0": 1, "node-1": 3, "node-2": 1}
ACTIVE = RendezvousState(round=4, members=("node-1", "node-0"), active=True)


def rs(round: int, members: tuple[str, ...], nproc: int = 2, restarts: int = 0) -> RoundStarted:
    return RoundStarted(round=round, members=members, nproc_per_node=nproc, restart_count=restarts)


def test_round_started_activates_the_round_and_starts_workers_with_ranks_by_member_order() -> None:
    start = RendezvousState(round=4, members=("node-0",), completed=True, started=frozenset({"node-0"}))
    result = transition(start, rs(5, ("node-1", "node-0"), nproc=4, restarts=2), incarnations=INCARNATIONS)
    assert result.rejected is None
    assert result.state == RendezvousState(round=5, members=("node-1", "node-0"), active=True)
    assert result.effects == (
        StartWorkers(node_id="node-1", incarnation=3, round=5, node_rank=0, nnodes=2, nproc_per_node=4,
                     restart_count=2),
        StartWorkers(node_id="node-0", incarnation=1, round=5, node_rank=1, nnodes=2, nproc_per_node=4,
                     restart_count=2),
    )
    assert [e.id for e in result.effects] == ["start-workers/5/node-1", "start-workers/5/node-0"]
    assert isinstance(result.effects[0], StartWorkers) and result.effects[0].world_size == 8


ALLOWED: list[tuple[str, RendezvousState, RendezvousEvent, RendezvousState, tuple[str, ...]]] = [
    ("a member's workers are up", ACTIVE, WorkersStarted(node_id="node-0", round=4),
     RendezvousState(round=4, members=ACTIVE.members, active=True, started=frozenset({"node-0"})), ()),
    ("the last member's workers complete the round",
     RendezvousState(round=4, members=ACTIVE.members, active=True, started=frozenset({"node-0"})),
     WorkersStarted(node_id="node-1", round=4),
     RendezvousState(round=4, members=ACTIVE.members, active=True, started=frozenset({"node-0", "node-1"})),
     ("emit/round-completed/4",)),
    ("a repeated report after completion emits nothing",
     RendezvousState(round=4, members=ACTIVE.members, active=True, completed=True,
                     started=frozenset({"node-0", "node-1"})),
     WorkersStarted(node_id="node-1", round=4),
     RendezvousState(round=4, members=ACTIVE.members, active=True, completed=True,
                     started=frozenset({"node-0", "node-1"})), ()),
    ("round completed", ACTIVE, RoundCompleted(round=4),
     RendezvousState(round=4, members=ACTIVE.members, active=True, completed=True), ()),
    ("a member's workers succeeded", ACTIVE, WorkersSucceeded(node_id="node-1", round=4),
     RendezvousState(round=4, members=ACTIVE.members, active=True, succeeded=frozenset({"node-1"})), ()),
]


@pytest.mark.parametrize(("start", "event", "expected", "effect_ids"), [r[1:] for r in ALLOWED],
                         ids=[r[0] for r in ALLOWED])
def test_allowed_rendezvous_transition(
    start: RendezvousState, event: RendezvousEvent, expected: RendezvousState, effect_ids: tuple[str, ...]
) -> None:
    result = transition(start, event, incarnations=INCARNATIONS)
    assert result.rejected is None
    assert result.state == expected
    assert tuple(e.id for e in result.effects) == effect_ids


def test_round_completed_event_emitted_by_the_last_worker_start() -> None:
    start = RendezvousState(round=4, members=("node-0",), active=True)
    (effect,) = transition(start, WorkersStarted(node_id="node-0", round=4), incarnations=INCARNATIONS).effects
    assert effect == Emit(key="round-completed/4", event=RoundCompleted(round=4))


def test_all_succeeded_needs_every_member_of_an_active_round() -> None:
    both = frozenset({"node-0", "node-1"})
    assert RendezvousState(round=1, members=("node-0", "node-1"), active=True, succeeded=both).all_succeeded
    assert not RendezvousState(round=1, members=("node-0", "node-1"), active=True,
                               succeeded=frozenset({"node-0"})).all_succeeded
    assert not RendezvousState(round=1, members=("node-0", "node-1"), active=False, succeeded=both).all_succeeded
    assert not RendezvousState(round=1, members=(), active=True).all_succeeded


STALE: list[tuple[str, RendezvousState, RendezvousEvent]] = [
    ("workers started of an older round", ACTIVE, WorkersStarted(node_id="node-0", round=3)),
    ("workers succeeded of an older round", ACTIVE, WorkersSucceeded(node_id="node-0", round=3)),
    ("round completed of an older round", ACTIVE, RoundCompleted(round=3)),
    ("workers started of a broken round", RendezvousState(round=4, members=("node-0",)),
     WorkersStarted(node_id="node-0", round=4)),
    ("workers succeeded of a broken round", RendezvousState(round=4, members=("node-0",)),
     WorkersSucceeded(node_id="node-0", round=4)),
    ("workers started of a future round", ACTIVE, WorkersStarted(node_id="node-0", round=9)),
]


@pytest.mark.parametrize(("start", "event"), [r[1:] for r in STALE], ids=[r[0] for r in STALE])
def test_events_of_another_or_inactive_round_are_ignored(start: RendezvousState, event: RendezvousEvent) -> None:
    result = transition(start, event, incarnations=INCARNATIONS)
    assert result.rejected is None
    assert result.state is start
    assert result.effects == ()


FORBIDDEN: list[tuple[str, RendezvousState, RendezvousEvent, str]] = [
    ("round number skips ahead", RendezvousState(round=1), rs(3, ("node-0",)), "cannot start after round 1"),
    ("round number repeats", ACTIVE, rs(4, ("node-0",)), "cannot start after round 4"),
    ("round number goes back", ACTIVE, rs(2, ("node-0",)), "cannot start after round 4"),
    ("unknown member", RendezvousState(), rs(1, ("node-0", "node-7")), "unknown nodes ['node-7']"),
    ("no members", RendezvousState(), rs(1, ()), "unknown nodes (none)"),
    ("workers started on a non-member", ACTIVE, WorkersStarted(node_id="node-2", round=4), "not a member"),
    ("workers succeeded on a non-member", ACTIVE, WorkersSucceeded(node_id="node-2", round=4), "not a member"),
]


@pytest.mark.parametrize(("start", "event", "reason"), [r[1:] for r in FORBIDDEN], ids=[r[0] for r in FORBIDDEN])
def test_forbidden_rendezvous_transition_is_rejected_unchanged(
    start: RendezvousState, event: RendezvousEvent, reason: str
) -> None:
    result = transition(start, event, incarnations=INCARNATIONS)
    assert result.rejected is not None
    assert reason in result.rejected
    assert result.state is start
    assert result.effects == ()


def plan(rdzv: RendezvousState, joined: tuple[str, ...], *, min_nodes: int = 2, max_nodes: int = 3) -> tuple[
    object, ...
]:
    return plan_round(rdzv, joined=joined, min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=2,
                      restart_count=1, last_call_timeout_s=5.0, now=10.0)


PLANS: list[tuple[str, RendezvousState, tuple[str, ...], tuple[object, ...]]] = [
    ("fewer than MIN: keep waiting", RendezvousState(), ("node-0",), ()),
    ("MIN joined: arm the last call", RendezvousState(), ("node-0", "node-1"),
     (StartTimer(name=LastCall(round=1), at=15.0),)),
    ("MAX joined: start at once", RendezvousState(), ("node-2", "node-0", "node-1"),
     (Emit(key="round/1/at/0", event=rs(1, ("node-0", "node-1", "node-2"), restarts=1)),)),
    ("previous members all back: restart at once without a last call",
     RendezvousState(round=2, members=("node-1", "node-0")), ("node-0", "node-1"),
     (Emit(key="round/3/at/0", event=rs(3, ("node-1", "node-0"), restarts=1)),)),
    ("previous members partly back: last call", RendezvousState(round=2, members=("node-1", "node-0", "node-2")),
     ("node-0", "node-1"), (StartTimer(name=LastCall(round=3), at=15.0),)),
    ("a round is active: nothing", RendezvousState(round=2, members=("node-0",), active=True),
     ("node-0", "node-1", "node-2"), ()),
]


@pytest.mark.parametrize(("rdzv", "joined", "expected"), [r[1:] for r in PLANS], ids=[r[0] for r in PLANS])
def test_plan_round(rdzv: RendezvousState, joined: tuple[str, ...], expected: tuple[object, ...]) -> None:
    assert plan(rdzv, joined) == expected


def test_previous_members_back_below_min_keep_waiting() -> None:
    rdzv = RendezvousState(round=1, members=("node-0",))
    assert plan(rdzv, ("node-0",), min_nodes=2) == ()


@pytest.mark.parametrize(
    ("previous", "joined", "max_nodes", "expected"),
    [
        ((), ("node-10", "node-2", "node-1"), 5, ("node-1", "node-2", "node-10")),
        (("node-2", "node-0"), ("node-0", "node-1", "node-2"), 5, ("node-2", "node-0", "node-1")),
        (("node-2", "node-0"), ("node-0", "node-1"), 5, ("node-0", "node-1")),
        (("node-2", "node-0"), ("node-3", "node-0", "node-1", "node-2"), 3, ("node-2", "node-0", "node-1")),
    ],
    ids=["natural order", "previous keep their ranks", "lost member drops out", "capped at MAX"],
)
def test_order_members(
    previous: tuple[str, ...], joined: tuple[str, ...], max_nodes: int, expected: tuple[str, ...]
) -> None:
    assert order_members(previous, joined, max_nodes) == expected
