"""A small DDP training script written for torchrun; it runs unchanged under `stead run`.

    torchrun --nproc-per-node 2 examples/train.py --steps 50
    stead run --nproc-per-node 2 examples/train.py --steps 50

``--crash-at-step K`` makes rank ``--crash-rank`` exit abruptly at step K on its
first incarnation only (TORCHELASTIC_RESTART_COUNT == 0): an injected fault.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    from stead import report_step
except ImportError:  # plain torchrun without stead installed

    def report_step(step: int) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--step-time", type=float, default=0.02, help="seconds of extra work per step")
    parser.add_argument("--timestamps", default="", help="append 'rank restart step time' lines to this file")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    log = open(args.timestamps, "a") if args.timestamps else None  # noqa: SIM115
    for step in range(args.steps):
        if step == args.crash_at_step and rank == args.crash_rank and restart == 0:
            if log:
                log.write(f"{rank} {restart} crash {time.time():.6f}\n")
                log.flush()
            os._exit(17)
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        report_step(step)
        if log:
            log.write(f"{rank} {restart} {step} {time.time():.6f}\n")
            log.flush()
    if rank == 0:
        print(f"rank 0 done: {args.steps} steps, world {world}, restart {restart}, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
