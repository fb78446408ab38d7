"""Why Slurm ended a job, from ``scontrol show job -o``'s answers (the first four as Slurm 22.05 gave them on the test
cluster in a batch script's SIGTERM handler, shortened), and ``scontrol`` itself stood in for by shell commands:
an answer, a controller that does not answer, one that never answers, no scontrol at all. Against a real Slurm
cluster: tests/e2e/test_slurm.py (an ``scancel``)."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from stead.cli.slurm_signals import slurm_stop_cause, slurm_warnings
from stead.core.events import JobStopped, JobSubmitted, Record, decode_record, encode_record
from stead.core.statemachine.fold import fold_all
from stead.core.views.display import format_status
from stead.platforms.hosts.slurm_why import SlurmJob, ask_job, parse_duration_s, parse_job, stop_cause, warning_text
from tests.support.slurm import scontrol_on_path

pytestmark = pytest.mark.anyio

_JOB = ("JobId=7 JobName=train UserId=root(0) GroupId=root(0) Priority=4294901759 Nice=0 Account=(null) QOS=(null) "
        "JobState={state} Reason={reason} Dependency=(null) Requeue=0 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 "
        "RunTime={run} TimeLimit={limit} TimeMin=N/A SubmitTime=2026-11-27T18:37:24 StartTime=2026-11-27T18:37:24 "
        "EndTime=2026-11-27T18:38:33 Deadline=N/A PreemptEligibleTime=2026-11-27T18:37:24 PreemptTime={preempt} "
        "SuspendTime=None Partition=main NodeList=h[1-3] BatchHost=h1 NumNodes=3 Command=/work/train.sbatch")


def scontrol_line(state: str, reason: str = "None", *, preempt: str = "None", run: str = "00:01:09",
                  limit: str = "00:01:00") -> str:
    return _JOB.format(state=state, reason=reason, preempt=preempt, run=run, limit=limit)


@pytest.mark.parametrize(("answer", "cause"), [
    # what Slurm 22.05 said while the job's processes got their SIGTERM
    (scontrol_line("COMPLETING"), "cancelled by scancel (CANCELLED)"),
    (scontrol_line("COMPLETING", "TimeLimit"), "Slurm's time limit (TIMEOUT)"),
    (scontrol_line("COMPLETING", preempt="2026-11-27T18:37:14"), "preempted (PREEMPTED)"),
    (scontrol_line("COMPLETING", "NodeDown"), "node failure (NODE_FAIL)"),
    # the end states themselves (a controller asked later, another version), and their reasons while completing
    (scontrol_line("TIMEOUT", "TimeLimit"), "Slurm's time limit (TIMEOUT)"),
    (scontrol_line("CANCELLED"), "cancelled by scancel (CANCELLED)"),
    (scontrol_line("PREEMPTED"), "preempted (PREEMPTED)"),
    (scontrol_line("NODE_FAIL", "NodeDown"), "node failure (NODE_FAIL)"),
    (scontrol_line("COMPLETING", "NodeFail"), "node failure (NODE_FAIL)"),
    (scontrol_line("DEADLINE"), "the job's deadline (DEADLINE)"),
    (scontrol_line("COMPLETING", "launch_failed_requeued_held"),
     "Slurm ends the job: COMPLETING, reason launch_failed_requeued_held"),
    # still running: the SIGTERM was not the job's end (`scancel --signal=TERM`, a kill)
    (scontrol_line("RUNNING"), "cause unknown: Slurm says the job is RUNNING (reason None), not ending: the signal "
                               "came from `scancel --signal` or another program"),
    # answers with no state
    ("", "cause unknown: Slurm's controller did not say (no answer)"),
    ("JobId=7 JobName=train", "cause unknown: Slurm's controller did not say (no answer)"),
    ("JobState=running Reason=None", "cause unknown: Slurm's controller did not say (no answer)"),
    ("\x00\xff garbage JobState=", "cause unknown: Slurm's controller did not say (no answer)"),
])
def test_the_cause_is_read_from_the_jobs_state_reason_and_preemption_time(answer: str, cause: str) -> None:
    assert stop_cause(parse_job(answer)) == cause


def test_an_unanswered_question_is_cause_unknown_saying_what_went_wrong() -> None:
    assert stop_cause(None, trouble="scontrol gave no answer in 2 s") == (
        "cause unknown: Slurm's controller did not say (scontrol gave no answer in 2 s)")


@pytest.mark.parametrize(("text", "seconds"), [
    ("00:01:00", 60), ("1:59", 119), ("2-03:04:05", ((2 * 24 + 3) * 60 + 4) * 60 + 5), ("0:00", 0),
    ("UNLIMITED", None), ("INVALID", None), ("N/A", None), ("", None), ("1:2:3:4", None),
])
def test_slurm_durations_are_read_in_seconds(text: str, seconds: int | None) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize(("answer", "said"), [
    (scontrol_line("RUNNING", run="00:00:01", limit="00:02:00"), "Slurm warned: time limit in ~119 s"),
    (scontrol_line("RUNNING", run="1-00:00:00", limit="1-00:02:00"), "Slurm warned: time limit in ~120 s"),
    (scontrol_line("RUNNING", run="00:03:00", limit="00:02:00"), "Slurm warned: time limit in ~0 s"),
    (scontrol_line("RUNNING", run="00:00:01", limit="UNLIMITED"),
     "Slurm warned: no time limit known (RUNNING, reason None): a preemption, or a signal sent"),
    ("garbage", "Slurm warned: time left unknown (Slurm's controller did not say)"),
])
def test_a_warning_says_the_time_left_when_slurm_knows_it(answer: str, said: str) -> None:
    assert warning_text(parse_job(answer)) == said


class StandIn:
    """``scontrol`` as a shell line (its output, its exit status, or a wait); every command line kept."""

    def __init__(self, line: str) -> None:
        self.line = line
        self.commands: list[tuple[str, ...]] = []
        self.processes: list[asyncio.subprocess.Process] = []

    async def spawn(self, *command: str, **kwargs: Any) -> asyncio.subprocess.Process:
        self.commands.append(command)
        process = await asyncio.create_subprocess_exec("sh", "-c", self.line, **kwargs)
        self.processes.append(process)
        return process


async def test_the_job_is_asked_of_scontrol_and_its_answer_read() -> None:
    fake = StandIn(f"printf '%s\\n' {shlex.quote(scontrol_line('COMPLETING', 'TimeLimit'))}")
    job, trouble = await ask_job("7", scontrol="scontrol", spawn=fake.spawn)
    assert fake.commands == [("scontrol", "show", "job", "7", "-o")]
    assert (job, trouble) == (SlurmJob(state="COMPLETING", reason="TimeLimit", time_limit_s=60, run_time_s=69), "")


async def test_an_unreachable_controller_is_cause_unknown_with_what_scontrol_said() -> None:
    fake = StandIn("echo 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2; exit 1")
    job, trouble = await ask_job("7", scontrol="scontrol", spawn=fake.spawn)
    assert job is None
    assert stop_cause(job, trouble=trouble) == (
        "cause unknown: Slurm's controller did not say (scontrol exited 1: slurm_load_jobs error: Unable to contact "
        "slurm controller (connect failure))")


async def test_a_controller_that_never_answers_is_given_up_and_its_scontrol_killed() -> None:
    fake = StandIn("exec sleep 60")
    with anyio.fail_after(30):  # a guard against a hang, not a measure: the question gives up after 0.2 s
        job, trouble = await ask_job("7", scontrol="scontrol", timeout_s=0.2, spawn=fake.spawn)
    assert (job, trouble) == (None, "scontrol gave no answer in 0.2 s")
    assert fake.processes[0].returncode == -signal.SIGKILL  # nothing left behind


async def test_an_answer_without_a_state_says_what_came(tmp_path: Path) -> None:
    fake = StandIn("echo 'slurm_load_jobs error: Invalid job id specified'")
    job, trouble = await ask_job("7", scontrol="scontrol", spawn=fake.spawn)
    assert job is None
    assert trouble == "scontrol's answer has no JobState: 'slurm_load_jobs error: Invalid job id specified'"


async def test_no_scontrol_is_cause_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert await ask_job("7") == (None, "no scontrol on PATH")
    job, trouble = await ask_job("7", scontrol=str(tmp_path / "missing"))
    assert job is None and trouble.startswith(f"{tmp_path / 'missing'} did not start: ")


async def test_a_sigterm_in_a_slurm_job_is_explained_byscontrol_on_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scontrol_on_path(tmp_path, f"echo \"$*\" > {tmp_path}/asked; echo {shlex.quote(scontrol_line('PREEMPTED'))}",
                      monkeypatch)
    assert await slurm_stop_cause({"SLURM_JOB_ID": "42"}, signal.SIGTERM) == "preempted (PREEMPTED)"
    assert (tmp_path / "asked").read_text() == "show job 42 -o\n"


async def test_outside_a_slurm_job_or_for_ctrl_c_nobody_is_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scontrol_on_path(tmp_path, f"touch {tmp_path}/asked", monkeypatch)
    assert await slurm_stop_cause({}, signal.SIGTERM) is None
    assert await slurm_stop_cause({"SLURM_JOB_ID": "42"}, signal.SIGINT) is None
    assert not (tmp_path / "asked").exists()


async def test_slurms_warning_is_answered_with_the_time_left_and_ignored_again_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    line = scontrol_line("RUNNING", run="00:00:30", limit="00:02:00")
    scontrol_on_path(tmp_path, f"echo {shlex.quote(line)}", monkeypatch)
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with capture_logs() as logs:
            async with slurm_warnings({"SLURM_JOB_ID": "42"}):
                os.kill(os.getpid(), signal.SIGUSR1)
                with anyio.fail_after(30):
                    while not any(e["event"] == "slurm_warned" for e in logs):  # noqa: ASYNC110 (a subprocess)
                        await anyio.sleep(0.05)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # a later warning must not end the process
    finally:
        signal.signal(signal.SIGUSR1, previous)
    warned = next(e for e in logs if e["event"] == "slurm_warned")
    assert (warned["said"], warned["time_left_s"]) == ("Slurm warned: time limit in ~90 s", 90)


def test_the_cause_reaches_stead_status_and_an_older_stop_without_one_still_loads() -> None:
    cause = stop_cause(parse_job(scontrol_line("COMPLETING", "TimeLimit")))
    stop = JobStopped(reason=f"stopped by SIGTERM: {cause}", cause=cause)
    submitted = JobSubmitted(job="j", min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=1,
                             max_node_relaunches=1, last_call_timeout_s=5.0, join_timeout_s=60.0)
    records = [Record(seq=1, at=1.0, event=submitted), Record(seq=2, at=2.0, event=stop)]
    state = fold_all(decode_record(encode_record(r), where="test") for r in records)
    assert "phase      stopped  (stopped by SIGTERM: Slurm's time limit (TIMEOUT))" in format_status("j", state)
    older = b'{"type": "job.stopped", "v": 1, "seq": 2, "at": 2.0, "data": {"reason": "stopped by SIGTERM"}}'
    assert decode_record(older, where="test").event == JobStopped(reason="stopped by SIGTERM", cause="")
