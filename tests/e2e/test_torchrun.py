"""The same script under plain torchrun: no stead master, a static per-rank share, checkpoints on disk.

Two gloo ranks read a dataset through ``ShardedSampler`` (rank 1 three times slower)
and save model, optimizer and sampler cursor with ``stead.ckpt.Checkpoint`` every few
steps (``persist=True``: on disk, as there is no agent). The test SIGKILLs the whole
torchrun mid-epoch and runs it again: the second run restores the newest checkpoint
and finishes. In the surviving history every id is read exactly once per epoch and
both ranks take as many steps in each epoch.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stead.testing.leaks import SHM_NAMESPACE_ENV
from tests.support.history import FAULT_FUNCTION, surviving_history

pytestmark = pytest.mark.e2e

N, EPOCHS, EVERY = 96, 2, 3

TRAIN = """
import json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from stead.ckpt import Checkpoint
from stead.data import ShardedSampler
{HELPERS}

N, EPOCHS, EVERY, RUN = (int(a) for a in sys.argv[1:5])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
ddp = DistributedDataParallel(torch.nn.Linear(1, 1))
opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
sampler = ShardedSampler("ids", size=N, shard_size=5, seed=3, epochs=EPOCHS, prefetch=2)
ckpt = Checkpoint(model=ddp, optimizer=opt, sampler=sampler, extra={"run": RUN})
restored = ckpt.restore()
step, restored_run = (0, None) if restored is None else (restored, ckpt.extra["run"])
log = open_history(RUN, rank, step, restored_run, world)
loader = DataLoader(list(range(N)), batch_size=4, sampler=sampler)
while sampler.epoch < EPOCHS:
    epoch = sampler.epoch
    for batch in loader:
        time.sleep(0.09 if rank == 1 else 0.03)
        ids = batch.tolist()
        loss = ddp(torch.tensor(ids, dtype=torch.float32).reshape(-1, 1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        record_step(log, step, epoch, ids)
        if step % EVERY == 0:
            ckpt.extra = {"run": RUN}
            ckpt.save(step, persist=True)
print(f"finished run={RUN} step={step}", flush=True)
dist.destroy_process_group()
""".replace("{HELPERS}", FAULT_FUNCTION)


def _torchrun(cwd: Path, run: int) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STEAD_", "TORCHELASTIC_")) or k == SHM_NAMESPACE_ENV}  # no stead in sight
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "train.py", str(N), str(EPOCHS), str(EVERY), str(run)]
    # (TMPDIR: torchrun's own log folder, torchelastic_*, which it never removes, goes with the test's folder)
    return subprocess.Popen(command, cwd=cwd, env={**env, "TMPDIR": str(cwd)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _last_step(log: Path) -> int:
    lines = log.read_text().splitlines() if log.exists() else []
    return json.loads(lines[-1])[0] if len(lines) > 1 else 0


@pytest.mark.long(24)
def test_under_torchrun_a_killed_and_relaunched_job_reads_every_id_once_with_ranks_in_lockstep(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    (tmp_path / "logs").mkdir()
    first = _torchrun(tmp_path, 1)
    try:
        while _last_step(tmp_path / "logs" / "1-0.jsonl") < 2 * EVERY + 2:  # mid-epoch 0, past a checkpoint
            assert first.poll() is None, first.communicate()[0][-4000:]
            time.sleep(0.05)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the whole torchrun: launcher and workers
        first.communicate(timeout=60)
    second = _torchrun(tmp_path, 2)
    out, _ = second.communicate(timeout=180)
    assert second.returncode == 0, out[-4000:]
    assert "finished run=2" in out
    history, worlds = surviving_history(tmp_path / "logs")
    header = json.loads((tmp_path / "logs" / "2-0.jsonl").read_text().splitlines()[0])
    assert header["restored_round"] == 1 and header["restored_step"] >= 2 * EVERY, header
    assert worlds == [2, 2]
    for epoch in range(EPOCHS):
        ids = collections.Counter(i for _, _, e, batch in history if e == epoch for i in batch)
        assert ids == collections.Counter(range(N)), f"epoch {epoch}: {sorted(ids.items())[:20]}"
        per_rank = collections.Counter(r for r, _, e, _ in history if e == epoch)
        assert set(per_rank.values()) == {N // 2 // 4}, per_rank
