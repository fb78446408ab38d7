"""A master replaced mid-job: the workers keep stepping, the new master adopts the running nodes.

Real agents (``stead agent`` processes, started by hand as on a cluster), real gloo
workers, a sqlite store; master A stops while the job trains, master B starts on the
same store and address a few seconds later.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from stead.cli.run_args import parse_run_args
from stead.core.agent.main import EXIT_MASTER_GONE
from stead.core.config import Settings
from stead.core.events import JobSubmitted, NodeLost, NodeRequested, RoundStarted
from stead.core.events.log import EventLog
from stead.core.master import Master, MasterConfig
from stead.core.runspec import RUN_SPEC_ENV, spec_text
from stead.core.statemachine import JobPhase
from stead.testing.steps import TRAIN_LOGGING_STEPS, free_port, read_steps

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

STEPS = 300
#: steps the workers take while no master runs: longer than the heartbeat timeout
GAP_STEPS = 100


async def _until(predicate: object, what: str) -> None:
    """Poll until ``predicate()`` holds; a job stuck here is ended by the test timeout, naming ``what``."""
    try:
        with anyio.fail_after(120):
            while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 (another process writes it)
                await asyncio.sleep(0.1)
    except TimeoutError:
        pytest.fail(f"the job never got to: {what}")


@pytest.mark.extended("a master replaced, every node adopted, the workers stepping on: tests/e2e/test_master_crash.py")
async def test_workers_keep_stepping_while_the_master_is_replaced_and_the_new_one_adopts_every_node(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN_LOGGING_STEPS)
    url = f"sqlite:///{tmp_path / 'job.db'}"
    config = MasterConfig(job="fo", store_url=url, settings=Settings(), port=free_port(),
                          token_file=str(tmp_path / "fo.token"))
    argv = ["--job-name", "fo", "--store", url, "--nnodes", "2", "--nproc-per-node", "1", "train.py", str(STEPS)]
    env = {RUN_SPEC_ENV: spec_text(parse_run_args(argv, cwd=str(tmp_path)))}
    agents: list[subprocess.Popen[bytes]] = []
    steps = tmp_path / "steps.log"
    try:
        async with Master(config) as first:
            await first.submit_job(JobSubmitted(job="fo", min_nodes=2, max_nodes=2, nproc_per_node=1,
                                                entrypoint=(sys.executable, "-u", "train.py", str(STEPS))))
            for node in ("node-0", "node-1"):
                with (tmp_path / f"{node}.err").open("wb") as err:  # a file: an unread pipe fills and blocks it
                    agents.append(subprocess.Popen(  # noqa: ASYNC220 (returns at once)
                        [sys.executable, "-m", "stead", "agent", "--master", first.address, "--token-file",
                         str(tmp_path / "fo.token"), "--node-id", node, "--incarnation", "1"],
                        cwd=tmp_path, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=err))
            await _until(lambda: len(read_steps(steps)) >= 10, "the first steps")
        gone_at = time.time()
        await _until(lambda: read_steps(steps)[-1][1] >= _last_step_before(steps, gone_at) + GAP_STEPS,
                     "steps while no master runs")
        back_at = time.time()
        async with Master(config) as second:
            state = await second.wait(timeout_s=120)
            records = await EventLog(second.store, "fo").read()
            # each agent told by this master to stop (one still in its reconnect backoff is told once it is back)
            with anyio.move_on_after(60):
                for agent in agents:
                    await anyio.to_thread.run_sync(agent.wait)
            codes = [agent.poll() for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    stepped = [s for t, s in read_steps(steps) if gone_at < t < back_at]
    assert len(stepped) >= GAP_STEPS, "the workers stopped stepping while no master ran"
    assert [s for _, s in read_steps(steps)] == list(range(STEPS)), "a step was lost or repeated"
    assert state.phase is JobPhase.SUCCEEDED and state.restarts == 0, state.reason
    events = [r.event for r in records]
    assert not [e for e in events if isinstance(e, NodeLost)], "the new master declared a running node lost"
    assert [e.round for e in events if isinstance(e, RoundStarted)] == [1], "the nodes were not adopted as they ran"
    assert {(e.node_id, e.incarnation) for e in events if isinstance(e, NodeRequested)} == {("node-0", 1),
                                                                                            ("node-1", 1)}
    assert codes == [0, 0], [(tmp_path / f"{node}.err").read_text()[-3000:] for node in ("node-0", "node-1")]


def _last_step_before(path: Path, at: float) -> int:
    before = [s for t, s in read_steps(path) if t <= at]
    return before[-1] if before else -1


async def test_agents_whose_master_stays_gone_stop_their_workers_and_exit_cleanly(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN_LOGGING_STEPS)
    url = f"sqlite:///{tmp_path / 'job.db'}"
    config = MasterConfig(job="gone", store_url=url, settings=Settings(), port=free_port(),
                          token_file=str(tmp_path / "gone.token"))
    argv = ["--job-name", "gone", "--store", url, "--nnodes", "1", "--nproc-per-node", "2",
            "--set", "master_gone_timeout_s=2", "train.py", "100000"]
    agent: subprocess.Popen[bytes] | None = None
    steps = tmp_path / "steps.log"
    try:
        async with Master(config) as master:
            await master.submit_job(JobSubmitted(job="gone", min_nodes=1, max_nodes=1, nproc_per_node=2,
                                                 entrypoint=(sys.executable, "-u", "train.py", "100000")))
            with (tmp_path / "agent.err").open("wb") as log:  # a file: an unread pipe fills and blocks it
                agent = subprocess.Popen(  # noqa: ASYNC220 (returns at once)
                    [sys.executable, "-m", "stead", "agent", "--master", master.address, "--token-file",
                     str(tmp_path / "gone.token"), "--node-id", "node-0", "--incarnation", "1"],
                    cwd=tmp_path, env={**os.environ, RUN_SPEC_ENV: spec_text(parse_run_args(argv, cwd=str(tmp_path)))},
                    stdout=subprocess.DEVNULL, stderr=log)
            await _until(lambda: len(read_steps(steps)) >= 5, "the first steps")
        # the master is gone for good: the agent gives up after master_gone_timeout_s
        with anyio.fail_after(120):
            code = await anyio.to_thread.run_sync(agent.wait)
        err = (tmp_path / "agent.err").read_text()
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
    assert code == EXIT_MASTER_GONE, err[-3000:]
    assert "master_gone" in err and "resumes the job" in err
    assert "workers_stop" in err, "the agent exited without stopping its workers"
