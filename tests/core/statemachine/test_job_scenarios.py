"""Whole job stories folded the way the reactor folds them (``Emit`` follow-ups right after their cause)."""

from __future__ import annotations

import dataclasses

import pytest

from stead.core.events import (
    Event,
    JobSubmitted,
    JobSucceeded,
    JoinTimeout,
    LastCall,
    NodeExited,
    NodeJoined,
    NodeLost,
    NodeRequested,
    NodeStarted,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    TimerFired,
    TransitionRejected,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.statemachine import (
    Emit,
    JobPhase,
    KillNode,
    LaunchNode,
    StartTimer,
    StartWorkers,
    StopNode,
    StopWorkers,
)
from stead.testing.replay import DuplicateEmit, Folder, fold, replay

SPEC = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=2, max_restarts=2, max_node_relaunches=1,
                    last_call_timeout_s=5.0, join_timeout_s=60.0)
ELASTIC = dataclasses.replace(SPEC, min_nodes=2, max_nodes=3)


def up(*nodes: str, inc: int = 1) -> list[Event]:
    return [e for n in nodes for e in (NodeStarted(node_id=n, incarnation=inc), NodeJoined(node_id=n, incarnation=inc))]


def workers_up(round: int, *nodes: str) -> list[Event]:
    return [WorkersStarted(node_id=n, round=round) for n in nodes]


def succeeded(round: int, *nodes: str) -> list[Event]:
    return [WorkersSucceeded(node_id=n, round=round) for n in nodes]


def failure(node: str, round: int, tail: str = "RuntimeError: connection reset") -> WorkerFailed:
    return WorkerFailed(node_id=node, round=round, local_rank=0, rank=0, exit_code=1, error_tail=tail)


def restart(round: int) -> RecoveryDecided:
    return RecoveryDecided(round=round, action=RecoveryAction.RESTART, reason="transient")


def test_fault_free_job_succeeds_and_stops_its_nodes() -> None:
    run = replay([SPEC, *up("node-0", "node-1"), *workers_up(1, "node-0", "node-1"),
                  *succeeded(1, "node-0", "node-1")])
    assert run.rejections == ()
    assert run.state.phase is JobPhase.SUCCEEDED
    assert [type(e) for e in run.log] == [
        JobSubmitted, NodeRequested, NodeRequested, NodeStarted, NodeJoined, NodeStarted, NodeJoined, RoundStarted,
        WorkersStarted, WorkersStarted, RoundCompleted, WorkersSucceeded, WorkersSucceeded, JobSucceeded,
    ]
    assert [(type(e), e.id) for e in run.effects if not isinstance(e, Emit)] == [
        (StartTimer, "timer/join-timeout"), (LaunchNode, "launch/node-0/1"), (LaunchNode, "launch/node-1/1"),
        (StartWorkers, "start-workers/1/node-0"), (StartWorkers, "start-workers/1/node-1"),
        (StopNode, "stop-node/node-0/1"), (StopNode, "stop-node/node-1/1"),
    ]
    assert [s.seq for s in run.steps] == list(range(1, 15))
    assert run.state.seq == 14


def test_follow_up_events_record_their_cause() -> None:
    run = replay([SPEC, *up("node-0", "node-1")])
    causes = {type(s.event).__name__: s.cause for s in run.steps if s.cause is not None}
    assert causes == {"NodeRequested": 1, "RoundStarted": 7}


def test_transient_failures_restart_until_the_budget_is_spent_then_fail_with_the_error_tail() -> None:
    events: list[Event] = [SPEC, *up("node-0", "node-1")]
    for round in (1, 2, 3):
        events += [*workers_up(round, "node-0", "node-1"), failure("node-1", round, tail=f"boom {round}"),
                   failure("node-0", round), restart(round)]
    state, effects, rejections = fold(events)
    assert rejections == []
    assert state.phase is JobPhase.FAILED
    assert state.restarts == SPEC.max_restarts == 2
    assert state.rdzv.round == 3
    assert "max restarts exhausted (2)" in state.reason
    assert state.message == "boom 3"
    starts = [e for e in effects if isinstance(e, StartWorkers)]
    assert [(e.round, e.node_rank, e.restart_count) for e in starts] == [
        (1, 0, 0), (1, 1, 0), (2, 0, 1), (2, 1, 1), (3, 0, 2), (3, 1, 2)]


