"""Table tests of the node machine: every allowed transition and a sample of forbidden ones."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from stead.core.events import NodeExited, NodeJoined, NodeLost, NodeRequested, NodeStarted
from stead.core.statemachine import KillNode, LaunchNode, NodePhase, NodeState
from stead.core.statemachine.node import NodeEvent, transition

NOW = 100.0
N = "node-0"


def node(phase: NodePhase, incarnation: int = 1, **fields: Any) -> NodeState:
    return dataclasses.replace(NodeState(node_id=N, incarnation=incarnation, phase=phase), **fields)


def requested(inc: int) -> NodeRequested:
    return NodeRequested(node_id=N, incarnation=inc)


def started(inc: int = 1, host: str = "h1", pid: int | None = 42) -> NodeStarted:
    return NodeStarted(node_id=N, incarnation=inc, host=host, pid=pid)


def joined(inc: int = 1, host: str = "") -> NodeJoined:
    return NodeJoined(node_id=N, incarnation=inc, host=host)


def lost(inc: int = 1) -> NodeLost:
    return NodeLost(node_id=N, incarnation=inc)


def exited(inc: int = 1, code: int | None = 1, sig: int | None = None) -> NodeExited:
    return NodeExited(node_id=N, incarnation=inc, exit_code=code, signal=sig)


ALIVE = [NodePhase.REQUESTED, NodePhase.STARTED, NodePhase.JOINED]
DEAD = [NodePhase.LOST, NodePhase.EXITED]

# (start, event, expected state, expected effects)
ALLOWED: list[tuple[str, NodeState | None, NodeEvent, NodeState, tuple[object, ...]]] = [
    ("first request launches incarnation 1", None, requested(1),
     node(NodePhase.REQUESTED), (LaunchNode(node_id=N, incarnation=1),)),
    ("relaunch of a lost node", node(NodePhase.LOST, host="h1"), requested(2),
     node(NodePhase.REQUESTED, 2), (LaunchNode(node_id=N, incarnation=2),)),
    ("relaunch of an exited node", node(NodePhase.EXITED, exit_code=1), requested(2),
     node(NodePhase.REQUESTED, 2), (LaunchNode(node_id=N, incarnation=2),)),
    ("platform reports the node running", node(NodePhase.REQUESTED), started(),
     node(NodePhase.STARTED, host="h1", pid=42), ()),
    ("agent registers after start", node(NodePhase.STARTED, host="h1", pid=42), joined(),
     node(NodePhase.JOINED, host="h1", pid=42), ()),
    ("agent's host wins over the platform's", node(NodePhase.STARTED, host="h1"), joined(host="h2"),
     node(NodePhase.JOINED, host="h2"), ()),
    ("NodeJoined before NodeStarted", node(NodePhase.REQUESTED), joined(host="h3"),
     node(NodePhase.JOINED, host="h3"), ()),
    ("late NodeStarted after join keeps JOINED, records pid and the platform's host", node(NodePhase.JOINED,
     host="h3"), started(pid=7), node(NodePhase.JOINED, host="h1", pid=7), ()),
    ("late NodeStarted naming no host keeps the agent's", node(NodePhase.JOINED, host="h3"),
     NodeStarted(node_id=N, incarnation=1, pid=7), node(NodePhase.JOINED, host="h3", pid=7), ()),
    ("re-registration after a master restart", node(NodePhase.JOINED, host="h"), joined(host="other"),
     node(NodePhase.JOINED, host="h"), ()),
    *[(f"{p.value} node lost is killed", node(p), lost(), node(NodePhase.LOST), (KillNode(node_id=N, incarnation=1),))
      for p in ALIVE],
    *[(f"{p.value} node lost again changes nothing", node(p), lost(), node(p), ()) for p in DEAD],
    *[(f"{p.value} node exits", node(p), exited(code=3, sig=None), node(NodePhase.EXITED, exit_code=3), ())
      for p in [*ALIVE, *DEAD]],
    ("exit by signal", node(NodePhase.JOINED), exited(code=None, sig=9),
     node(NodePhase.EXITED, signal=9), ()),
]


@pytest.mark.parametrize(("start", "event", "expected", "effects"), [row[1:] for row in ALLOWED],
                         ids=[row[0] for row in ALLOWED])
def test_allowed_node_transition(
    start: NodeState | None, event: NodeEvent, expected: NodeState, effects: tuple[object, ...]
) -> None:
    result = transition(start, event, now=NOW)
    assert result.rejected is None
    assert result.state == expected
    assert result.effects == effects


@pytest.mark.parametrize("phase", [*ALIVE, *DEAD])
@pytest.mark.parametrize("event", [started(1), joined(1), lost(1), exited(1), requested(1)],
                         ids=lambda e: type(e).__name__)
def test_events_of_an_older_incarnation_are_ignored(phase: NodePhase, event: NodeEvent) -> None:
    start = node(phase, incarnation=2)
    result = transition(start, event, now=NOW)
    if isinstance(event, NodeRequested):  # a request is never stale: an old one is refused
        assert result.rejected is not None
        assert "already requested" in result.rejected
    else:
        assert result.rejected is None
    assert result.state is start
    assert result.effects == ()


FORBIDDEN: list[tuple[str, NodeState | None, NodeEvent, str]] = [
    *[(f"{type(e).__name__} of a node never requested", None, e, "never requested")
      for e in (started(), joined(), lost(), exited())],
    ("same incarnation requested twice", node(NodePhase.REQUESTED), requested(1), "already requested"),
    *[(f"relaunch while {p.value}", node(p), requested(2), "must be lost or exit first") for p in ALIVE],
    ("started twice", node(NodePhase.STARTED), started(), "cannot start"),
    *[(f"start after {p.value}", node(p), started(), "cannot start") for p in DEAD],
    *[(f"join after {p.value}", node(p), joined(), "cannot join") for p in DEAD],
    *[(f"{type(e).__name__} of an incarnation never requested", node(NodePhase.JOINED), e, "never requested")
      for e in (started(2), joined(2), lost(2), exited(2))],
]


@pytest.mark.parametrize(("start", "event", "reason"), [row[1:] for row in FORBIDDEN],
                         ids=[row[0] for row in FORBIDDEN])
def test_forbidden_node_transition_is_rejected_unchanged(
    start: NodeState | None, event: NodeEvent, reason: str
) -> None:
    result = transition(start, event, now=NOW)
    assert result.rejected is not None
    assert reason in result.rejected
    assert N in result.rejected
    assert result.state is start
    assert result.effects == ()


def test_node_transition_does_not_depend_on_time() -> None:
    for event in (started(), joined(), lost(), exited()):
        assert transition(node(NodePhase.REQUESTED), event, now=0.0) == transition(
            node(NodePhase.REQUESTED), event, now=1e9
        )
