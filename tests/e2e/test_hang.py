"""A hung rank is found from the job's own pace, named from its stack, and the round restarted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

RunJob = Callable[..., Any]  # the run_job fixture of conftest.py

pytestmark = pytest.mark.e2e

#: 3 ranks so that the two waiting in DDP's all-reduce are the majority; no stead call (steps detected by stead)
TRAIN = """
import os, signal, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

FAULT = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(12):
    if step == 6 and rank == 1 and restart == 0:
        if FAULT == "sleep":
            time.sleep(3600)
        else:
            os.kill(os.getpid(), signal.SIGSTOP)
    loss = model(torch.ones(4, 8)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.05)
if rank == 0:
    print(f"finished restart={restart}", flush=True)
dist.destroy_process_group()
"""
LINE = {"sleep": TRAIN.splitlines().index("            time.sleep(3600)") + 1,
        "backward": TRAIN.splitlines().index("    opt.zero_grad(); loss.backward(); opt.step()") + 1}
#: a pace model tuned down for a short test: 3 s without a step after ~0.5 s gaps is a hang
FAST = ("--set", "diagnosis.hang_floor_s=3", "--set", "diagnosis.hang_factor=4", "--set", "progress_interval_s=0.2")


@pytest.mark.parametrize("fault", [pytest.param("sleep", marks=pytest.mark.extended(
    "a hung rank named from its stack and the job restarted: the stopped variant (no stack at all)")), "stop"])
def test_a_hung_rank_is_named_from_its_stack_and_the_job_restarts_and_completes(run_job: RunJob,
                                                                                fault: str) -> None:
    job = run_job(TRAIN, fault, flags=("--nproc-per-node", "3", "--max-restarts", "1", *FAST))
    assert job.returncode == 0, job.stderr[-3000:]
    assert "finished restart=1" in job.stdout
    events = job.events("e2e")
    hang = next(line for line in events.splitlines() if "diagnosis.hang" in line)
    assert "rank=1 " in hang and "action=restart" in hang, hang
    where_ = f"rank 1 at train.py:{LINE['sleep']} in <module>" if fault == "sleep" else "rank 1 no stack (stopped?)"
    assert where_ in hang, hang
    assert f"ranks 0,2 in _engine_run_backward() at train.py:{LINE['backward']}" in hang, hang
    assert "request.restart" in events and "round=2" in events and "job.succeeded" in events
