"""Shared pieces of the e2e jobs: fault injection in training scripts, and the surviving history.

The surviving training history is that of a job whose rounds restored checkpoints (for exactly-once checks).

Each round's ranks log ``{"restored_step", "restored_round", "world"}`` then one
``[step, epoch, ids]`` line per step to ``logs/<round>-<rank>.jsonl``. The surviving
history is the final round's steps plus, back along the chain of checkpoints each
round restored, the steps up to that checkpoint of the round that wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["FAULT_FUNCTION", "surviving_history"]

#: source of ``fault(kind)`` for a training script: "crash" exits 17, anything else SIGKILLs this node's agent
FAULT_FUNCTION = """
def fault(kind):
    if kind == "crash":
        os._exit(17)
    pid = os.getpid()  # kill this node's agent: the node is lost, its shared memory with it
    while pid > 1:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        if b"stead agent" in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" "):
            os.kill(pid, 9)
            time.sleep(60)
"""


def surviving_history(logs: Path) -> tuple[list[tuple[int, int, int, list[int]]], list[int]]:
    """The (rank, step, epoch, ids) of the final training history, and the world size of each round."""
    rounds: dict[int, dict[str, Any]] = {}
    for path in sorted(logs.glob("*.jsonl")):
        round_, rank = (int(x) for x in path.stem.split("-"))
        header, *lines = path.read_text().splitlines()
        info = rounds.setdefault(round_, {**json.loads(header), "steps": []})
        info["steps"] += [(rank, *json.loads(line)) for line in lines]
    history: list[tuple[int, int, int, list[int]]] = []
    round_, upto = max(rounds), None
    while round_ is not None:
        info = rounds[round_]
        history += [(r, s, e, ids) for r, s, e, ids in info["steps"] if upto is None or s <= upto]
        round_, upto = info["restored_round"], info["restored_step"]
    return history, [rounds[r]["world"] for r in sorted(rounds)]
