"""A small DDP training script written for torchrun; it runs unchanged under `stead run`.

    torchrun --nproc-per-node 2 examples/train.py --steps 50
    stead run --nproc-per-node 2 examples/train.py --steps 50

With ``--save-every N`` it saves a flash checkpoint every N steps and, on start,
resumes from the newest one: under `stead run` a restarted worker continues from
the step it last saved, restored from the agent's shared memory (`make demo` runs
it so). Under plain torchrun (no stead agent) FlashCheckpointer is disk-only:
nothing is kept unless ``--persist-every N`` writes every Nth step to disk.
Without stead installed the script trains without checkpoints. By default (no
``--save-every``) it checkpoints nothing and a restarted worker starts over from
step 0, which is what bench/recovery.py times.

``--crash-at-step K`` makes rank ``--crash-rank`` exit abruptly at the start of step K
on its first incarnation only (TORCHELASTIC_RESTART_COUNT == 0): an injected fault.
Each step's batch depends only on the step and the rank, so a resumed run computes
exactly what an uninterrupted one does.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    from stead import report_step
    from stead.ckpt import FlashCheckpointer
except ImportError:  # plain torchrun without stead installed

    def report_step(step: int) -> None:
        return None

    FlashCheckpointer = None  # type: ignore[assignment,misc]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--step-time", type=float, default=0.02, help="seconds of extra work per step")
    parser.add_argument("--timestamps", default="", help="append 'rank restart step time' lines to this file")
    parser.add_argument("--save-every", type=int, default=0, help="flash-checkpoint every N steps (0: never)")
    parser.add_argument("--persist-every", type=int, default=0, help="also write every Nth step to disk (0: never)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # created early: a restarted worker's shared memory is mapped while the model is built
    ckpt = FlashCheckpointer() if FlashCheckpointer is not None and args.save_every else None
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state: dict[str, Any] = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    if ckpt is not None:
        ckpt.reserve(2 * sum(p.numel() * p.element_size() for p in model.parameters()))  # weights + momentum
    first = 0
    restored = ckpt.load(state) if ckpt is not None else None
    if restored is not None:
        step, saved = restored
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        first = step + 1
        if rank == 0:
            print(f"rank 0 resumed from step {step}", flush=True)
    log = open(args.timestamps, "a") if args.timestamps else None  # noqa: SIM115
    loss = torch.zeros(())
    for step in range(first, args.steps):
        if step == args.crash_at_step and rank == args.crash_rank and restart == 0:
            if log:
                log.write(f"{rank} {restart} crash {time.time():.6f}\n")
                log.flush()
            os._exit(17)
        batch = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        if ckpt is not None and (step + 1) % args.save_every == 0:
            persist = args.persist_every > 0 and (step + 1) % args.persist_every == 0
            ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()}, persist=persist)
        report_step(step)
        if log:
            log.write(f"{rank} {restart} {step} {time.time():.6f}\n")
            log.flush()
    if ckpt is not None:
        ckpt.wait_persisted()
        ckpt.close()
    if rank == 0:
        print(f"rank 0 done: {args.steps} steps, world {world}, restart {restart}, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
