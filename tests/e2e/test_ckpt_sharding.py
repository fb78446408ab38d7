"""The join of flash checkpoint and data sharding: the sampler's cursor is saved in each flash checkpoint.

A `stead run` job (2 nodes x 2 gloo workers, rank 1 three times slower than the others)
reads a dataset of ids through ``ShardedSampler`` in lockstep with a plain ``for batch
in loader`` DDP loop, and saves model, optimizer and sampler cursor with
``stead.ckpt.Checkpoint`` every few steps. Two workers crash (the restarted rounds resume
from the checkpoint in the agents' memory) and one agent is SIGKILLed (its node is
relaunched). In the surviving history every id is read exactly once per epoch and every rank
took as many steps as the others in each epoch.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stead.testing.history import FAULT_FUNCTION, surviving_history

RunJob = Callable[..., Any]  # the run_job fixture of conftest.py

pytestmark = pytest.mark.e2e

N, EPOCHS, EVERY = 192, 2, 3

TRAIN = """
import json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from stead.ckpt import Checkpoint
from stead.data import ShardedSampler
{FAULT}

N, EPOCHS, EVERY = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world, round_ = dist.get_rank(), dist.get_world_size(), int(os.environ["STEAD_ROUND"])
ddp = DistributedDataParallel(torch.nn.Linear(1, 1))
opt = torch.optim.SGD(ddp.parameters(), lr=1e-6, momentum=0.9)
sampler = ShardedSampler("ids", size=N, shard_size=6, seed=11, epochs=EPOCHS, prefetch=2)  # lockstep
ckpt = Checkpoint(model=ddp, optimizer=opt, sampler=sampler, extra={"round": round_})
restored = ckpt.restore()  # model, optimizer, sampler cursor: in memory after a crash
step, restored_round = (0, None) if restored is None else (restored, ckpt.extra["round"])
log = open_history(round_, rank, step, restored_round, world)
loader = DataLoader(list(range(N)), batch_size=4, sampler=sampler)



while sampler.epoch < EPOCHS:
    epoch = sampler.epoch
    for batch in loader:  # no "is every rank done" all-reduce: in lockstep every rank has as many batches
        time.sleep(0.03 if rank == 1 else 0.01)  # rank 1 loads its data 3x slower
        ids = batch.tolist()
        loss = ddp(torch.tensor(ids, dtype=torch.float32).reshape(-1, 1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        record_step(log, step, epoch, ids)
        fault_due(step, rank)
        if step % EVERY == 0:
            ckpt.extra = {"round": round_}
            ckpt.save(step, persist=True)  # every rank: the sampler's cursor is gathered into it
ckpt.wait_persisted()
if rank == 0:
    print(f"finished round={round_} world={world} step={step}", flush=True)
dist.destroy_process_group()
""".replace("{FAULT}", FAULT_FUNCTION)

FAULTS = [{"step": 5, "rank": 1, "kind": "crash"}, {"step": 11, "rank": 3, "kind": "kill-agent"},
          {"step": 17, "rank": 2, "kind": "crash"}]


def test_flash_checkpoints_carry_the_sampler_cursor_so_every_id_is_read_exactly_once(
        run_job: RunJob, tmp_path: Path) -> None:
    (tmp_path / "faults.json").write_text(json.dumps(FAULTS))
    (tmp_path / "logs").mkdir()
    job = run_job(TRAIN, str(N), str(EPOCHS), str(EVERY), job="joined",
                  flags=("--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "5"))
    assert job.returncode == 0, job.stderr[-4000:]
    assert all((tmp_path / f"fault-{i}").exists() for i in range(len(FAULTS)))
    history, worlds = surviving_history(tmp_path / "logs")
    assert set(worlds) == {4} and len(worlds) == 1 + len(FAULTS)
    steps = [(r, s) for r, s, _, _ in history]
    assert len(steps) == len(set(steps))
    for epoch in range(EPOCHS):
        ids = collections.Counter(i for _, _, e, batch in history if e == epoch for i in batch)
        assert ids == collections.Counter(range(N)), f"epoch {epoch}: {sorted(ids.items())[:20]}"
        per_rank = collections.Counter(r for r, _, e, _ in history if e == epoch)
        assert set(per_rank.values()) == {N // 4 // 4}, per_rank  # 48 ids each, in batches of 4
    for i, fault in enumerate(FAULTS):  # the round after a worker crash resumed from a checkpoint in memory
        header = json.loads((tmp_path / "logs" / f"{i + 2}-0.jsonl").read_text().splitlines()[0])
        assert fault["kind"] != "crash" or header["restored_step"] > 0, header
