"""The training script bench/scale.py runs under `stead run` and under torchrun: DDP on gloo, until told to stop.

Rank 0 appends ``time world step`` to ``--steplog`` after every step; every rank stops once the file ``--stop``
exists (they agree through an all-reduce, so no rank is left in a collective). Under `stead run` it saves a
flash checkpoint every step and restores it in each new round (a resize continues from the last step); under
torchrun a new round starts over, which only makes its restart cheaper.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steplog", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--phases", default="", help="append each rank's start-up phase times to this file")
    args = parser.parse_args()
    marks = [("started", time.time())]
    dist.init_process_group("gloo")
    marks.append(("process_group", time.time()))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = None
    if os.environ.get("STEAD_JOB"):
        from stead.ckpt import FlashCheckpointer

        ckpt = FlashCheckpointer()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    marks.append(("model", time.time()))
    restored = ckpt.load({"model": model.state_dict()}) if ckpt is not None else None
    if restored is not None:
        step = restored[0]
    marks.append(("restored", time.time()))
    if args.phases:
        with open(args.phases, "a") as phases:
            phases.write(f"{os.environ.get('STEAD_ROUND', os.environ.get('TORCHELASTIC_RESTART_COUNT', '?'))} {rank} "
                         + " ".join(f"{name}={when:.3f}" for name, when in marks) + "\n")
    log = open(args.steplog, "a") if rank == 0 else None  # noqa: SIM115
    while True:
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_time)
        step += 1
        if ckpt is not None:
            ckpt.save(step, {"model": model.state_dict()})
        if log is not None:
            log.write(f"{time.time():.6f} {world} {step}\n")
            log.flush()
        stop = torch.tensor([int(os.path.exists(args.stop))])
        dist.all_reduce(stop)
        if stop.item():
            break
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
