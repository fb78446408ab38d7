"""The training script of bench/gpu.py's job: one worker, a small model on CUDA (CPU without a GPU), flash checkpoints.

    stead run --standalone --nproc-per-node 1 --max-restarts 1 bench/_gpu_train.py --out DIR --crash-at-step K \
        --step-s 0.4

Each ``--save-every`` steps it saves model and optimizer (momentum) with a FlashCheckpointer and writes
``DIR/hash-STEP`` = the SHA-256 of every saved tensor's bytes, read back from the device after the save. At
the start of step ``--crash-at-step`` of its first incarnation (TORCHELASTIC_RESTART_COUNT == 0) it exits
abruptly (``os._exit``), once; the restarted worker restores from the agent's shared memory into the
model's own (CUDA) tensors and writes ``DIR/restored`` = ``step device hash same`` (``same``: 1 when the
restored tensors' hash is the one saved at that step). ``DIR/steps`` gets ``restart step time`` per step
and ``0 crash time`` at the crash (wall-clock seconds), which bench/gpu.py times recovery by.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stead import report_step
from stead.ckpt import FlashCheckpointer


def state_hash(state: dict[str, Any]) -> str:
    """SHA-256 of every tensor's bytes in the state dict (nested), in a fixed order, read back to the host."""
    digest = hashlib.sha256()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key in sorted(node, key=str):
                walk(node[key], f"{path}/{key}")
        elif isinstance(node, torch.Tensor):
            digest.update(path.encode())
            digest.update(node.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(node, list | tuple):
            for index, item in enumerate(node):
                walk(item, f"{path}/{index}")
        else:
            digest.update(f"{path}={node!r}".encode())

    walk(state, "")
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--crash-at-step", type=int, default=42)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--step-s", type=float, default=0.0,
                        help="seconds a step takes at least (a real step's pace: the crash comes once the agent's "
                             "standby zygote is ready, as in a job that has run a while)")
    args = parser.parse_args()
    out = Path(args.out)
    # gloo: a world of one needs no NCCL peer, and the CPU fallback runs the same code
    dist.init_process_group("gloo")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    ckpt = FlashCheckpointer()
    torch.manual_seed(0)
    width = args.width
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # one step first, so that the optimizer's momentum buffers exist (the template restores into them)
    model(torch.zeros(1, width, device=device)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    ckpt.reserve(3 * sum(p.numel() * p.element_size() for p in model.parameters()))
    first = 0
    restored = ckpt.load({"model": model.state_dict(), "optim": optimizer.state_dict()})
    if restored is not None:
        step, saved = restored
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        now = state_hash({"model": model.state_dict(), "optim": optimizer.state_dict()})
        expected = (out / f"hash-{step}").read_text().strip()
        on = next(iter(model.parameters())).device
        (out / "restored").write_text(f"{step} {on} {now} {int(now == expected)}\n")
        first = step + 1
    log = open(out / "steps", "a")  # noqa: SIM115
    for step in range(first, args.steps):
        began = time.monotonic()
        if step == args.crash_at_step and restart == 0:
            log.write(f"{restart} crash {time.time():.6f}\n")
            log.flush()
            os._exit(17)
        batch = torch.randn(64, width, generator=torch.Generator().manual_seed(step)).to(device)
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % args.save_every == 0:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            if ckpt.save(step, state):
                (out / f"hash-{step}").write_text(state_hash(state) + "\n")
        if device.type == "cuda":
            torch.cuda.synchronize()
        report_step(step)
        log.write(f"{restart} {step} {time.time():.6f}\n")
        log.flush()
        time.sleep(max(0.0, args.step_s - (time.monotonic() - began)))  # after the step's time is written
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
