"""stead status's warned lines: when Slurm warned, the time it left, the nodes that heard it, the step persisted."""

from __future__ import annotations

import dataclasses
import time

from stead.core.events import CheckpointPersisted, Event, JobStopped, JobWarned, Record, RoundStarted
from stead.core.statemachine import JobState
from stead.core.views.display import format_status, status_json
from stead.core.views.warnings import SHOWN, warning_lines

AT = 1.8e9
WARNED = JobWarned(node_id="node-0", incarnation=1, round=1, signal="SIGUSR1", source="slurm", warned_at=AT,
                   time_left_s=118, said="Slurm warned: time limit in ~118 s", committed_step=140)


def _records(*events: Event) -> list[Record]:
    """The events recorded a second apart from AT on."""
    return [Record(seq=i, at=AT + i, event=e) for i, e in enumerate(events, 1)]


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def test_a_warning_heard_by_every_node_and_persisted_is_one_line() -> None:
    warned = dataclasses.replace(WARNED, warned_at=AT + 2.5, persisted_step=142)  # (each node its report's step)
    records = _records(
        RoundStarted(round=1, members=("node-0", "node-1", "node-2"), nproc_per_node=1),
        CheckpointPersisted(step=140, path="/ckpt/140", world_size=3),  # before the warning: not its persist
        warned, dataclasses.replace(warned, node_id="node-1", warned_at=AT + 3, time_left_s=117),
        dataclasses.replace(warned, node_id="node-2"), dataclasses.replace(warned, node_id="node-2"),  # a retry
        CheckpointPersisted(step=142, path="/ckpt/142", world_size=3))
    assert warning_lines(records) == [
        f"by Slurm at {_clock(AT + 2.5)}: 118 s left (time limit at {_clock(AT + 120.5)}); warned on 3 of 3 nodes; "
        f"step 142 persisted at {_clock(AT + 7)}"]


def test_the_warning_s_persist_may_be_recorded_before_its_reports_and_nodes_that_disagree_are_named() -> None:
    # the step every node persisted is whole on disk before the first node's report of the warning is recorded
    # (a small state, a slow scontrol): still the warning's persist
    records = _records(
        RoundStarted(round=1, members=("node-0", "node-1"), nproc_per_node=1),
        CheckpointPersisted(step=140, path="p", world_size=2),
        dataclasses.replace(WARNED, persisted_step=140), dataclasses.replace(WARNED, node_id="node-1",
                                                                            persisted_step=141))
    records[1] = dataclasses.replace(records[1], at=AT + 0.5)
    assert warning_lines(records) == [
        f"by Slurm at {_clock(AT)}: 118 s left (time limit at {_clock(AT + 118)}); warned on 2 of 2 nodes; "
        f"step 140 persisted at {_clock(AT + 0.5)} (the nodes persisted steps 140, 141)"]
    already = _records(RoundStarted(round=1, members=("node-0",), nproc_per_node=1),
                       CheckpointPersisted(step=150, path="p", world_size=1),
                       dataclasses.replace(WARNED, warned_at=AT + 9))
    assert warning_lines(already)[0].endswith("; step 150 was on disk already")


def test_a_step_persisted_only_as_the_job_ended_is_told_apart_from_the_warning_s_persist() -> None:
    records = _records(WARNED, JobStopped(reason="stopped by SIGTERM: cancelled by scancel (CANCELLED)"),
                       CheckpointPersisted(step=160, path="/ckpt/160", world_size=1))
    assert warning_lines(records) == [
        f"by Slurm at {_clock(AT)}: 118 s left (time limit at {_clock(AT + 118)}); warned on 1 node; "
        f"step 160 persisted at {_clock(AT + 3)} as the job ended (no whole step persisted on the warning)"]


def test_a_warning_says_what_is_not_known_and_what_did_not_happen() -> None:
    records = _records(
        RoundStarted(round=1, members=("node-0", "node-1"), nproc_per_node=1),
        dataclasses.replace(WARNED, time_left_s=None, said="Slurm warned: time left unknown (no scontrol on PATH)"),
        CheckpointPersisted(step=139, path="/ckpt/139", world_size=2),  # older than the step committed when warned
        dataclasses.replace(WARNED, warned_at=AT + 600, committed_step=None))
    assert warning_lines(records) == [
        f"by Slurm at {_clock(AT)}: Slurm warned: time left unknown (no scontrol on PATH); warned on 1 of 2 nodes; "
        "no persist of step 140 or later recorded",
        f"by Slurm at {_clock(AT + 600)}: 118 s left (time limit at {_clock(AT + 718)}); warned on 1 of 2 nodes; "
        "no step committed yet to persist"]


def test_status_shows_the_newest_warnings_and_none_outside_slurm() -> None:
    many = [dataclasses.replace(WARNED, warned_at=AT + 100 * i) for i in range(SHOWN + 2)]
    lines = warning_lines(_records(*many))
    assert len(lines) == SHOWN and lines[-1].startswith(f"by Slurm at {_clock(AT + 100 * (SHOWN + 1))}: ")
    shown = format_status("j", JobState(), warnings=lines[-1:])
    assert f"\nwarned     {lines[-1]}" in shown
    assert status_json("j", JobState(), warnings=lines)["warnings"] == lines
    assert warning_lines(_records(RoundStarted(round=1, members=("node-0",), nproc_per_node=1))) == []
    assert "warned" not in format_status("j", JobState())
