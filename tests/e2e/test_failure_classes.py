"""Failures classified from what they really show (an OOM, by its record), and a slow node reported as a straggler."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

RunJob = Callable[..., Any]  # the run_job fixture of conftest.py

pytestmark = pytest.mark.e2e


def status(job: Any, name: str = "e2e") -> str:
    out = subprocess.run([sys.executable, "-m", "stead", "status", "--job", name], cwd=job.cwd,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def events(job: Any, name: str = "e2e") -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "stead", "events", "--job", name, "--json"], cwd=job.cwd,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def of_type(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r["data"] for r in records if r["type"] == kind]


#: the first attempt runs out of memory (how: argv[1]); the restarted one trains to the end
OOM = """
import os, resource, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    if step == 2 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        if sys.argv[1] == "rlimit":  # an address-space limit: torch's allocator refuses, the script raises
            resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
            torch.empty(8 << 30, dtype=torch.uint8)
        else:  # a memory cgroup of 200 MiB: the kernel's OOM killer ends the process
            with open(os.path.join(sys.argv[2], "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
            hog = []
            while True:
                hog.append(bytearray(16 << 20))
    model(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
print("finished", flush=True)
dist.destroy_process_group()
"""


def test_an_allocation_refused_under_a_memory_limit_is_classified_as_oom(run_job: RunJob) -> None:
    job = run_job(OOM, "rlimit", flags=("--max-restarts", "1"))
    assert job.returncode == 0, job.stderr[-3000:]
    (decision,) = of_type(events(job), "recovery.decided")
    assert (decision["failure_class"], decision["rule"], decision["action"]) == ("oom", "allocation-refused",
                                                                                 "restart")
    assert "DefaultCPUAllocator: can't allocate memory" in decision["evidence"]
    assert "finished" in job.stdout
    assert "last failure: oom (allocation-refused): [rank0]: RuntimeError: [enforce fail" in status(job)


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A v1 memory cgroup of its own (skips the test where none can be made); removed afterwards."""
    root = Path("/sys/fs/cgroup/memory")
    path = root / f"stead-e2e-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here ({exc.strerror}): the kernel OOM killer cannot be "
                    "provoked safely")
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit))
        swap = path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.rmdir()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK) or not Path("/sys/fs/cgroup/memory").is_dir(),
                    reason="needs a readable kernel log and cgroup v1's memory controller")
def test_a_worker_the_kernel_oom_killer_ended_is_classified_as_oom_from_the_kernel_s_record(
        run_job: RunJob) -> None:
    with memory_cgroup(200 << 20) as cgroup:
        job = run_job(OOM, "cgroup", str(cgroup), flags=("--max-restarts", "1"))
    assert job.returncode == 0, job.stderr[-3000:]
    failure, = of_type(events(job), "worker.failed")
    assert failure["signal"] == 9
    (decision,) = of_type(events(job), "recovery.decided")
    assert (decision["failure_class"], decision["rule"]) == ("oom", "kernel-oom-kill")
    assert f"Killed process {failure['oom'].split('Killed process ')[1].split()[0]}" in decision["evidence"]
    assert decision["evidence"].startswith("kernel: ")


#: node 1's ranks spend 0.25 s more per step of their own; DDP makes every rank wait for them
SLOW = """
import os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
slow = os.environ["GROUP_RANK"] == "1"
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(40):
    time.sleep(0.3 if slow else 0.02)
    loss = model(torch.ones(4, 8)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
dist.destroy_process_group()
"""


@pytest.mark.long(20)
def test_a_slowed_node_is_reported_as_a_straggler_with_its_figures(run_job: RunJob) -> None:
    job = run_job(SLOW, flags=("--nnodes", "2", "--nproc-per-node", "1", "--set", "diagnosis.straggler_window_s=2",
                               "--set", "heartbeat_interval_s=0.3"))
    assert job.returncode == 0, job.stderr[-3000:]
    (straggler,) = of_type(events(job), "diagnosis.straggler")
    assert straggler["node_id"] == "node-1" and straggler["action"] == "report"
    assert straggler["compute_s"] > 0.25 and straggler["median_s"] < 0.15 and straggler["ratio"] > 1.5, straggler
    shown = status(job)
    assert "diagnosis (at " in shown and "hang threshold " in shown
    assert "straggler node-1: 0.3" in shown, shown


#: rank 1 leaves the loop early with exit 0; rank 0's next all-reduce finds its peer gone
EARLY_EXIT = """
import os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
for step in range(6):
    if step == 3 and os.environ["RANK"] == "1":
        sys.exit(0)
    t = torch.ones(4)
    dist.all_reduce(t)
"""


def test_a_rank_that_exits_0_early_is_blamed_not_the_peer_whose_collective_broke(run_job: RunJob) -> None:
    job = run_job(EARLY_EXIT, flags=("--nproc-per-node", "2", "--max-restarts", "1"))
    assert job.returncode == 1, job.stderr[-3000:]
    (decision,) = of_type(events(job), "recovery.decided")
    assert (decision["failure_class"], decision["rule"], decision["action"]) == ("user_error", "early-exit", "fail")
    assert decision["rank"] == 1
    assert "rank 1 (on node-0) exited 0 while rank 0 was still in a collective" in decision["evidence"]


#: a worker decorated with torch's @record: its exception goes to TORCHELASTIC_ERROR_FILE; its stderr is sent
#: nowhere first, so only the error file can say what ended it
RECORDED = """
import os, sys
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    print("error file:", os.environ["TORCHELASTIC_ERROR_FILE"], flush=True)
    dist.init_process_group("gloo")
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    raise ValueError("warmup_steps=-3 must not be negative")

main()
"""


def test_a_worker_using_torchs_record_gets_an_error_file_and_its_error_is_the_failures(run_job: RunJob) -> None:
    job = run_job(RECORDED, flags=("--max-restarts", "0"))
    assert job.returncode != 0
    path = job.stdout.split("error file:", 1)[1].split()[0]
    assert path.endswith(".json"), job.stdout  # torchrun gives each worker a path; an empty one writes nothing
    (failure,) = of_type(events(job), "worker.failed")
    assert "written by torch's @record" in failure["error_tail"]
    assert "ValueError: warmup_steps=-3 must not be negative" in failure["error_tail"]
    assert 'in main\n    raise ValueError("warmup_steps=-3' in failure["error_tail"]  # the traceback, not a line
    assert "ValueError: warmup_steps=-3 must not be negative" in job.stderr  # the job's final error says it


#: a bug that no restart fixes: the same error at the same step of every attempt
REPEATS = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    if step == 5:
        raise ValueError("warmup_steps=-3 must not be negative")
    model(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
"""


def test_a_failure_that_repeats_ends_the_job_on_its_second_occurrence_not_its_last_restart(run_job: RunJob) -> None:
    job = run_job(REPEATS, flags=("--max-restarts", "3", "--nproc-per-node", "2"))
    assert job.returncode != 0
    first, second = of_type(events(job), "recovery.decided")
    assert (first["action"], first["failure_class"]) == ("restart", "transient")
    assert (second["action"], second["failure_class"], second["rule"]) == ("fail", "user_error", "repeated-failure")
    assert "round 1 (rank" in second["evidence"] and "round 2 (rank" in second["evidence"]
    assert "ValueError: warmup_steps=-3 must not be negative" in second["evidence"]
