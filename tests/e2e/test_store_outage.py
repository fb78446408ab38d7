"""A job on etcd rides out an etcd outage: the store crashed and restarted, or frozen, mid-job.

While the store is away the master cannot record anything, but the workers train
on: nothing they do waits on the store. The master's tasks wait for the store
instead of counting its absence as failures, its hang detector trusts the nodes'
heartbeats over the progress it could not record, and the job ends as if nothing
happened: exit 0, every step once, no worker restarted. An outage longer than
``retry_deadline_s`` ends the job with a clear message, and `stead run` with the
same job name resumes it once the store is back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stead.testing.etcd import EtcdServer
from stead.testing.steps import read_steps

pytestmark = [pytest.mark.e2e]

#: a guard against a hung job, not a measured duration
TIMEOUT_S = 240
#: the hang detector's floor in the frozen-etcd test (its default is 20 s)
HANG_FLOOR_S = 5

#: trains until the file stop_at names a step (every rank agrees on it through an all-reduce), saving a flash
#: checkpoint and reporting every step; rank 0 logs each step to steps.log
TRAIN = """\
import os, time
import torch, torch.distributed as dist
import stead
from stead.ckpt import FlashCheckpointer

dist.init_process_group("gloo")
rank = dist.get_rank()
ckpt = FlashCheckpointer()
state = {"w": torch.zeros(4)}
step = 0
restored = ckpt.load(state)
if restored is not None:
    step, state = restored[0] + 1, restored[1]
while True:
    stop = torch.tensor([int(open("stop_at").read()) if os.path.exists("stop_at") else 1 << 40])
    dist.all_reduce(stop, op=dist.ReduceOp.MIN)
    if step > int(stop.item()):
        break
    time.sleep(0.05)
    state["w"] += 1
    ckpt.save(step, state)
    stead.report_step(step)
    if rank == 0:
        with open("steps.log", "a") as f:
            f.write(f"{time.time()} {step}\\n")
    step += 1
ckpt.close()
dist.destroy_process_group()
"""


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    """An etcd of this test's own: the test crashes and freezes it."""
    with EtcdServer() as server:
        yield server


def _start(cwd: Path, store: str, *flags: str) -> subprocess.Popen[bytes]:
    (cwd / "train.py").write_text(TRAIN)
    with (cwd / "stderr.log").open("ab") as err:
        return subprocess.Popen([sys.executable, "-m", "stead", "run", "--job-name", "outage", "--store", store,
                                 "--log-format", "json", "--nnodes", "2", "--nproc-per-node", "1", *flags,
                                 "train.py"], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)


def _wait_for(predicate: Callable[[], bool], what: str, cwd: Path, run: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline or run.poll() is not None:
            pytest.fail(f"the job never got to: {what} (exit code {run.poll()}); its log ends:\n"
                        f"{(cwd / 'stderr.log').read_text()[-4000:]}")
        time.sleep(0.05)


def _last_step(cwd: Path) -> int:
    steps = read_steps(cwd / "steps.log")
    return steps[-1][1] if steps else -1


def _stop_at(cwd: Path, step: int) -> None:
    tmp = cwd / "stop_at.tmp"
    tmp.write_text(str(step))
    os.replace(tmp, cwd / "stop_at")


def _records(cwd: Path, store: str, kind: str) -> list[dict[str, object]]:
    out = subprocess.run([sys.executable, "-m", "stead", "events", "--store", store, "--job", "outage", "--json"],
                         cwd=cwd, capture_output=True, text=True, timeout=60, check=True)
    return [r["data"] for r in map(json.loads, out.stdout.splitlines()) if r["type"] == kind]


def _finish(cwd: Path, run: subprocess.Popen[bytes], outage: Callable[[], None], *, before: int = 20) -> None:
    """Let the job take ``before`` steps, run ``outage``, let it step on, then have it stop; it must exit 0."""
    try:
        _wait_for(lambda: _last_step(cwd) >= before, f"its first {before} steps", cwd, run)
        outage()
        after = _last_step(cwd)
        _wait_for(lambda: _last_step(cwd) >= after + 20, "20 steps after the outage", cwd, run)
        _stop_at(cwd, _last_step(cwd) + 5)
        assert run.wait(timeout=TIMEOUT_S) == 0, (cwd / "stderr.log").read_text()[-4000:]
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=60)


