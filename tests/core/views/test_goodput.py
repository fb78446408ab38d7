"""The goodput ledger over recorded event logs: every second counted once, in the right part."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from stead.core.events import (
    Event,
    JobResumed,
    JobSubmitted,
    JobSucceeded,
    NodeExited,
    NodeLost,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RestartRequested,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    WorkerFailed,
    WorkersSucceeded,
)
from stead.core.events.log import BadRecord
from stead.core.views.goodput import PARTS, ledger
from stead.plugins.ckpt.events import CheckpointRestored

SPEC = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=1)
MEMBERS = ("node-0", "node-1")


def log(*timed: tuple[float, Event]) -> list[Record]:
    return [Record(seq=i, at=at, event=event) for i, (at, event) in enumerate(timed, 1)]


def steps(round_: int, first: int, last: int, *, at: float, every: float = 1.0) -> list[tuple[float, Event]]:
    return [(at + (s - first) * every, StepProgress(round=round_, step=s)) for s in range(first, last + 1)]


def start(round_: int, at: float) -> list[tuple[float, Event]]:
    return [(at, RoundStarted(round=round_, members=MEMBERS, nproc_per_node=1, restart_count=round_ - 1)),
            (at + 0.5, RoundCompleted(round=round_))]


def end(at: float, round_: int) -> list[tuple[float, Event]]:
    return [(at, WorkersSucceeded(node_id="node-0", round=round_)), (at + 0.5, JobSucceeded())]


def parts(records: list[Record], **kwargs: float) -> dict[str, float]:
    result = ledger(records, **kwargs)
    assert sum(result.parts.values()) == pytest.approx(result.wall_s)  # every second counted exactly once
    return {k: round(v, 6) for k, v in result.parts.items() if v}


def test_a_job_without_faults_is_start_up_then_useful_steps_then_the_tail() -> None:
    records = log((0.0, SPEC), *start(1, 2.0), *steps(1, 1, 10, at=3.0), *end(12.5, 1))
    assert parts(records) == {"waiting": 3.0, "useful": 9.5, "idle": 0.5}
    result = ledger(records)
    assert result.wall_s == 13.0 and result.ended and result.useful_steps == 9
    assert result.goodput == pytest.approx(9.5 / 13)
    assert result.recoveries == () and result.missing == ()


def test_a_crash_is_recovered_in_phases_and_the_rolled_back_steps_count_as_lost_once() -> None:
    failed = WorkerFailed(node_id="node-1", round=1, local_rank=0, rank=1, exit_code=1, exited_at=12.4)
    records = log((0.0, SPEC), *start(1, 2.0), *steps(1, 1, 10, at=3.0),  # step 10 at 12.0
                  (12.45, failed), (12.5, RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="crash")),
                  *start(2, 12.6), (13.2, CheckpointRestored(round=2, step=6)),
                  *steps(2, 7, 14, at=13.5), *end(21.0, 2))
    # steps 7-10 (4 s) are done again; 12.0-12.4 was never reported
    assert parts(records) == {"waiting": 3.0, "useful": 5.0 + 7.0 + 0.5, "lost": 4.4, "recovery": 1.1, "idle": 0.5}
    result = ledger(records)
    assert result.recovery_phases == pytest.approx({"detect": 0.05, "decide": 0.05, "restart": 0.1,
                                                    "rendezvous": 0.5, "first_step": 0.4})
    [recovery] = result.recoveries
    assert recovery.cause == "worker failed on node-1 (rank 1)" and recovery.at == 12.4 and recovery.ended
    assert result.useful_steps == (6 - 1) + (14 - 7)


def test_steps_done_after_the_last_report_and_saved_before_the_failure_are_not_lost() -> None:
    failed = WorkerFailed(node_id="node-1", round=1, local_rank=0, rank=1, exit_code=1, step=14, exited_at=13.0)
    records = log((0.0, SPEC), *start(1, 2.0), *steps(1, 1, 10, at=3.0),  # step 10 at 12.0, then 4 unreported
                  (13.05, failed), (13.1, RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="crash")),
                  *start(2, 13.2), (13.8, CheckpointRestored(round=2, step=12)),
                  *steps(2, 13, 16, at=14.0), *end(17.5, 2))
    # 12.0-13.0 did steps 11-14; 11-12 were saved (kept), 13-14 are done again
    assert parts(records) == {"waiting": 3.0, "useful": 9.0 + 0.5 + 3.0 + 0.5, "lost": 0.5, "recovery": 1.0,
                              "idle": 0.5}
    assert ledger(records).useful_steps == 9 + 2 + 3


@pytest.mark.parametrize(("resumed_at", "lost"), [(11, 0.4), (13, 0.0)])
def test_a_script_that_resumed_from_its_own_checkpoint_loses_nothing_stead_can_see_and_says_so(
        resumed_at: int, lost: float) -> None:
    failed = WorkerFailed(node_id="node-1", round=1, local_rank=0, rank=1, exit_code=1, exited_at=12.4)
    records = log((0.0, SPEC), *start(1, 2.0), *steps(1, 1, 10, at=3.0),  # step 10 at 12.0
                  (12.45, failed), (12.5, RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="crash")),
                  # no stead restore: it goes on from its own checkpoint, which shows how far round 1 got
                  *start(2, 12.6), *steps(2, resumed_at, resumed_at + 3, at=13.5), *end(17.0, 2))
    assert parts(records) == {"waiting": 3.0, "useful": round(9.0 + 0.4 - lost + 3.0 + 0.5, 6), **(
        {"lost": lost} if lost else {}), "recovery": 1.1, "idle": 0.5}
    result = ledger(records)
    assert result.useful_steps == 9 + (resumed_at - 1 - 10) + 3
    assert result.missing == (f"1 round(s) went on where the script's own checkpoint left it (round 2 at step "
                              f"{resumed_at}), stead restored nothing: the steps done again since that checkpoint "
                              "was written are not known, and count as useful",)


def test_a_restore_recorded_after_the_round_s_first_step_is_still_stead_s_and_named_in_the_recovery() -> None:
    """The last rank's restore report can reach the master after another rank's first step of the round."""
    lost = NodeLost(node_id="node-1", incarnation=1, reason="host h1 hung up")
    records = log((0.0, SPEC), *start(1, 2.0), *steps(1, 1, 10, at=3.0),  # step 10 at 12.0
                  (12.45, lost), *start(2, 12.6), *steps(2, 11, 13, at=13.5),
                  (13.6, CheckpointRestored(round=2, step=10, memory_ranks=1, peer_ranks=1)), *end(17.0, 2))
    result = ledger(records)
    assert result.missing == ()  # not taken for the script's own checkpoint
    assert [r.restored for r in result.recoveries] == ["step 10: memory 1, peer 1"]


def test_a_hang_counts_the_stall_as_detection_and_a_lost_node_skips_the_decision() -> None:
    hang = RestartRequested(round=1, reason="no step for 20 s", by="diagnosis")
    records = log((0.0, SPEC), *start(1, 1.0), *steps(1, 1, 5, at=2.0),  # step 5 at 6.0
                  (26.0, hang), *start(2, 27.0), *steps(2, 6, 8, at=28.0),
                  (31.0, NodeLost(node_id="node-1", incarnation=1, reason="no heartbeat")),
                  *start(3, 34.0), *steps(3, 9, 10, at=35.0), *end(36.5, 3))
    result = ledger(records)
    assert result.recovery_phases["detect"] == pytest.approx(20.0)  # the whole stall: the detector's latency
    assert [r.cause for r in result.recoveries] == ["diagnosis: no step for 20 s", "node node-1 lost: no heartbeat"]
    assert [r.at for r in result.recoveries] == [6.0, 31.0]  # a hang's recovery began at the last step report
    assert result.recoveries[1].phases == pytest.approx({"restart": 3.0, "rendezvous": 0.5, "first_step": 0.5})
    assert sum(result.parts.values()) == pytest.approx(result.wall_s)


def test_a_node_whose_agent_was_killed_starts_a_recovery_of_its_own() -> None:
    # the local platform sees a SIGKILLed agent exit at once: node.exited, never node.lost
    killed = NodeExited(node_id="node-1", incarnation=1, signal=9)
    records = log((0.0, SPEC), *start(1, 1.0), *steps(1, 1, 5, at=2.0),  # step 5 at 6.0
                  (6.8, killed), *start(2, 7.0), (7.5, CheckpointRestored(round=2, step=5)),
                  *steps(2, 6, 8, at=8.0), *end(10.5, 2))
    result = ledger(records)
    [recovery] = result.recoveries
    assert recovery.cause == "node node-1 exited (signal 9)" and recovery.at == 6.8 and recovery.ended
    assert recovery.phases == pytest.approx({"restart": 0.2, "rendezvous": 0.5, "first_step": 0.5})
    # 6.0-6.8 was never reported: lost (the failure does not say how far it got)
    assert parts(records) == {"waiting": 2.0, "useful": 4.0 + 2.0 + 0.5, "lost": 0.8, "recovery": 1.2, "idle": 0.5}


def test_a_running_job_is_counted_up_to_now_and_a_recovery_under_way_is_listed() -> None:
    failed = WorkerFailed(node_id="node-0", round=1, local_rank=0, rank=0, exit_code=1, exited_at=6.0)
    records = log((0.0, SPEC), *start(1, 1.0), *steps(1, 1, 4, at=2.0), (6.1, failed))
    result = ledger(records, now=10.0)
    assert not result.ended and result.wall_s == 10.0
    assert parts(records, now=10.0) == {"waiting": 2.0, "useful": 3.0, "lost": 1.0, "recovery": 4.0}
    assert [r.ended for r in result.recoveries] == [False]


def test_the_time_between_a_job_s_end_and_its_resumption_is_idle() -> None:
    resumed = JobResumed(**dataclasses.asdict(SPEC))
    records = log((0.0, SPEC), *start(1, 1.0), *steps(1, 1, 3, at=2.0), *end(4.5, 1),
                  (100.0, resumed), *start(2, 101.0), (101.6, CheckpointRestored(round=2, step=3)),
                  *steps(2, 4, 6, at=102.0), *end(104.5, 2))
    assert parts(records) == {"waiting": 2.0 + 2.0, "useful": 2.5 + 2.5, "idle": 0.5 + 95.0 + 0.5}


def test_what_cannot_be_read_is_said_not_raised() -> None:
    assert ledger([]).missing == ("the job was never submitted",)
    records: list[Record | BadRecord] = [*log((0.0, SPEC)), BadRecord(key="/x", seq=2, error="bad JSON")]
    result = ledger(records, now=5.0)
    assert result.parts["waiting"] == 5.0 and result.goodput == 0.0
    assert result.missing == ("1 unreadable record(s) were skipped; the figures around them may be off",
                              "no step progress was recorded: no time can be counted as useful")
    assert ledger(records).to_json()["goodput"] == 0.0


EVENTS = st.sampled_from([
    StepProgress(round=1, step=3), StepProgress(round=1, step=4), StepProgress(round=2, step=2),
    StepProgress(round=2, step=9, phase="eval"), StepProgress(round=2, step=9, phase="checkpoint"),
    RoundStarted(round=2, members=MEMBERS, nproc_per_node=1, restart_count=1), RoundCompleted(round=2),
    WorkerFailed(node_id="node-0", round=1, local_rank=0, rank=0, exit_code=1, exited_at=3.0),
    WorkerFailed(node_id="node-0", round=2, local_rank=0, rank=0, exit_code=1),
    RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="r"),
    NodeLost(node_id="node-0", incarnation=1, reason="gone"), RestartRequested(round=2, reason="hang", by="d"),
    CheckpointRestored(round=2, step=1), WorkersSucceeded(node_id="node-0", round=2), JobSucceeded(),
    JobResumed(**dataclasses.asdict(SPEC)),
])


@given(st.lists(st.tuples(st.floats(0, 50), EVENTS), max_size=40), st.floats(0, 100))
@example([(0.0, StepProgress(round=1, step=3)), (0.0, StepProgress(round=1, step=4)),  # a segment emptied by one
          (0.0, StepProgress(round=2, step=2)), (0.0, StepProgress(round=1, step=3)),  # rollback, rolled back again
          (0.0, StepProgress(round=2, step=2))], 0.0)
def test_any_log_splits_its_wall_time_exactly_into_the_parts(timed: list[tuple[float, Event]], now: float) -> None:
    records = log((0.0, SPEC), *sorted(timed, key=lambda t: t[0]))
    result = ledger(records, now=max(now, records[-1].at))
    assert set(result.parts) == set(PARTS)
    assert sum(result.parts.values()) == pytest.approx(result.wall_s, abs=1e-6)
    assert 0.0 <= result.goodput <= 1.0 + 1e-9
    assert result.parts["useful"] >= -1e-9 and result.parts["lost"] >= -1e-9


@given(st.lists(st.tuples(st.floats(0, 50), EVENTS), max_size=40), st.floats(0, 100))
def test_the_recovery_part_is_the_recoveries_of_the_one_fold(timed: list[tuple[float, Event]], now: float) -> None:
    records = log((0.0, SPEC), *sorted(timed, key=lambda t: t[0]))
    result = ledger(records, now=max(now, records[-1].at))
    assert sum(r.seconds for r in result.recoveries) == pytest.approx(result.parts["recovery"], abs=1e-6)
    assert sum(result.recovery_phases.values()) == pytest.approx(result.parts["recovery"], abs=1e-6)


@pytest.mark.parametrize(("restored", "rolled_back_s"), [(10, 0.0), (8, 2.0)])
def test_a_lost_host_restored_from_a_peer_s_replica_is_charged_only_the_steps_it_rolled_back(
        restored: int, rolled_back_s: float) -> None:
    """The replacement fetched its rank's step from another host's memory: with the newest step the job reached
    (replicated) nothing done is charged again, only the time after the last report (a step cut short); with an
    older one (R, the newer commit's copies still on their way) the steps after it are."""
    lost = NodeLost(node_id="node-1", incarnation=1, reason="host h1 hung up")
    records = log((0.0, SPEC), *start(1, 2.0), *steps(1, 1, 10, at=3.0),  # step 10 at 12.0
                  (12.45, lost), *start(2, 12.6),
                  (13.2, CheckpointRestored(round=2, step=restored, memory_ranks=1, peer_ranks=1,
                                            replicated_step=restored, committed_step=10)),
                  *steps(2, restored + 1, 13, at=13.5), *end(17.0, 2))
    result = parts(records)
    assert result["lost"] == pytest.approx(0.45 + rolled_back_s)
    assert ledger(records).useful_steps == 11  # steps 1-13, each counted once (the first report starts the count)
