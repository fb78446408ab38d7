"""Inside a Slurm job, the agent's source of the SIGUSR1 warning is Slurm, asked how long the job has left."""

from __future__ import annotations

from pathlib import Path

import pytest

from stead.cli.slurm_signals import slurm_warning_source
from stead.core.agent.warned import WarningSaid
from tests.support.slurm import scontrol_on_path

pytestmark = pytest.mark.anyio

_JOB = ("JobId=42 JobName=train UserId=u(1000) JobState=RUNNING Reason=None Dependency=(null) RunTime=00:00:30 "
        "TimeLimit=00:02:00 PreemptTime=None NodeList=h[1-3]")


async def test_inside_a_slurm_job_the_warning_s_source_is_slurm_saying_the_time_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scontrol_on_path(tmp_path, f"echo \"$*\" > {tmp_path}/asked; echo '{_JOB}'", monkeypatch)
    source = slurm_warning_source({"SLURM_JOB_ID": "42"})
    assert source is not None and source.name == "slurm"
    assert await source.ask() == WarningSaid(time_left_s=90, said="Slurm warned: time limit in ~90 s")
    assert (tmp_path / "asked").read_text() == "show job 42 -o\n"


async def test_a_controller_that_fails_leaves_the_time_left_unknown_saying_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scontrol_on_path(tmp_path, "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1",
                      monkeypatch)
    source = slurm_warning_source({"SLURM_JOB_ID": "42"})
    assert source is not None
    assert await source.ask() == WarningSaid(
        said="Slurm warned: time left unknown (Slurm's controller did not say) (scontrol exited 1: "
             "slurm_load_jobs error: Unable to contact slurm controller)")


def test_outside_a_slurm_job_the_agent_has_no_source_of_warnings() -> None:
    assert slurm_warning_source({}) is None
    assert slurm_warning_source({"SLURM_JOB_ID": " "}) is None
