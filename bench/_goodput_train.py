"""The training script of bench/goodput.py: a small DDP model on gloo, ~``--step-time`` s per step.

Written like any torchrun script; the same file runs under ``torchrun`` and ``stead run``:

    torchrun --nproc-per-node 4 bench/_goodput_train.py --ckpt torch --ckpt-dir D --seconds 120 ...
    stead run --nnodes 2 --nproc-per-node 2 bench/_goodput_train.py --ckpt flash --seconds 120 ...

- ``--ckpt flash``: a stead.ckpt.FlashCheckpointer save every ``--save-every`` steps (shared memory
  through the node's agent), restored on start; every ``--persist-every`` steps the save is also written
  to disk by the agents, in the background (a node's memory dies with the node); ``--ckpt torch``:
  rank 0 writes model and optimizer with ``torch.save`` every ``--save-every`` steps (a temporary file,
  then ``os.replace``) and every rank loads it on start; ``--ckpt none``: a restarted worker starts over
  from step 0.
- Each step's batch depends only on (step, rank): a resumed run computes what an uninterrupted one does.
- ``--steplog FILE``: one line per step per rank, ``rank restart step start end attempt`` (wall-clock
  seconds; restart is TORCHELASTIC_RESTART_COUNT; attempt is stead's round, STEAD_ROUND, where there is
  one, else the restart count: stead keeps the restart count when it relaunches a lost node, so only the
  round tells the attempts apart), appended with one write each. A step is the loop's whole iteration,
  its checkpoint save included (what a step costs, as stead's ledger counts it too).
- ``--pid-dir DIR``: every worker writes ``DIR/RANK`` = ``pid attempt`` on start (how the bench finds the
  worker to kill or stop).
- ``--seconds S``: the job ends after the step during which S seconds passed since the job's first step
  (rank 0 keeps that time in ``--t0-file``, so a restarted worker knows it); all ranks stop at the same step
  (rank 0 decides, an all-reduce tells the others). ``--steps`` caps the step count.

The script never fails on its own: faults are injected from outside, by bench/goodput.py.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", choices=("flash", "torch", "none"), default="flash")
    parser.add_argument("--ckpt-dir", default="", help="where --ckpt torch keeps its file")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--persist-every", type=int, default=0, help="flash: also persist every N steps (0: never)")
    parser.add_argument("--step-time", type=float, default=1.0, help="seconds of sleep inside each step")
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long since the first step")
    parser.add_argument("--steps", type=int, default=1_000_000, help="stop after this many steps")
    parser.add_argument("--t0-file", default="", help="keeps the job's first step's time (with --seconds)")
    parser.add_argument("--steplog", default="", help="append 'rank restart step start end' lines to this file")
    parser.add_argument("--pid-dir", default="", help="write RANK files with 'pid attempt' here")
    args = parser.parse_args()
    if args.seconds and not args.t0_file:
        parser.error("--seconds needs --t0-file")
    if args.ckpt == "torch" and not args.ckpt_dir:
        parser.error("--ckpt torch needs --ckpt-dir")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempt = int(os.environ.get("STEAD_ROUND", restart))
    if args.pid_dir:
        _write_atomic(Path(args.pid_dir) / str(rank), f"{os.getpid()} {attempt}\n".encode())
    flash = FlashCheckpointer() if args.ckpt == "flash" and FlashCheckpointer is not None else None
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    first = 0
    if flash is not None:
        flash.reserve(2 * sum(p.numel() * p.element_size() for p in model.parameters()))  # weights + momentum
        restored = flash.load({"model": model.state_dict(), "optim": optimizer.state_dict()})
        if restored is not None:
            step, saved = restored
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optim"])
            first = step + 1
    elif args.ckpt == "torch":
        path = Path(args.ckpt_dir) / "ckpt.pt"
        if path.exists():
            saved = torch.load(path)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optim"])
            first = int(saved["step"]) + 1
    if rank == 0 and first:
        print(f"rank 0 (restart {restart}) resumed at step {first}", flush=True)

    t0_path = Path(args.t0_file) if args.t0_file else None
    t0 = float(t0_path.read_text()) if t0_path is not None and t0_path.exists() else None
    log_fd = os.open(args.steplog, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if args.steplog else None
    done = torch.zeros(1)
    step = first
    for step in range(first, args.steps):
        start = time.time()
        if rank == 0 and t0 is None and t0_path is not None:
            t0 = start
            _write_atomic(t0_path, f"{t0:.6f}\n".encode())
        batch = torch.randn(32, 64, generator=torch.Generator().manual_seed(1_000_003 * step + rank))
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # DDP's all-reduce of the gradients: the ranks step together
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        if (step + 1) % args.save_every == 0:
            state: dict[str, Any] = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            if flash is not None:
                flash.save(step, state, persist=args.persist_every > 0 and (step + 1) % args.persist_every == 0)
            elif args.ckpt == "torch" and rank == 0:
                _write_torch(Path(args.ckpt_dir) / "ckpt.pt", {"step": step, **state})
        stop = False
        if args.seconds:
            done.fill_(1.0 if rank == 0 and t0 is not None and time.time() - t0 >= args.seconds else 0.0)
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            stop = bool(done.item())
        end = time.time()  # the whole iteration is the step: its checkpoint save included
        report_step(step)
        if log_fd is not None:
            os.write(log_fd, f"{rank} {restart} {step} {start:.6f} {end:.6f} {attempt}\n".encode())
        if stop:
            break
    if log_fd is not None:
        os.close(log_fd)
    if flash is not None:
        flash.close()
    if rank == 0:
        print(f"rank 0 done at step {step}: world {world}, restart {restart}", flush=True)
    dist.destroy_process_group()


def _write_torch(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
