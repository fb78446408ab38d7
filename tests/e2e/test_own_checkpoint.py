"""A script that checkpoints itself (torch.save every step, resumed from its own file) and never calls a stead API:
stead's step count, final step and goodput follow the script's own log through a worker crash and a node loss."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

RunJob = Callable[..., Any]  # the run_job fixture of conftest.py

pytestmark = pytest.mark.e2e

STEPS = 120

#: DDP over 2 nodes; rank 0 crashes at step 40 (first attempt), node 1's agent is SIGKILLed at step 80 (the node is
#: lost and relaunched: a new agent that knows nothing of the job's steps); every rank logs "pid step time"
SELF_CHECKPOINTING = """
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
path, start = f"own{rank}.pt", 0
if os.path.exists(path):
    saved = torch.load(path)
    model.module.load_state_dict(saved["model"]); opt.load_state_dict(saved["opt"]); start = saved["step"] + 1
log = open(f"steps{rank}.log", "a")
for step in range(start, STEPS):
    if step == 40 and rank == 0 and restart == 0:
        os._exit(3)
    if step == 80 and rank == 1 and not os.path.exists("agent-killed"):
        open("agent-killed", "w").close()
        parent = lambda p: int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        pid = os.getpid()
        while pid > 1 and b"stead agent" not in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" "):
            pid = parent(pid)
        os.kill(pid, 9)
        time.sleep(60)
    time.sleep(0.1)  # the step's work: before its log line, so that nothing unlogged comes after one
    model(torch.ones(4, 8)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)
    log.write(f"{os.getpid()} {step} {time.time()}\\n"); log.flush()
dist.destroy_process_group()
""".replace("STEPS", str(STEPS))


def useful_by_the_log(lines: list[str]) -> float:
    """Seconds of the steps that count, by the script's own log: each kept step's time since the step before it
    in the same process (a step done again after a rollback counts once, its last time)."""
    last: dict[int, float] = {}  # step -> seconds since the previous step of the same process
    previous: tuple[int, float] | None = None
    for line in lines:
        pid, step, at = int(line.split()[0]), int(line.split()[1]), float(line.split()[2])
        last[step] = at - previous[1] if previous is not None and previous[0] == pid else 0.0
        previous = (pid, at)
    return sum(last.values())


@pytest.mark.long(35)
def test_a_script_that_checkpoints_itself_keeps_its_steps_and_goodput_through_a_crash_and_a_node_loss(
        run_job: RunJob) -> None:
    job = run_job(SELF_CHECKPOINTING, flags=("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3",
                                             "--set", "spare_agents=0"))
    assert job.returncode == 0, job.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "stead", "status", "--job", "e2e", "--json"], cwd=job.cwd,
                         capture_output=True, text=True, timeout=60)
    status = json.loads(out.stdout)
    assert status["recoveries"] == 2, status  # the crash and the node loss
    assert status["step"] == STEPS - 1  # the script's last step, not one counted from 0 after a restart
    log = (job.cwd / "steps0.log").read_text().splitlines()
    assert int(log[-1].split()[1]) == STEPS - 1
    by_log = useful_by_the_log(log) / status["wall_s"]
    assert status["goodput"] == pytest.approx(by_log, abs=0.02), (status, by_log)
    assert status["lost_s"] < 1.0, status  # nothing stead saw was thrown away: only steps cut short by a failure
    assert any("the script's own checkpoint" in m for m in status["missing"]), status["missing"]
