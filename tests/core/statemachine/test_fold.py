"""The one fold of the log (``statemachine.fold``), which the reactor, replay and `stead status` share."""

from __future__ import annotations

import dataclasses

import pytest

from stead.core.events import JobSubmitted, JoinTimeout, NodeJoined, Record, StepProgress, TimerFired
from stead.core.statemachine import Emit, JobPhase, JobState, StartTimer, fold, fold_all, transition
from stead.testing.replay import replay

SPEC = JobSubmitted(job="j", min_nodes=1, max_nodes=1, nproc_per_node=1, join_timeout_s=60.0)
STARTED = fold(JobState(), Record(seq=1, at=100.0, event=SPEC)).state

# (name, start, record, expected seq, expected phase, rejected?)
ROWS: list[tuple[str, JobState, Record, int, JobPhase, bool]] = [
    ("an accepted record moves seq to its own", JobState(), Record(seq=1, at=100.0, event=SPEC), 1,
     JobPhase.STARTING, False),
    ("a refused record still counts as read", JobState(), Record(seq=1, at=100.0,
                                                                 event=NodeJoined(node_id="n", incarnation=1)),
     1, JobPhase.NEW, True),
    ("an old record never moves seq back", dataclasses.replace(STARTED, seq=9),
     Record(seq=3, at=100.0, event=StepProgress(round=1, step=1)), 9, JobPhase.STARTING, False),
]


@pytest.mark.parametrize(("start", "record", "seq", "phase", "rejected"), [r[1:] for r in ROWS],
                         ids=[r[0] for r in ROWS])
def test_fold(start: JobState, record: Record, seq: int, phase: JobPhase, rejected: bool) -> None:
    result = fold(start, record)
    assert result.state.seq == seq and result.state.phase is phase
    assert (result.rejected is not None) is rejected
    if rejected:
        assert result.effects == ()
        assert dataclasses.replace(result.state, seq=start.seq) == start  # nothing else changed


def test_fold_uses_the_records_time_for_what_it_arms() -> None:
    result = fold(JobState(), Record(seq=1, at=100.0, event=SPEC))
    assert StartTimer(name=JoinTimeout(), at=160.0) in result.effects
    assert result.state.timers == {JoinTimeout(): 160.0}
    assert fold(result.state, Record(seq=2, at=170.0, event=TimerFired(name=JoinTimeout()))).state.timers == {}


def test_fold_is_transition_plus_the_logs_bookkeeping() -> None:
    record = Record(seq=1, at=100.0, event=SPEC)
    assert fold(JobState(), record) == transition(JobState(), SPEC, now=100.0, seq=1)
    assert any(isinstance(e, Emit) for e in fold(JobState(), record).effects)


def test_fold_all_replays_what_a_live_fold_recorded() -> None:
    live = replay([SPEC, NodeJoined(node_id="node-0", incarnation=1)], now=100.0)
    records = [Record(seq=step.seq, at=100.0, event=step.event) for step in live.steps]
    assert fold_all(records) == live.state
