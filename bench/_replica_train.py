"""bench/replicas.py's training script: FSDP2 over gloo, a flash checkpoint of the sharded state every step.

The model is a stack of square linear layers sized so that each rank's shard of the parameters and of Adam's two
moments is about ``--mib`` MiB (what one node keeps per step when it runs one worker). Every step appends
``rank restart step time`` to ``--timestamps`` (as examples/train.py does) and the seconds its ``save()`` took to
``--stalls``; the first line of ``--stalls`` per rank is ``floor <seconds>``: the median time of one memcpy of the
same bytes in this process, the floor a save is measured against. ``--persist-every N``: every Nth step is also
written to disk (by the agent, in the background).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from stead.ckpt import FlashCheckpointer

WIDTH = 1024


def _memcpy_floor(nbytes: int) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _local_bytes(tree: object) -> int:
    """The bytes of this rank's part of every tensor in ``tree`` (a DTensor's local shard)."""
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return int(local.numel() * local.element_size())
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--timestamps", required=True)
    parser.add_argument("--stalls", required=True)
    parser.add_argument("--persist-every", type=int, default=0, help="also write every Nth step to disk (0: never)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = FlashCheckpointer()
    # per rank: (params + 2 Adam moments) x 4 bytes x (params / world) = mib MiB
    params = args.mib * (1 << 20) * world // 12
    layers = max(1, params // (WIDTH * WIDTH))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():  # Adam's moments exist before the first step, so a restore has them to fill
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    nbytes = _local_bytes({"model": model_sd, "optim": optim_sd})
    ckpt.reserve(nbytes + (4 << 20))
    first = 0
    restored = ckpt.load({"model": model_sd, "optim": optim_sd})
    if restored is not None:
        step, state = restored
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = step + 1
    stamps = open(args.timestamps, "a")  # noqa: SIM115
    stalls = open(args.stalls, "a")  # noqa: SIM115
    if restart == 0 and restored is None:
        stalls.write(f"{rank} floor {_memcpy_floor(nbytes):.6f}\n")
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
    for step in range(first, args.steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        began = time.perf_counter()
        persist = args.persist_every > 0 and (step + 1) % args.persist_every == 0
        ckpt.save(step, {"model": model_sd, "optim": optim_sd}, persist=persist)
        stalls.write(f"{rank} save {time.perf_counter() - began:.6f}\n")
        stalls.flush()
        stamps.write(f"{rank} {restart} {step} {time.time():.6f}\n")
        stamps.flush()
    ckpt.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # fully_shard keeps the group alive past destroy_process_group(): no interpreter shutdown


if __name__ == "__main__":
    main()
