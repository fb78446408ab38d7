"""Flash checkpoints in whole `stead run` jobs: a crashed worker resumes from memory and loses no step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

RunJob = Callable[..., Any]  # the run_job fixture of conftest.py

pytestmark = pytest.mark.e2e

#: deterministic: each step's batch depends only on (step, rank); rank 1 crashes once both ranks saved step CRASH
TRAIN = """
import json, os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import stead
from stead.ckpt import FlashCheckpointer

CRASH, OUT, STEPS = int(sys.argv[1]), sys.argv[2], 10
dist.init_process_group("gloo")
rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
ckpt = FlashCheckpointer()
first = 0
restored = ckpt.load({"model": model.state_dict(), "optim": opt.state_dict()})
if restored is not None:
    step, state = restored
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    first = step + 1
    with open(f"resumed-{rank}.json", "w") as handle:
        json.dump({"step": step, "restart": restart}, handle)
for step in range(first, STEPS):
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    loss = model(batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    stead.report_step(step)
    if step == CRASH and restart == 0:
        dist.barrier()  # both ranks saved the step: rank 0 is not stopped before its save on a loaded machine
        if rank == 1:
            os._exit(17)
if rank == 0:
    torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, OUT)
ckpt.close()
dist.destroy_process_group()
"""


@pytest.mark.extended("a crashed worker restored from memory, the weights bit-exact: tests/chaos/test_chaos.py's "
                      "quick schedule and tests/e2e/test_recipes.py")
def test_a_crashed_worker_resumes_from_memory_and_ends_with_the_weights_of_a_fault_free_run(
        run_job: RunJob, tmp_path: Path) -> None:
    flags = ("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2")
    clean = run_job(TRAIN, "-1", "clean.pt", job="clean", flags=flags)
    assert clean.returncode == 0, clean.stderr[-3000:]
    crashed = run_job(TRAIN, "4", "crashed.pt", job="crashed", flags=flags)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    resumed = [json.loads((tmp_path / f"resumed-{rank}.json").read_text()) for rank in (0, 1)]
    assert resumed == [{"step": 4, "restart": 1}] * 2  # the step saved just before the crash: none lost
    events = crashed.events("crashed")
    # rank 1's exit 17 is on record even when rank 0's broken connection was reported (and decided) first
    assert "worker.failed" in events and "exit_code=17" in events, events
    assert "ckpt.restored        round=2 step=4 memory_ranks=2 disk_ranks=0" in events
    expected = torch.load(tmp_path / "clean.pt", weights_only=True)
    actual = torch.load(tmp_path / "crashed.pt", weights_only=True)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