def test_fail_decision_ends_the_job_without_a_restart() -> None:
    decision = RecoveryDecided(round=1, action=RecoveryAction.FAIL, reason="user code error")
    state, effects, rejections = fold([SPEC, *up("node-0", "node-1"), failure("node-0", 1, tail="KeyError"), decision])
    assert rejections == []
    assert (state.phase, state.reason, state.message, state.restarts) == (
        JobPhase.FAILED, "user code error", "KeyError", 0)
    assert [e.id for e in effects if isinstance(e, StopNode)] == ["stop-node/node-0/1", "stop-node/node-1/1"]


def test_lost_node_is_relaunched_and_the_job_goes_on_in_a_new_round() -> None:
    events: list[Event] = [SPEC, *up("node-0", "node-1"), *workers_up(1, "node-0", "node-1"),
                           NodeLost(node_id="node-0", incarnation=1),
                           NodeExited(node_id="node-0", incarnation=1, signal=9),  # the killed incarnation: stale
                           *up("node-0", inc=2), *workers_up(2, "node-0", "node-1"), *succeeded(2, "node-0", "node-1")]
    state, effects, rejections = fold(events)
    assert rejections == []
    assert state.phase is JobPhase.SUCCEEDED
    assert state.restarts == 0  # a relaunch is paid from the relaunch budget, not the restart budget
    assert [e for e in effects if isinstance(e, (KillNode, StopWorkers))] == [
        KillNode(node_id="node-0", incarnation=1),
        StopWorkers(node_id="node-1", incarnation=1, round=1, reason="node node-0 lost"),
    ]
    starts = [(e.round, e.node_id, e.incarnation, e.node_rank) for e in effects if isinstance(e, StartWorkers)]
    assert starts[2:] == [(2, "node-0", 2, 0), (2, "node-1", 1, 1)]


def test_node_lost_more_often_than_the_relaunch_budget_fails_the_job() -> None:
    events: list[Event] = [SPEC, *up("node-0", "node-1"), NodeLost(node_id="node-1", incarnation=1),
                           *up("node-1", inc=2), NodeLost(node_id="node-1", incarnation=2)]
    state, effects, rejections = fold(events)
    assert rejections == []
    assert state.phase is JobPhase.FAILED
    assert "max_node_relaunches=1" in state.reason
    assert [e.id for e in effects if isinstance(e, LaunchNode)] == [
        "launch/node-0/1", "launch/node-1/1", "launch/node-1/2"]
    assert [e.id for e in effects if isinstance(e, StopNode)] == ["stop-node/node-0/1"]


def test_elastic_job_starts_with_min_nodes_after_the_last_call_and_shrinks_to_min() -> None:
    spec = dataclasses.replace(ELASTIC, max_node_relaunches=0)
    run = replay([spec, *up("node-0", "node-1")], now=10.0)
    assert run.state.phase is JobPhase.STARTING
    assert StartTimer(name=LastCall(round=1), at=15.0) in run.effects
    state, _, rejections = fold([TimerFired(name=LastCall(round=1))], start=run.state)
    assert rejections == []
    assert (state.phase, state.rdzv.members) == (JobPhase.RUNNING, ("node-0", "node-1"))

    grown = fold([spec, *up("node-2", "node-0", "node-1")])[0]
    assert (grown.phase, grown.rdzv.members) == (JobPhase.RUNNING, ("node-0", "node-1", "node-2"))
    shrunk, effects, rejections = fold([NodeLost(node_id="node-1", incarnation=1), TimerFired(name=LastCall(round=2))],
                                       start=grown)
    assert rejections == []
    assert (shrunk.phase, shrunk.rdzv.round, shrunk.rdzv.members) == (JobPhase.RUNNING, 2, ("node-0", "node-2"))
    assert [e.node_rank for e in effects if isinstance(e, StartWorkers)] == [0, 1]