def _assert_untouched(cwd: Path, store: str) -> None:
    """Every step exactly once, in one round: no worker restarted, no step lost or done again."""
    steps = [s for _, s in read_steps(cwd / "steps.log")]
    assert steps == list(range(len(steps))), f"steps lost or done again: {steps}"
    assert len(_records(cwd, store, "round.started")) == 1, "the workers were restarted"
    assert not _records(cwd, store, "worker.failed")


@pytest.mark.extended("an outage ridden out with no step lost: the frozen etcd below; etcd restarted on its data "
                      "and the job resuming: the outage past retry_deadline_s below")
def test_an_etcd_killed_for_10_s_and_restarted_on_its_data_costs_no_step_and_no_restart(
        tmp_path: Path, etcd: EtcdServer) -> None:
    run = _start(tmp_path, etcd.url)

    def log() -> str:
        return (tmp_path / "stderr.log").read_text()

    def crash_and_restart() -> None:
        etcd.kill()
        time.sleep(10)
        etcd.start()
        # the paused task notices the store back on its next backoff try, which may come after the 20 steps the
        # job takes before it is told to stop: wait for it, or a job that ends first leaves nothing to assert on.
        # An append whose answer the outage lost but etcd applied stops the master instead (its state lacks the
        # record): the next master replays the log and adopts the nodes, which is riding it out too
        _wait_for(lambda: '"master_task_resumed"' in log() or '"job_taken_over"' in log(),
                  "the master resuming its paused task, or a new master taking the job over", tmp_path, run)

    _finish(tmp_path, run, crash_and_restart)
    _assert_untouched(tmp_path, etcd.url)
    assert '"master_task_paused"' in log(), "the outage was not noticed: the test proves nothing"


@pytest.mark.long(35)
def test_an_etcd_frozen_past_the_hang_floor_costs_no_step_and_no_restart(tmp_path: Path, etcd: EtcdServer) -> None:
    # the hang detector's floor lowered from its 20 s default (the freeze outlasts it all the same, and the test
    # takes 10 s less): while etcd is frozen the progress the detector sees stops being recorded
    run = _start(tmp_path, etcd.url, "--set", f"diagnosis.hang_floor_s={HANG_FLOOR_S}")

    def freeze() -> None:
        etcd.pause()
        try:
            # past the floor with room to spare: while etcd is frozen, each of the detector's looks also waits out
            # a store call's deadline (~5 s) before the next
            time.sleep(HANG_FLOOR_S + 15)
        finally:
            etcd.resume()

    # long enough before the freeze for the hang detector to have learnt the job's pace (a few progress records):
    # until then its allowance is first_step_s, longer than the freeze
    _finish(tmp_path, run, freeze, before=100)
    _assert_untouched(tmp_path, etcd.url)
    assert '"hang_not_confirmed"' in (tmp_path / "stderr.log").read_text()


@pytest.mark.long(30)
def test_an_outage_past_retry_deadline_s_ends_the_job_clearly_and_the_job_resumes_once_the_store_is_back(
        tmp_path: Path, etcd: EtcdServer) -> None:
    run = _start(tmp_path, etcd.url, "--set", "retry_deadline_s=3", "--set", "master_max_restarts=1")
    try:
        _wait_for(lambda: _last_step(tmp_path) >= 20, "its first 20 steps", tmp_path, run)
        etcd.kill()
        code = run.wait(timeout=TIMEOUT_S)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    log = (tmp_path / "stderr.log").read_text()
    assert code == 1, log[-4000:]
    assert "the state store has not answered for retry_deadline_s=3 s" in log
    assert f"state store {etcd.url} is unreachable" in log
    assert "with the same job name" in log
    assert '"local_platform_detached"' in log, "the failing master stopped the nodes instead of leaving them"
    assert '"orphans_stopping"' in log  # `stead run` stopped them when it gave up
    before, logged = _last_step(tmp_path), len(read_steps(tmp_path / "steps.log"))

    etcd.start()
    _stop_at(tmp_path, before + 10)
    (tmp_path / "stderr.log").write_text("")
    again = _start(tmp_path, etcd.url)
    assert again.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "stderr.log").read_text()[-4000:]
    assert "resuming job outage" in (tmp_path / "stderr.log").read_text()
    resumed = [s for _, s in read_steps(tmp_path / "steps.log")[logged:]]
    assert 0 < resumed[0] <= before + 1, f"the job did not resume from a checkpoint: {resumed}"
    assert resumed == list(range(resumed[0], before + 11))
