"""The one recovery fold: each cause, each phase, and the interleavings (a second fault, a takeover, the job's end)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stead.core.events import (
    CheckpointRestored,
    DecisionTimeout,
    Event,
    JobFailed,
    JobResumed,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    NodeExited,
    NodeJoined,
    NodeLost,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RelaunchRequested,
    RestartRequested,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    TimerFired,
    WorkerFailed,
    WorkersSucceeded,
)
from stead.core.views.recovery import (
    Recovery,
    RecoveryCause,
    RecoveryFold,
    RecoveryOutcome,
    RecoveryPhase,
    recoveries,
    restored_from,
)

D, DC, R, RV, F = (RecoveryPhase.DETECT, RecoveryPhase.DECIDE, RecoveryPhase.RESTART, RecoveryPhase.RENDEZVOUS,
                   RecoveryPhase.FIRST_STEP)
SPEC = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=1)
MEMBERS = ("node-0", "node-1")


def log(*timed: tuple[float, Event]) -> list[Record]:
    return [Record(seq=i, at=at, event=event) for i, (at, event) in enumerate(timed, 1)]


def round_(n: int, at: float, *, completed: float = 0.5) -> list[tuple[float, Event]]:
    return [(at, RoundStarted(round=n, members=MEMBERS, nproc_per_node=1, restart_count=n - 1)),
            (at + completed, RoundCompleted(round=n))]


def crash(round_no: int, *, exited_at: float | None = None, node: str = "node-1") -> WorkerFailed:
    return WorkerFailed(node_id=node, round=round_no, local_rank=0, rank=1, exit_code=1, exited_at=exited_at)


def decided(round_no: int, action: RecoveryAction = RecoveryAction.RESTART) -> RecoveryDecided:
    return RecoveryDecided(round=round_no, action=action, reason="r")


#: a job stepping in round 1 from 2.0 (step 1) to 5.0 (step 4)
RUNNING = [(0.0, SPEC), *round_(1, 1.0), *[(1.0 + s, StepProgress(round=1, step=s)) for s in range(1, 5)]]


def phases(recovery: Recovery) -> list[tuple[RecoveryPhase, float, float]]:
    return [(s.phase, round(s.start, 6), round(s.end, 6)) for s in recovery.spans]


# -- each cause --------------------------------------------------------------------------------------------------


def test_a_worker_failure_goes_through_every_phase_from_when_its_agent_saw_it_end() -> None:
    [rec] = recoveries(log(*RUNNING, (5.5, crash(1, exited_at=5.2)), (5.7, decided(1)), *round_(2, 6.0),
                           (7.0, StepProgress(round=2, step=4))))
    assert phases(rec) == [(D, 5.2, 5.5), (DC, 5.5, 5.7), (R, 5.7, 6.0), (RV, 6.0, 6.5), (F, 6.5, 7.0)]
    assert rec.kind is RecoveryCause.WORKER_FAILED and rec.cause == "worker failed on node-1 (rank 1)"
    assert (rec.round, rec.new_round, rec.action, rec.first_step) == (1, 2, RecoveryAction.RESTART, 4)
    assert rec.outcome is RecoveryOutcome.RECOVERED and rec.ended and rec.at == 5.2
    assert rec.seconds == pytest.approx(1.8)


def test_a_worker_failure_s_cause_says_the_class_and_rule_it_was_decided_as() -> None:
    classified = RecoveryDecided(round=1, action=RecoveryAction.RELAUNCH, reason="r", failure_class="numerical",
                                 rule="replica-mismatch")
    [rec] = recoveries(log(*RUNNING, (5.5, crash(1, exited_at=5.2)), (5.7, classified), *round_(2, 6.0),
                           (7.0, StepProgress(round=2, step=4))))
    assert rec.cause == "worker failed on node-1 (rank 1): numerical (replica-mismatch)"


def test_a_replica_mismatch_s_recovery_says_the_bound_its_restore_kept_to() -> None:
    bounded = RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="r", failure_class="numerical",
                              rule="replica-mismatch-unattributed", restore_at_most=2)
    [rec] = recoveries(log(*RUNNING, (5.5, crash(1, exited_at=5.2)), (5.7, bounded), *round_(2, 6.0),
                           (6.8, CheckpointRestored(round=2, step=2, disk_ranks=2)),
                           (7.0, StepProgress(round=2, step=3))))
    assert rec.restored == "step 2: disk 2 (bounded to step 2 or before: replicas' fingerprints last agreed there)"


def test_a_worker_failure_that_does_not_say_when_is_detected_at_its_record() -> None:
    [rec] = recoveries(log(*RUNNING, (5.5, crash(1)), (5.7, decided(1)), *round_(2, 6.0),
                           (7.0, StepProgress(round=2, step=4))))
    assert phases(rec)[:2] == [(D, 5.5, 5.5), (DC, 5.5, 5.7)]


@pytest.mark.parametrize(("failure", "kind", "cause"), [
    (NodeLost(node_id="node-1", incarnation=1, reason="no heartbeat"), RecoveryCause.NODE_LOST,
     "node node-1 lost: no heartbeat"),
    (NodeExited(node_id="node-1", incarnation=1, signal=9), RecoveryCause.NODE_EXITED, "node node-1 exited (signal 9)"),
    (NodeExited(node_id="node-0", incarnation=1, exit_code=137), RecoveryCause.NODE_EXITED,
     "node node-0 exited (exit code 137)"),
])
def test_a_member_node_lost_or_exited_restarts_without_detect_or_decision(failure: Event, kind: RecoveryCause,
                                                                          cause: str) -> None:
    [rec] = recoveries(log(*RUNNING, (5.5, failure), *round_(2, 8.0), (9.0, StepProgress(round=2, step=4))))
    assert phases(rec) == [(R, 5.5, 8.0), (RV, 8.0, 8.5), (F, 8.5, 9.0)]
    assert rec.kind is kind and rec.cause == cause and rec.action is None


def test_a_recovery_says_what_its_new_round_restored_and_from_which_tier() -> None:
    lost = NodeLost(node_id="node-1", incarnation=1, reason="heartbeat timeout")
    restored = CheckpointRestored(round=2, step=41, memory_ranks=1, peer_ranks=1)
    [rec] = recoveries(log(*RUNNING, (5.5, lost), *round_(2, 8.0), (8.7, restored),
                           (9.0, StepProgress(round=2, step=42))))
    assert rec.restored == "step 41: memory 1, peer 1"
    [before] = recoveries(log(*RUNNING, (5.5, lost), (5.6, CheckpointRestored(round=1, step=3, disk_ranks=2)),
                              *round_(2, 8.0), (9.0, StepProgress(round=2, step=4))))
    assert before.restored == ""  # (a restore of the failed round is not this recovery's)
    [fresh] = recoveries(log(*RUNNING, (5.5, lost), *round_(2, 8.0), (8.7, CheckpointRestored(round=2, step=-1)),
                             (9.0, StepProgress(round=2, step=0))))
    assert fresh.restored == "nothing (a fresh start)"


@pytest.mark.parametrize(("request_", "kind"), [
    (RestartRequested(round=1, reason="no step for 20 s", by="diagnosis"), RecoveryCause.RESTART_REQUESTED),
    (RelaunchRequested(node_id="node-1", incarnation=1, reason="straggler", by="diagnosis"),
     RecoveryCause.RELAUNCH_REQUESTED),
])
def test_a_plugin_s_request_is_detected_from_the_last_step_report(request_: Event, kind: RecoveryCause) -> None:
    [rec] = recoveries(log(*RUNNING, (25.0, request_), *round_(2, 26.0), (27.0, StepProgress(round=2, step=4))))
    assert phases(rec) == [(D, 5.0, 25.0), (R, 25.0, 26.0), (RV, 26.0, 26.5), (F, 26.5, 27.0)]
    assert rec.kind is kind and rec.cause.startswith("diagnosis: ")


def test_a_failure_before_the_first_step_is_a_recovery_detected_no_earlier_than_the_submission() -> None:
    [rec] = recoveries(log((10.0, SPEC), *round_(1, 11.0), (12.0, crash(1, exited_at=3.0)), (12.1, decided(1)),
                           *round_(2, 12.2), (13.0, StepProgress(round=2, step=0))))
    assert phases(rec)[0] == (D, 10.0, 12.0)


def test_detect_starts_no_earlier_than_the_last_step_report_and_never_after_the_record() -> None:
    early = recoveries(log(*RUNNING, (5.5, crash(1, exited_at=4.0))))[0]  # the agent's clock behind the master's
    assert phases(early)[0] == (D, 5.0, 5.5)
    late = recoveries(log(*RUNNING, (5.5, crash(1, exited_at=9.0))))[0]  # ahead of it
    assert phases(late)[0] == (D, 5.5, 5.5)


# -- what is not a recovery, or not a new one --------------------------------------------------------------------------


@pytest.mark.parametrize("event", [
    crash(0), NodeLost(node_id="node-9", incarnation=1), RestartRequested(round=2, reason="r", by="d"),
    RelaunchRequested(node_id="node-9", incarnation=1, reason="r", by="d"),
])
def test_a_failure_of_another_round_or_of_a_node_outside_it_begins_nothing(event: Event) -> None:
    assert recoveries(log(*RUNNING, (5.5, event))) == []


def test_no_failure_counts_before_a_round_started_or_once_its_workers_succeeded() -> None:
    assert recoveries(log((0.0, SPEC), (1.0, crash(1)), (1.5, NodeLost(node_id="node-1", incarnation=1)))) == []
    finishing = log(*RUNNING, (5.5, WorkersSucceeded(node_id="node-0", round=1)), (5.6, crash(1)))
    assert recoveries(finishing) == []


def test_the_failed_round_failing_again_is_the_same_recovery() -> None:
    records = log(*RUNNING, (5.5, NodeLost(node_id="node-1", incarnation=1)),
                  (5.6, crash(1, node="node-0")),  # its peer's collective broke
                  (5.7, NodeExited(node_id="node-1", incarnation=1, signal=9)),  # the lost node's agent, killed
                  (5.8, StepProgress(round=1, step=5)),  # a late report of the failed round
                  *round_(2, 8.0), (9.0, StepProgress(round=2, step=4)))
    [rec] = recoveries(records)
    assert rec.kind is RecoveryCause.NODE_LOST and phases(rec) == [(R, 5.5, 8.0), (RV, 8.0, 8.5), (F, 8.5, 9.0)]


# -- interleavings --------------------------------------------------------------------------------------------------


def test_a_second_fault_mid_recovery_interrupts_it_and_begins_its_own() -> None:
    records = log(*RUNNING, (5.5, crash(1, exited_at=5.2)), (5.7, decided(1)), *round_(2, 6.0),
                  (7.0, crash(2, exited_at=6.8, node="node-0")), (7.2, decided(2)), *round_(3, 7.5),
                  (8.5, StepProgress(round=3, step=4)))
    first, second = recoveries(records)
    assert first.outcome is RecoveryOutcome.INTERRUPTED and not first.ended
    assert phases(first) == [(D, 5.2, 5.5), (DC, 5.5, 5.7), (R, 5.7, 6.0), (RV, 6.0, 6.5), (F, 6.5, 6.8)]
    assert (second.round, second.new_round, second.outcome) == (2, 3, RecoveryOutcome.RECOVERED)
    assert phases(second) == [(D, 6.8, 7.0), (DC, 7.0, 7.2), (R, 7.2, 7.5), (RV, 7.5, 8.0), (F, 8.0, 8.5)]
    # a second fault that claims to precede the phase it interrupts starts where that phase did
    records[-5] = dataclasses.replace(records[-5], event=crash(2, exited_at=1.0, node="node-0"))
    _, clipped = recoveries(records)
    assert phases(clipped)[0] == (D, 6.5, 7.0)


def test_a_round_grown_mid_recovery_goes_back_to_rendezvous_for_the_new_round() -> None:
    [rec] = recoveries(log(*RUNNING, (5.5, NodeLost(node_id="node-1", incarnation=1)), *round_(2, 6.0),
                           *round_(3, 7.0), (7.9, StepProgress(round=2, step=4)),  # (the old round's: not this one)
                           (8.0, StepProgress(round=3, step=4))))
    assert phases(rec) == [(R, 5.5, 6.0), (RV, 6.0, 6.5), (F, 6.5, 7.0), (RV, 7.0, 7.5), (F, 7.5, 8.0)]
    assert rec.new_round == 3 and rec.phases == pytest.approx({R: 0.5, RV: 1.0, F: 1.0})


def test_a_takeover_mid_recovery_continues_it_in_the_log_and_a_fold_started_there_waits_for_a_round() -> None:
    before = [*RUNNING, (5.5, crash(1, exited_at=5.2))]
    # the new master re-arms the decision timer, the default decides, its agents join again
    after = [(8.5, TimerFired(name=DecisionTimeout(round=1))), (8.6, decided(1)),
             (8.7, NodeJoined(node_id="node-0", incarnation=1)),
             *round_(2, 9.0), (10.0, StepProgress(round=2, step=4)),
             (11.0, NodeLost(node_id="node-1", incarnation=1)), *round_(3, 12.0), (13.0, StepProgress(round=3, step=4))]
    whole, lost = recoveries(log(*before, *after))
    assert phases(whole) == [(D, 5.2, 5.5), (DC, 5.5, 8.6), (R, 8.6, 9.0), (RV, 9.0, 9.5), (F, 9.5, 10.0)]
    assert lost.kind is RecoveryCause.NODE_LOST
    # the new master's tracer folds from the takeover on: the recovery under way is not its to tell, the next is
    tail = log(*after)
    assert [r.kind for r in recoveries(tail)] == [RecoveryCause.NODE_LOST]
    # taking over after round 2 started, it knows no round, unless the state it took over tells it
    assert recoveries(tail[5:]) == []
    joined = RecoveryFold()
    joined.join(2, MEMBERS)
    began = [joined.apply(r).began for r in tail[5:]]
    assert [b.kind for b in began if b is not None] == [RecoveryCause.NODE_LOST]


@pytest.mark.parametrize(("end", "outcome"), [(JobSucceeded(), RecoveryOutcome.SUCCEEDED),
                                              (JobFailed(reason="r"), RecoveryOutcome.FAILED),
                                              (JobStopped(reason="r"), RecoveryOutcome.STOPPED),
                                              (JobResumed(**dataclasses.asdict(SPEC)), RecoveryOutcome.RESUMED)])
def test_a_job_ending_mid_recovery_ends_it_unrecovered_in_the_phase_it_was_in(end: Event,
                                                                              outcome: RecoveryOutcome) -> None:
    [rec] = recoveries(log(*RUNNING, (5.5, crash(1, exited_at=5.2)), (5.7, decided(1, RecoveryAction.FAIL)),
                           (6.0, end)))
    assert rec.outcome is outcome and not rec.ended
    assert phases(rec) == [(D, 5.2, 5.5), (DC, 5.5, 5.7), (R, 5.7, 6.0)]


def test_a_recovery_under_way_runs_to_now() -> None:
    records = log(*RUNNING, (5.5, crash(1, exited_at=5.2)))
    [rec] = recoveries(records, now=9.0)
    assert rec.outcome is RecoveryOutcome.ONGOING and phases(rec)[-1] == (DC, 5.5, 9.0)
    fold = RecoveryFold()
    assert [fold.apply(r).began is not None for r in records][-1] and fold.current is not None
    assert fold.current.end == 5.5


# -- any log ------------------------------------------------------------------------------------------------------

EVENTS = st.sampled_from([
    StepProgress(round=1, step=3), StepProgress(round=2, step=5), StepProgress(round=3, step=6),
    *[RoundStarted(round=n, members=MEMBERS, nproc_per_node=1) for n in (1, 2, 3)],
    *[RoundCompleted(round=n) for n in (1, 2, 3)],
    crash(1, exited_at=2.0), crash(2), crash(3, exited_at=40.0), decided(1), decided(2),
    NodeLost(node_id="node-0", incarnation=1), NodeExited(node_id="node-1", incarnation=1, signal=9),
    RestartRequested(round=2, reason="hang", by="d"), RelaunchRequested(node_id="node-0", incarnation=1, reason="s",
                                                                         by="d"),
    WorkersSucceeded(node_id="node-0", round=2), JobSucceeded(), JobFailed(reason="r"),
    JobResumed(**dataclasses.asdict(SPEC)),
])

#: the phase a recovery may go back to, and when: a round started again before the first step
_BACK = {RV}
_ORDER = list(RecoveryPhase)


@given(st.lists(st.tuples(st.floats(0, 50), EVENTS), max_size=40), st.floats(0, 100))
def test_any_log_gives_recoveries_whose_phases_are_ordered_non_negative_and_add_up(
        timed: list[tuple[float, Event]], now: float) -> None:
    records = log((0.0, SPEC), *sorted(timed, key=lambda t: t[0]))
    found = recoveries(records, now=max(now, records[-1].at))
    for rec in found:
        assert rec.spans and all(s.seconds >= 0 for s in rec.spans)
        assert rec.spans[0].start == rec.at and rec.spans[-1].end == rec.end
        for earlier, later in itertools.pairwise(rec.spans):
            assert earlier.end == later.start  # they tile the recovery
            assert _ORDER.index(later.phase) > _ORDER.index(earlier.phase) or later.phase in _BACK
        assert sum(s.seconds for s in rec.spans) == pytest.approx(rec.seconds)
        assert sum(rec.phases.values()) == pytest.approx(rec.seconds)
    for earlier_rec, later_rec in itertools.pairwise(found):
        assert earlier_rec.end <= later_rec.at  # one at a time
        assert earlier_rec.outcome is not RecoveryOutcome.ONGOING  # only the last may go on


@pytest.mark.parametrize(("event", "said"), [
    (CheckpointRestored(round=2, step=41, memory_ranks=1, peer_ranks=1), "step 41: memory 1, peer 1"),
    (CheckpointRestored(round=2, step=41, memory_ranks=1, peer_ranks=1, replicated_step=41, committed_step=41),
     "step 41: memory 1, peer 1 (replicated)"),
    (CheckpointRestored(round=2, step=41, memory_ranks=1, peer_ranks=1, replicated_step=40, committed_step=41),
     "step 41: memory 1, peer 1 (newer than replicated step 40)"),
    (CheckpointRestored(round=2, step=40, memory_ranks=1, peer_ranks=1, replicated_step=40, committed_step=41),
     "step 40: memory 1, peer 1 (replicated; the newest commit, 41, was not yet)"),
    (CheckpointRestored(round=2, step=30, memory_ranks=1, disk_ranks=1, replicated_step=40, committed_step=41),
     "step 30: memory 1, disk 1 (older than replicated step 40: no copy of it was left)"),
])
def test_a_restore_says_where_each_rank_read_it_and_how_it_stands_to_the_replicated_step(
        event: CheckpointRestored, said: str) -> None:
    assert restored_from(event) == said
