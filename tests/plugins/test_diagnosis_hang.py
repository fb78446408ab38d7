"""The hang detector's step-time model and the naming of the hung rank from stacks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stead.core.events import StackSample
from stead.plugins.diagnosis.hang import StepClock, name_culprit, where


def clock(**overrides: float) -> StepClock:
    params = {"floor_s": 20.0, "factor": 10.0, "first_step_s": 600.0, "phase_s": 3600.0, **overrides}
    return StepClock(**params)  # type: ignore[arg-type]


def run_steps(c: StepClock, gaps: list[float], *, start: float = 0.0) -> float:
    """Round 1 starts at ``start``, its first step after 1 s, then one step after each gap; the last time."""
    c.start_round(1, start)
    now = start + 1.0
    c.observe(1, 0, now)
    for i, gap in enumerate(gaps, 1):
        assert c.stalled(now + gap) is None, f"false alarm at step {i} after a gap of {gap} s"
        now += gap
        c.observe(1, i, now)
    return now


def test_a_job_with_1s_steps_is_hung_after_the_floor_and_not_before() -> None:
    c = clock()
    now = run_steps(c, [1.0] * 30)
    assert c.stalled(now + 19.9) is None
    stall = c.stalled(now + 20.5)
    assert stall is not None and stall.step == 30 and stall.threshold_s == 20.0 and "floor" in stall.why


def test_slow_steps_get_a_threshold_of_their_own() -> None:
    c = clock()
    now = run_steps(c, [10.0] * 5)
    threshold, why = c.threshold()
    assert threshold == 100.0 and "10 x the longest recent gap" in why
    assert c.stalled(now + 99.0) is None and c.stalled(now + 101.0) is not None


@pytest.mark.parametrize(("setup", "allowed", "why"), [
    ("fresh", 600.0, "first step"),
    ("phase", 3600.0, "eval"),
])
def test_the_first_step_and_a_declared_phase_have_their_own_allowance(setup: str, allowed: float, why: str) -> None:
    c = clock()
    if setup == "fresh":
        c.start_round(1, 0.0)
        now = 0.0
    else:
        now = run_steps(c, [1.0] * 10)
        c.observe(1, 10, now, phase="eval")
    assert c.stalled(now + allowed - 1) is None
    stall = c.stalled(now + allowed + 1)
    assert stall is not None and why in stall.why
    if setup == "phase":  # the phase ends: the step clock starts again from then, with the old pace
        c.observe(1, 10, now + 100, phase="")
        assert c.stalled(now + 110) is None and c.stalled(now + 121) is not None


def test_records_of_another_round_or_older_than_the_clock_are_ignored() -> None:
    c = clock()
    now = run_steps(c, [1.0] * 3)
    c.observe(2, 50, now + 5)  # a round that is not running
    c.observe(1, 9, now - 10)  # older than the last progress
    assert c.step == 3 and c.since == now


def test_a_new_round_waits_for_its_first_step_again() -> None:
    c = clock()
    now = run_steps(c, [1.0] * 3)
    c.start_round(2, now + 1)
    assert c.stalled(now + 100) is None  # first_step_s applies again
    c.observe(2, 4, now + 2)
    assert c.threshold()[0] == 20.0  # the pace learnt in round 1 still holds


def test_steps_seen_outside_the_progress_records_restart_the_clock_and_leave_the_pace_alone() -> None:
    c = clock()
    now = run_steps(c, [1.0] * 10)
    assert c.stalled(now + 30) is not None  # no record for 30 s: the store was away, the job went on
    c.advance(1, 25, now + 30)  # as the heartbeats show
    assert (c.step, c.since) == (25, now + 30)
    assert c.threshold()[0] == 20.0, "the 30 s without records became a step time: the threshold grew to 300 s"
    assert c.stalled(now + 49) is None and c.stalled(now + 51) is not None
    c.advance(1, 20, now + 60)  # nothing newer than what is known
    c.advance(2, 40, now + 60)  # another round's
    assert (c.step, c.since) == (25, now + 30)


def test_a_clock_taken_over_by_a_new_master_keeps_the_pace_the_old_one_learnt() -> None:
    old = clock()
    run_steps(old, [1.0] * 10)
    new = clock()
    new.start_round(1, 500.0)  # the new master starts while round 1 runs
    assert new.threshold()[0] == 600.0  # alone, it would wait first_step_s
    new.resume(10, list(old.gaps))
    assert new.threshold()[0] == 20.0
    stall = new.stalled(521.0)
    assert stall is not None and stall.step == 10
    new.resume(10, [float("nan"), -1.0])  # a damaged status record adds nothing
    assert list(new.gaps) == list(old.gaps)


def test_a_clock_taken_over_between_rounds_keeps_the_pace_and_waits_for_the_first_step() -> None:
    old = clock()
    run_steps(old, [1.0] * 10)
    new = clock()
    new.start_round(2, 500.0)
    new.resume(None, list(old.gaps))  # the old master's status spoke of round 1
    assert new.stalled(520.5) is None  # round 2's first step still gets first_step_s
    new.observe(2, 11, 501.0)
    stall = new.stalled(521.5)
    assert stall is not None and stall.threshold_s == 20.0


@settings(max_examples=300, deadline=None)
@given(base=st.floats(0.01, 5.0), ratios=st.lists(st.floats(1.0, 10.0), min_size=1, max_size=300))
def test_a_healthy_job_whose_steps_vary_up_to_10x_never_raises_the_alarm(base: float, ratios: list[float]) -> None:
    """Heavy-tailed or not: every gap within 10x of the fastest one is never a hang (factor 10)."""
    run_steps(clock(), [base * r for r in ratios])


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0.05, 2.0), min_size=2, max_size=100), stall=st.floats(0.0, 1000.0))
def test_a_job_that_stops_is_always_flagged_once_past_the_threshold(gaps: list[float], stall: float) -> None:
    c = clock()
    now = run_steps(c, gaps)
    threshold = max(20.0, 10 * max(gaps))
    assert (c.stalled(now + stall) is not None) == (stall > threshold)


# -- naming the hung rank ---------------------------------------------------------------

SLEEPING = '''Current thread 0x00007f01 (most recent call first):
  File "/home/u/job/train.py", line 57 in <module>
  File "/x/.venv/lib/python3.11/site-packages/stead/core/agent/zygote_main.py", line 400 in _run_script
'''
BACKWARD = '''Thread 0x00007f02 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f01 (most recent call first):
  File "/x/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 829 in _engine_run_backward
  File "/x/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 354 in backward
  File "/x/.venv/lib/python3.11/site-packages/torch/_tensor.py", line 647 in backward
  File "/home/u/job/train.py", line 41 in <module>
'''


def sample(rank: int, stack: str, step: int | None = 7) -> StackSample:
    return StackSample(rank=rank, local_rank=rank % 2, step=step, stack=stack)


def test_where_names_the_innermost_call_and_the_user_line() -> None:
    assert where(SLEEPING) == "at train.py:57 in <module>"
    assert where(BACKWARD) == "in _engine_run_backward() at train.py:41"
    assert where("") == "no stack"


def test_the_rank_that_is_not_where_the_others_are_is_named_not_the_ones_in_backward() -> None:
    culprit = name_culprit([sample(0, BACKWARD, 8), sample(1, BACKWARD, 8), sample(2, SLEEPING, 7),
                            sample(3, BACKWARD, 8)])
    assert culprit.rank == 2
    assert culprit.summary == ("rank 2 at train.py:57 in <module>; "
                               "ranks 0-1,3 in _engine_run_backward() at train.py:41")


def test_a_stopped_rank_that_answers_nothing_is_the_odd_one_out() -> None:
    culprit = name_culprit([sample(0, BACKWARD), sample(1, ""), sample(2, BACKWARD)])
    assert culprit.rank == 1 and "rank 1 no stack (stopped?)" in culprit.summary


def test_with_every_stack_alike_the_rank_behind_on_steps_is_named_and_otherwise_none() -> None:
    assert name_culprit([sample(0, BACKWARD, 9), sample(1, BACKWARD, 8)]).rank == 1
    alike = name_culprit([sample(0, BACKWARD, 9), sample(1, BACKWARD, 9)])
    assert alike.rank is None and alike.summary.startswith("ranks 0-1 in")
    assert name_culprit([]).summary == "no stacks came back"
