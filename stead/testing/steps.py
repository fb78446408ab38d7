"""What a training script under test writes and a test reads back: one line per step, and a free port.

A script appends ``f"{time.time()} {step}"`` to a file for each step it finishes
(rank 0 only); :func:`read_steps` reads that back as ``(time, step)`` pairs, so
a test or a benchmark can say which steps ran, when, and whether one was lost or
run twice.
"""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = ["TRAIN_LOGGING_STEPS", "free_port", "read_steps"]

#: a training script (gloo, one all-reduce and ~0.05 s per step; ``argv[1]`` steps) whose rank 0 logs each step
#: to ``steps.log`` in its working directory
TRAIN_LOGGING_STEPS = """\
import os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
for step in range(int(sys.argv[1])):
    t = torch.ones(1024)
    dist.all_reduce(t)
    time.sleep(0.05)
    if os.environ["RANK"] == "0":
        with open("steps.log", "a") as f:
            f.write(f"{time.time()} {step}\\n")
dist.destroy_process_group()
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the OS handed it out and it was released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_steps(path: Path) -> list[tuple[float, int]]:
    """``(time, step)`` for each line of a step log; none before the file exists."""
    if not path.exists():
        return []
    return [(float(t), int(s)) for t, s in (line.split() for line in path.read_text().splitlines() if line.strip())]
