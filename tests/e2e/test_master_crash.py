"""`stead run` supervises its master: SIGKILL on the master costs training nothing.

The master is found the way an operator finds it (`stead status --json`), killed
with SIGKILL, and `stead run` starts another on the same address; the agents
and their workers run on, and the new master adopts them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from stead.core.events import NodeLost, NodeRequested, RoundStarted
from stead.core.events.log import EventLog
from stead.core.store import open_store
from stead.testing.steps import TRAIN_LOGGING_STEPS, read_steps

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

STEPS = 160
#: a guard against a hung job, not a measured duration
TIMEOUT_S = 240


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]]]]:
    (tmp_path / "train.py").write_text(TRAIN_LOGGING_STEPS)
    runs: list[subprocess.Popen[bytes]] = []
    yield tmp_path, runs
    for run in runs:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)  # the supervisor stops its master and nodes
            run.wait(timeout=60)


def _start(cwd: Path, runs: list[subprocess.Popen[bytes]], *flags: str) -> subprocess.Popen[bytes]:
    with (cwd / "stderr.log").open("ab") as err:
        run = subprocess.Popen([sys.executable, "-m", "stead", "run", "--job-name", "mc", "--log-format", "json",
                                "--nnodes", "2", "--nproc-per-node", "1", *flags, "train.py", str(STEPS)],
                               cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)
    runs.append(run)
    return run


def _wait_for(predicate: object, what: str, cwd: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"the job never got to: {what}; its log ends:\n{(cwd / 'stderr.log').read_text()[-4000:]}")
        time.sleep(0.05)


def _master_pid(cwd: Path) -> int:
    out = subprocess.run([sys.executable, "-m", "stead", "status", "--job", "mc", "--json"], cwd=cwd,
                         capture_output=True, text=True, timeout=60, check=True)
    return int(json.loads(out.stdout)["master_pid"])


def _log_times(cwd: Path, event: str) -> list[float]:
    times = []
    for line in (cwd / "stderr.log").read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                times.append(datetime.fromisoformat(record["timestamp"].rstrip("Z")).timestamp())
    return times


async def test_a_killed_master_is_replaced_and_its_nodes_adopted_while_the_workers_keep_stepping(
        job: tuple[Path, list[subprocess.Popen[bytes]]]) -> None:
    cwd, runs = job
    run = _start(cwd, runs)
    steps = cwd / "steps.log"
    _wait_for(lambda: len(read_steps(steps)) >= 10, "its first steps", cwd)
    killed = _master_pid(cwd)
    killed_at = time.time()
    os.kill(killed, signal.SIGKILL)
    assert run.wait(timeout=TIMEOUT_S) == 0, (cwd / "stderr.log").read_text()[-4000:]

    ready = [t for t in _log_times(cwd, "master_ready") if t > killed_at]
    assert ready, "no new master came up"
    stepped = [s for t, s in read_steps(steps) if killed_at < t < ready[0]]
    assert stepped, "the workers stopped stepping while no master ran"
    assert [s for _, s in read_steps(steps)] == list(range(STEPS)), "a step was lost or repeated"
    assert _master_pid(cwd) != killed
    err = (cwd / "stderr.log").read_text()
    assert f"the master (pid {killed}) was killed by SIGKILL" in err and "starting a new one (1 of 3)" in err

    store = await open_store(f"sqlite:///{cwd / '.stead' / 'mc.db'}")
    try:
        events = [r.event for r in await EventLog(store, "mc").read()]
    finally:
        await store.close()
    assert not [e for e in events if isinstance(e, NodeLost)], "the new master declared a running node lost"
    assert [e.round for e in events if isinstance(e, RoundStarted)] == [1], "the workers were restarted"
    assert {(e.node_id, e.incarnation) for e in events if isinstance(e, NodeRequested)} == {("node-0", 1),
                                                                                            ("node-1", 1)}


async def test_a_master_that_dies_past_its_restart_budget_ends_the_run_and_leaves_nothing_behind(
        job: tuple[Path, list[subprocess.Popen[bytes]]]) -> None:
    cwd, runs = job
    run = _start(cwd, runs, "--set", "master_max_restarts=0")
    _wait_for(lambda: len(read_steps(cwd / "steps.log")) >= 5, "its first steps", cwd)
    os.kill(_master_pid(cwd), signal.SIGKILL)
    assert run.wait(timeout=TIMEOUT_S) == 1
    err = (cwd / "stderr.log").read_text()
    assert "restarted 0 time(s) already (master_max_restarts); giving up" in err
    assert "resumes the job from its log" in err
