"""A warned agent (SIGUSR1: Slurm's warning before a time limit) persists, then reports what the warning's source
announced to its master; without a source (outside Slurm) it persists and reports nothing."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from stead.cli.run_args import parse_run_args
from stead.core.agent.extensions import Extensions
from stead.core.agent.main import Agent
from stead.core.agent.warned import WarningSaid, WarningSource
from stead.core.config import Settings
from stead.core.events import JobWarned
from stead.core.rpc import AgentReport

pytestmark = pytest.mark.anyio

SETTINGS = Settings(rpc_timeout_s=5.0, retry_initial_s=0.01, retry_max_s=0.05)


class _Master:
    """What the agent calls here: the reports of warnings."""

    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.warned: list[AgentReport[JobWarned]] = []

    async def report_warned(self, report: AgentReport[JobWarned]) -> None:
        self.warned.append(report)


class _Persisting:
    name = "persisting"

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def warned(self, *, reason: str) -> int:
        self.calls.append("persist")
        return 141  # the step it persists (the checkpoint extension's answer)


async def _one_warning() -> AsyncIterator[int]:
    yield signal.SIGUSR1


async def _warn(tmp_path: Path, source: WarningSource | None, calls: list[str]) -> _Master:
    master = _Master()
    config = parse_run_args(["--nnodes", "1", "--nproc-per-node", "1", "--no-python", "true"], cwd=str(tmp_path))
    agent = Agent(client=cast(Any, master), config=config, node_id="node-0", incarnation=2, settings=SETTINGS,
                  extensions=Extensions([_Persisting(calls)]), warning_source=source)
    agent.round = 3
    await agent._persist_on_warning(_one_warning())
    return master


async def test_a_warned_agent_persists_then_reports_what_slurm_said(tmp_path: Path) -> None:
    calls: list[str] = []

    async def ask() -> WarningSaid:
        calls.append("ask")
        return WarningSaid(time_left_s=118, said="Slurm warned: time limit in ~118 s")

    master = await _warn(tmp_path, WarningSource(name="slurm", ask=ask), calls)
    assert calls == ["persist", "ask"]  # the persist first: asking Slurm may take seconds
    [report] = master.warned
    event = report.event
    assert report.incarnation == 2 and event.warned_at > 0
    assert event == JobWarned(node_id="node-0", incarnation=2, round=3, signal="SIGUSR1", source="slurm",
                              warned_at=event.warned_at, time_left_s=118, said="Slurm warned: time limit in ~118 s",
                              persisted_step=141)


async def test_a_source_that_fails_still_leaves_the_warning_reported_with_its_time_left_unknown(
        tmp_path: Path) -> None:
    async def ask() -> WarningSaid:
        raise RuntimeError("scontrol crashed")

    master = await _warn(tmp_path, WarningSource(name="slurm", ask=ask), [])
    [report] = master.warned
    assert report.event.time_left_s is None
    assert report.event.said == "time left unknown: asking failed: RuntimeError('scontrol crashed')"


async def test_outside_slurm_a_warned_agent_persists_and_reports_nothing(tmp_path: Path) -> None:
    calls: list[str] = []
    master = await _warn(tmp_path, None, calls)
    assert calls == ["persist"] and master.warned == []
