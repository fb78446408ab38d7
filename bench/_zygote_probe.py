"""How fast a worker that imports torch prints its first line: forked by the zygote vs spawned.

Two figures per path, each the median of a few runs:

- start: ``WorkerGroup.start()`` to the worker's first line (after ``import torch``);
- restart: a 2-worker round where rank 0 crashes (SIGKILL) to the first line of both
  workers of the next round (exit report, stop of the survivor, new start).

Times are compared on the system-wide ``time.monotonic()`` clock, which the worker
writes as its first line. ``--quick`` runs fewer repetitions. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import structlog

from stead.core.agent.workers import WorkerGroup, WorkerSpec
from stead.core.agent.zygote import Zygote

WORKER = """
import sys, time
import torch
print(repr(time.monotonic()), flush=True)
if sys.argv[1] == "stay":
    time.sleep(600)
"""

#: how often the probe looks at the first-line files (the measurement's resolution)
POLL_S = 0.001


async def first_lines(paths: list[Path]) -> list[float]:
    values: list[float] = []
    for path in paths:
        while True:
            text = path.read_text() if path.exists() else ""
            if text.endswith("\n"):
                values.append(float(text.split()[0]))
                break
            await anyio.sleep(POLL_S)
    return values


def specs(workdir: Path, ranks: int, mode: str, tag: str) -> tuple[list[WorkerSpec], list[Path]]:
    outs = [workdir / f"{tag}-{rank}.out" for rank in range(ranks)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    made = [WorkerSpec(argv=(sys.executable, "-u", str(workdir / "worker.py"), mode), env=env, cwd=workdir,
                       local_rank=rank, stdout_path=outs[rank]) for rank in range(ranks)]
    return made, outs


async def measure_start(group: WorkerGroup, workdir: Path, tag: str) -> float:
    made, outs = specs(workdir, 1, "exit", tag)
    began = time.monotonic()
    await group.start(made)
    (line,) = await first_lines(outs)
    async for _ in group.exits():
        pass
    return line - began


async def measure_restart(group: WorkerGroup, workdir: Path, tag: str) -> float:
    made, outs = specs(workdir, 2, "stay", tag + "-a")
    await group.start(made)
    await first_lines(outs)
    exits = group.exits()
    crashed = time.monotonic()
    os.kill(group.pids[0], signal.SIGKILL)
    await exits.__anext__()  # the crash, reported
    await group.stop()
    made, outs = specs(workdir, 2, "stay", tag + "-b")
    await group.start(made)
    lines = await first_lines(outs)
    await group.stop()
    return max(lines) - crashed


async def probe(repeats: int) -> dict[str, float]:
    figures: dict[str, list[float]] = {"zygote_s": [], "spawn_s": [], "restart_zygote_s": [], "restart_spawn_s": []}
    with tempfile.TemporaryDirectory(prefix="stead-zygote-probe-") as tmp:
        workdir = Path(tmp)
        (workdir / "worker.py").write_text(WORKER)
        async with Zygote(preload=("torch",)) as zygote:
            if not await zygote.wait_ready():
                raise SystemExit("the zygote did not start; see the log above")
            for i in range(repeats):
                async with WorkerGroup(zygote=zygote) as group:
                    figures["zygote_s"].append(await measure_start(group, workdir, f"z{i}"))
                    figures["restart_zygote_s"].append(await measure_restart(group, workdir, f"zr{i}"))
                async with WorkerGroup() as group:
                    figures["spawn_s"].append(await measure_start(group, workdir, f"s{i}"))
                    figures["restart_spawn_s"].append(await measure_restart(group, workdir, f"sr{i}"))
    return {name: statistics.median(values) for name, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (well under a minute)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    repeats = args.repeats or (2 if args.quick else 5)
    result = anyio.run(probe, repeats)
    print(f"{'path':<10} {'start -> first line':>22} {'crash -> next round first line':>32}")
    print(f"{'zygote':<10} {result['zygote_s']:>20.3f} s {result['restart_zygote_s']:>30.3f} s")
    print(f"{'spawn':<10} {result['spawn_s']:>20.3f} s {result['restart_spawn_s']:>30.3f} s")
    ratio = result["spawn_s"] / result["zygote_s"] if result["zygote_s"] > 0 else float("inf")
    print(json.dumps({"bench": "zygote_probe", **{k: round(v, 4) for k, v in result.items()},
                      "ratio": round(ratio, 1), "repeats": repeats}))


if __name__ == "__main__":
    main()
