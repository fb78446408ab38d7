"""Membership in the job machine: a target within MIN:MAX, growing and shrinking a running round.

Histories are folded with :mod:`stead.testing.replay` (emitted events followed), then one event is
applied with ``transition`` so each row shows exactly what that step asks for.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stead.core.events import (
    CheckpointCommitted,
    Event,
    GrowWindow,
    HealthChecked,
    HealthCheckStarted,
    JobFailed,
    JobSubmitted,
    LastCall,
    MembershipDecided,
    NodeExited,
    NodeJoined,
    NodeLost,
    NodeStarted,
    RejoinTimeout,
    ResizeWait,
    TimerFired,
)
from stead.core.statemachine import Emit, JobPhase, JobState, NodePhase, StartTimer, StopNode, transition
from stead.core.statemachine.membership import requests, surplus
from stead.testing.replay import fold, folded, node_up

NOW = 1000.0
SPEC = JobSubmitted(job="j", min_nodes=1, max_nodes=3, nproc_per_node=2, max_restarts=0, max_node_relaunches=1,
                    last_call_timeout_s=5.0, join_timeout_s=60.0, start_nodes=1, resize_wait_s=20.0)


def after(*events: Event, start: JobState | None = None) -> JobState:
    return folded(*events, now=NOW, start=start)


up = node_up


def scale(n: int) -> MembershipDecided:
    return MembershipDecided(target=n, reason="test", by="test")


def ids(effects: tuple[object, ...]) -> list[str]:
    return [e.id.split("/at/")[0] for e in effects]  # type: ignore[attr-defined]


ONE = after(SPEC, *up("node-0"))
TO_THREE = after(scale(3), start=ONE)
TWO_RUNNING = after(*up("node-1"), TimerFired(name=GrowWindow(round=1)), start=TO_THREE)  # node-2 was not there in time
THREE_RUNNING = after(*up("node-2"), start=TWO_RUNNING)


def test_a_job_with_start_nodes_requests_that_many_and_starts_on_them_at_once() -> None:
    started = after(SPEC)
    assert list(started.nodes) == ["node-0"] and started.target_nodes == 1
    assert ONE.phase is JobPhase.RUNNING and ONE.rdzv.members == ("node-0",)  # its target is here: no last call


def test_scaling_up_requests_the_missing_nodes_and_the_running_round_grows_by_those_that_come() -> None:
    result = transition(ONE, scale(3), now=NOW)
    assert ids(result.effects) == ["emit/request/node-1/1", "emit/request/node-2/1"]
    assert result.state.phase is JobPhase.RUNNING and result.state.target == 3
    assert TWO_RUNNING.rdzv.round == 2 and TWO_RUNNING.rdzv.members == ("node-0", "node-1")
    assert THREE_RUNNING.rdzv.round == 3 and THREE_RUNNING.rdzv.members == ("node-0", "node-1", "node-2")
    assert THREE_RUNNING.restarts == 0  # a resize spends no restart


def test_a_round_grows_once_for_the_nodes_that_come_within_the_last_call() -> None:
    first = transition(after(NodeStarted(node_id="node-1", incarnation=1), start=TO_THREE),
                       NodeJoined(node_id="node-1", incarnation=1), now=NOW)
    assert first.effects == (StartTimer(name=GrowWindow(round=1), at=NOW + SPEC.grow_window_s),)  # node-2 is coming
    both = transition(after(*up("node-1"), NodeStarted(node_id="node-2", incarnation=1), start=TO_THREE),
                      NodeJoined(node_id="node-2", incarnation=1), now=NOW)
    assert ids(both.effects) == ["stop-workers/1/node-0", "emit/round/2"]  # no checkpoint: no boundary to wait for
    assert both.state.phase is JobPhase.RECOVERING and not both.state.resizing
    late = transition(after(*up("node-1"), start=TO_THREE), TimerFired(name=GrowWindow(round=1)), now=NOW + 5)
    assert ids(late.effects) == ["stop-workers/1/node-0", "emit/round/2"]  # the window ended: grow by node-1


def test_with_checkpoints_a_resize_waits_for_the_next_commit() -> None:
    saving = after(CheckpointCommitted(step=5), *up("node-1"), NodeStarted(node_id="node-2", incarnation=1),
                   start=TO_THREE)
    waiting = transition(saving, NodeJoined(node_id="node-2", incarnation=1), now=NOW)
    assert waiting.effects == (StartTimer(name=ResizeWait(round=1), at=NOW + SPEC.resize_wait_s),)
    assert waiting.state.resizing and waiting.state.phase is JobPhase.RUNNING
    committed = transition(waiting.state, CheckpointCommitted(step=6), now=NOW)
    assert ids(committed.effects) == ["stop-workers/1/node-0", "emit/round/2"]
    assert committed.state.checkpoint_step == 6 and not committed.state.resizing
    timed_out = transition(waiting.state, TimerFired(name=ResizeWait(round=1)), now=NOW + 20)  # no commit came in time
    assert ids(timed_out.effects) == ["stop-workers/1/node-0", "emit/round/2"]


def test_scaling_down_retires_the_last_nodes_and_restarts_the_round_on_the_rest() -> None:
    result = transition(THREE_RUNNING, scale(2), now=NOW)
    assert ids(result.effects) == ["stop-workers/3/node-0", "stop-workers/3/node-1", "stop-node/node-2/1",
                                   "emit/round/4"]
    assert isinstance(result.effects[2], StopNode) and "scaling down from 3 to 2" in result.effects[2].reason
    assert result.state.retired == {"node-2"}
    shrunk = after(scale(2), start=THREE_RUNNING)
    assert shrunk.rdzv.members == ("node-0", "node-1") and shrunk.phase is JobPhase.RUNNING
    gone = transition(shrunk, NodeExited(node_id="node-2", incarnation=1, exit_code=0), now=NOW)
    assert gone.effects == () and gone.state.phase is JobPhase.RUNNING  # retired: not relaunched, not a failure


def test_growing_again_requests_a_retired_node_once_it_has_exited() -> None:
    shrunk = after(scale(2), start=THREE_RUNNING)
    while_stopping = transition(shrunk, scale(3), now=NOW)
    assert ids(while_stopping.effects) == []  # its id is taken until it exits; max 3 ids, all in use
    exited = after(NodeExited(node_id="node-2", incarnation=1, exit_code=0), start=shrunk)
    regrow = transition(exited, scale(3), now=NOW)
    assert ids(regrow.effects) == ["emit/request/node-2/2"] and regrow.state.retired == frozenset()


def test_scaling_down_before_the_nodes_joined_drops_the_ones_still_starting() -> None:
    starting = after(dataclasses.replace(SPEC, start_nodes=3))
    result = transition(starting, scale(1), now=NOW)
    assert ids(result.effects) == ["emit/retire/node-1/1", "emit/retire/node-2/1"]
    lost = result.effects[0]
    assert isinstance(lost, Emit) and isinstance(lost.event, NodeLost)
    dropped = after(scale(1), *up("node-0"), start=starting)
    assert dropped.rdzv.members == ("node-0",) and dropped.nodes["node-1"].phase is NodePhase.LOST
    assert "node-1" not in [n for n, s in dropped.nodes.items() if s.incarnation > 1]  # not relaunched


@pytest.mark.parametrize("bad", [0, 4, -1])
def test_a_decision_outside_min_max_is_rejected_and_the_job_keeps_its_size(bad: int) -> None:
    result = transition(THREE_RUNNING, scale(bad), now=NOW)
    assert result.rejected is not None and "outside MIN:MAX 1:3" in result.rejected
    assert result.state == THREE_RUNNING and result.effects == ()


def test_a_replacement_that_never_joins_fails_the_job_only_below_min() -> None:
    pair = dataclasses.replace(SPEC, min_nodes=2, start_nodes=2)
    lost = after(pair, *up("node-0"), *up("node-1"), NodeLost(node_id="node-1", incarnation=1))
    rejoin = TimerFired(name=RejoinTimeout(node_id="node-1", incarnation=2))
    assert rejoin.name in lost.timers
    failed = transition(lost, rejoin, now=NOW + 60)
    (effect,) = failed.effects
    assert isinstance(effect, Emit) and isinstance(effect.event, JobFailed)
    assert "node node-1 was not replaced within 60 s" in effect.event.reason
    joined = after(*up("node-1", 2), start=lost)
    assert transition(joined, rejoin, now=NOW + 60).effects == ()
    elastic = after(dataclasses.replace(pair, min_nodes=1), *up("node-0"), *up("node-1"),
                    NodeLost(node_id="node-1", incarnation=1), TimerFired(name=LastCall(round=2)))
    assert elastic.phase is JobPhase.RUNNING and elastic.rdzv.members == ("node-0",)  # shrunk after the last call
    assert transition(elastic, rejoin, now=NOW + 60).effects == ()


def test_keeping_order_is_members_then_ready_then_the_rest() -> None:
    state = after(NodeStarted(node_id="node-2", incarnation=1), start=after(*up("node-1"), start=TO_THREE))
    assert surplus(state, 1) == ["node-1", "node-2"] and surplus(state, 2) == ["node-2"]
    assert [r.node_id for r in requests(state, 3)] == []


ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("scale"), st.integers(-1, 4)),
    st.tuples(st.just("join"), st.integers(0, 2)),
    st.tuples(st.just("exit"), st.integers(0, 2)),
    st.tuples(st.just("commit"), st.integers(0, 100)),
    st.tuples(st.just("timer"), st.integers(0, 5)),
    st.tuples(st.just("grow"), st.integers(0, 5)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ACTIONS)
def test_rounds_stay_within_min_max_and_never_hold_a_retired_node(actions: list[tuple[str, int]]) -> None:
    state = after(SPEC)
    for kind, value in actions:
        node = f"node-{value}"
        current = state.nodes.get(node)
        event: Event
        if kind == "scale":
            event = scale(value)
        elif kind == "join" and current is not None:
            event = NodeJoined(node_id=node, incarnation=current.incarnation)
        elif kind == "exit" and current is not None:
            event = NodeExited(node_id=node, incarnation=current.incarnation, exit_code=0)
        elif kind == "commit":
            event = CheckpointCommitted(step=value)
        elif kind == "grow":
            event = TimerFired(name=GrowWindow(round=value))
        else:
            event = TimerFired(name=ResizeWait(round=value))
        state, _, _ = fold([event], now=NOW, start=state)
        assert SPEC.min_nodes <= state.target_nodes <= SPEC.max_nodes
        if state.rdzv.active:
            assert not set(state.rdzv.members) & state.retired
            assert len(state.rdzv.members) <= state.target_nodes or state.resizing  # (shrinks at the next commit)
        live = [n for n, s in state.nodes.items() if s.phase.alive and n not in state.retired]
        assert len(live) <= SPEC.max_nodes


def test_a_running_job_gives_up_a_node_that_never_got_room_and_asks_for_it_again_later() -> None:
    waiting_for_room = after(scale(2), start=ONE)  # node-1 requested: the platform has no room for it
    gave_up = transition(waiting_for_room, scale(1), now=NOW)
    assert ids(gave_up.effects) == ["emit/retire/node-1/1"]  # not in the round: dropped at once, no resize
    assert gave_up.state.rdzv.active and gave_up.state.rdzv.round == 1
    dropped = after(scale(1), start=waiting_for_room)
    assert dropped.nodes["node-1"].phase is NodePhase.LOST and dropped.phase is JobPhase.RUNNING
    again = transition(after(NodeExited(node_id="node-1", incarnation=1), start=dropped), scale(2), now=NOW)
    assert ids(again.effects) == ["emit/request/node-1/2"]


def test_a_node_that_joins_a_running_job_and_must_be_checked_is_checked_with_a_training_partner() -> None:
    checked = dataclasses.replace(SPEC, health_check="all")
    running = after(checked, *up("node-0"), HealthChecked(check=1, nodes=("node-0",)), scale(2))
    assert running.phase is JobPhase.RUNNING and running.rdzv.members == ("node-0",)
    joined = transition(after(NodeStarted(node_id="node-1", incarnation=1), start=running),
                        NodeJoined(node_id="node-1", incarnation=1), now=NOW)
    [check] = [e for e in joined.effects if isinstance(e, Emit) and isinstance(e.event, HealthCheckStarted)]
    assert check.event.checked == ("node-1",) and set(check.event.nodes) == {"node-0", "node-1"}
