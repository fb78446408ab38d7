"""A job stopped with SIGTERM resumes, under the same name, from the step its agents held in memory.

The script saves a flash checkpoint at every step, in memory only (never
``persist=True``): what the relaunched job finds on disk can only have been
written by the agents when the job was stopped (``ckpt.persist_on_stop``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

STEPS = 250

TRAIN = """
import json, os, sys, time
import torch, torch.distributed as dist
from stead.ckpt import Checkpoint

STEPS = int(sys.argv[1])
dist.init_process_group("gloo")
rank, round_ = dist.get_rank(), int(os.environ["STEAD_ROUND"])
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
ckpt = Checkpoint(model=model, optimizer=opt)
restored = ckpt.restore()
step = 0 if restored is None else restored + 1
with open(f"round-{round_}-{rank}.jsonl", "a") as log:
    log.write(json.dumps({"restored": restored}) + "\\n")
    while step < STEPS:
        loss = model(torch.ones(8, 4)).sum()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        ckpt.save(step)  # memory only
        log.write(json.dumps({"saved": step}) + "\\n")
        log.flush()
        step += 1
        time.sleep(0.02)
ckpt.wait_persisted()
dist.destroy_process_group()
"""


def _run(tmp_path: Path, *flags: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "stead", "run", "--job-name", "resumable", "--nproc-per-node", "2",
               "--log-format", "json", *flags, "train.py", str(STEPS)]
    return subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rounds(tmp_path: Path) -> list[int]:
    """The rounds whose rank 0 has started, in order."""
    return sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("round-*-0.jsonl"))


def _saved(tmp_path: Path, round_: int) -> list[int]:
    path = tmp_path / f"round-{round_}-0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["saved"] for line in lines if "saved" in line]


@pytest.mark.extended("a SIGTERM persisting the newest step and the job resuming under its name: "
                      "tests/e2e/test_slurm.py's README test (scancel's SIGTERM, the script submitted again)")
def test_sigterm_persists_the_step_in_memory_and_a_relaunch_under_the_same_name_resumes_from_it(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    first = _run(tmp_path)
    try:
        # (on a loaded machine a node may be lost and the job restarted before the stop: the newest round counts)
        while not (rounds := _rounds(tmp_path)) or len(_saved(tmp_path, rounds[-1])) < 20:
            assert first.poll() is None, first.communicate()[1][-4000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 130, err[-4000:]
    first_rounds = _rounds(tmp_path)
    last_saved = _saved(tmp_path, first_rounds[-1])[-1]
    assert (tmp_path / ".stead" / "checkpoints" / "resumable").is_dir(), err[-3000:]

    other = subprocess.run([sys.executable, "-m", "stead", "run", "--job-name", "resumable", "--nproc-per-node", "1",
                            "train.py", str(STEPS)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert other.returncode == 2
    assert "ran before (stopped) with other --nproc-per-node" in other.stderr
    assert "add --force to resume it with the new ones" in other.stderr

    second = _run(tmp_path)
    _, err = second.communicate(timeout=240)
    assert second.returncode == 0, err[-4000:]
    assert "resuming job resumable (stopped before" in err
    rounds = _rounds(tmp_path)
    # the rounds are numbered on: the resumed job's one round follows the stopped job's
    assert rounds[0] == 1 and rounds[:-1] == first_rounds and rounds[-1] == first_rounds[-1] + 1
    header = json.loads((tmp_path / f"round-{rounds[-1]}-0.jsonl").read_text().splitlines()[0])
    # the step held in memory at the stop: committed once every rank had it (rank 0 may be one step ahead, or
    # have saved one more step and been stopped before its log line)
    assert header["restored"] is not None and last_saved - 1 <= header["restored"] <= last_saved + 1, \
        (header, last_saved)
    assert _saved(tmp_path, rounds[-1])[0] == header["restored"] + 1 and _saved(tmp_path, rounds[-1])[-1] == STEPS - 1
    events = subprocess.run([sys.executable, "-m", "stead", "events", "--job", "resumable"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert "job.stopped" in events.stdout and "job.resumed" in events.stdout and "job.succeeded" in events.stdout