def test_job_that_never_gathers_min_nodes_fails_at_the_join_timeout() -> None:
    state, _, rejections = fold([SPEC, *up("node-0"), TimerFired(name=JoinTimeout())])
    assert rejections == []
    assert state.phase is JobPhase.FAILED
    assert "only 1 of at least 2 nodes joined" in state.reason


def test_a_rejected_event_is_reported_and_the_fold_goes_on() -> None:
    state, _, rejections = fold([SPEC, NodeJoined(node_id="node-7", incarnation=1), *up("node-0", "node-1")])
    assert rejections == ["node node-7 was never requested"]
    assert state.phase is JobPhase.RUNNING


def test_a_refused_event_is_followed_by_a_transition_rejected_event_like_the_reactor_appends() -> None:
    state = fold([SPEC])[0]
    run = replay([NodeRequested(node_id="node-0", incarnation=1), StepProgress(round=0, step=1)], start=state)
    assert run.rejections == ("node node-0 incarnation 1 was already requested",)
    assert [(s.seq, s.cause, s.event) for s in run.steps] == [
        (4, None, NodeRequested(node_id="node-0", incarnation=1)),
        (5, 4, TransitionRejected(event_type="node.requested", seq=4,
                                  reason="node node-0 incarnation 1 was already requested")),
        (6, None, StepProgress(round=0, step=1)),
    ]
    assert run.state.seq == 6


def test_an_emit_id_followed_before_stops_the_fold_as_it_would_stop_the_reactor() -> None:
    folder = Folder()
    folder.feed(SPEC)
    folder.emitted["emit/job-end"] = 1
    with pytest.raises(DuplicateEmit, match="emit/job-end emitted again by seq"):
        folder.feed(TimerFired(name=JoinTimeout()))


def test_replaying_a_recorded_log_keeps_the_records_seq_and_time() -> None:
    live = replay([SPEC, *up("node-0")], now=7.0)
    records = [Record(seq=10 * s.seq, at=float(s.seq), event=s.event) for s in live.steps]
    run = replay(records, follow_emits=False)
    assert [s.seq for s in run.steps] == [10 * s.seq for s in live.steps]
    assert run.state.seq == records[-1].seq
    assert StartTimer(name=JoinTimeout(), at=1.0 + SPEC.join_timeout_s) in run.effects


def test_replaying_the_recorded_log_without_following_emits_gives_the_same_state() -> None:
    live = replay([SPEC, *up("node-0", "node-1"), failure("node-0", 1), restart(1), *succeeded(2, "node-0", "node-1")])
    recorded = replay(live.log, follow_emits=False)
    assert recorded.state == live.state
    assert recorded.effects == live.effects


# -- bugs found in the job machine (see the report; the lead owns the fix) ----------------------------------------


def test_last_call_is_armed_again_after_firing_too_early() -> None:
    """The re-armed timer keeps its name: the reactor schedules a name again once it has fired."""
    run = replay([ELASTIC, *up("node-0", "node-1"), NodeLost(node_id="node-1", incarnation=1),
                  TimerFired(name=LastCall(round=1))])  # fired with only node-0 joined: no round
    assert run.state.phase is JobPhase.STARTING and run.state.rdzv.round == 0
    fired = {e.id for e in run.effects}
    rejoin = replay(up("node-1", inc=2), start=run.state)
    assert rejoin.state.joined == ("node-0", "node-1")
    progress = [e for e in rejoin.effects
                if isinstance(e, StartTimer) or (isinstance(e, Emit) and isinstance(e.event, RoundStarted))]
    assert progress, "MIN nodes are back but nothing will ever start the round"
    assert fired


def test_fail_decision_still_fails_the_job_when_the_failed_node_exits_first() -> None:
    events: list[Event] = [SPEC, *up("node-0", "node-1"), failure("node-0", 1, tail="ValueError: bad config"),
                           NodeExited(node_id="node-0", incarnation=1, exit_code=1),
                           RecoveryDecided(round=1, action=RecoveryAction.FAIL, reason="user code error")]
    state, _, rejections = fold(events)
    assert rejections == []
    assert (state.phase, state.reason, state.message) == (JobPhase.FAILED, "user code error", "ValueError: bad config")
