"""Crash-to-first-step recovery time: stead run vs torchrun, measured in the same run.

One training script (examples/train.py: gloo, a small DDP model) crashes once on
rank 1 at a fixed step. It is run under ``torchrun --standalone --max-restarts=1``
and under ``stead run`` with the same flags. The script itself writes a wall-clock
timestamp when it crashes and after every step, so both launchers are timed the
same way: from the crash to the moment every rank of the new incarnation has
finished its first step.

Last line: one JSON object with the figures. ``--quick`` runs each launcher once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
BIN = Path(sys.executable).parent
#: late enough that the first incarnation is warm (stead's zygote has imported torch)
CRASH_STEP = 150
STEPS = 170


def _recovery_s(timestamps: Path, nproc: int) -> float:
    crash = None
    firsts: dict[int, float] = {}
    for line in timestamps.read_text().splitlines():
        rank, restart, step, when = line.split()
        if step == "crash":
            crash = float(when)
        elif int(restart) >= 1 and int(step) == 0:
            firsts[int(rank)] = float(when)
    if crash is None or len(firsts) < nproc:
        raise RuntimeError(f"incomplete timestamps in {timestamps}: crash={crash} first steps={firsts}")
    return max(firsts.values()) - crash


def _run(launcher: str, workdir: Path, nproc: int) -> float:
    stamps = workdir / f"{launcher}-{time.time_ns()}.txt"
    script_args = ["--steps", str(STEPS), "--crash-at-step", str(CRASH_STEP), "--step-time", "0.03",
                   "--timestamps", str(stamps)]
    if launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1",
                   "--monitor-interval", "0.1", str(TRAIN), *script_args]
    else:
        command = [sys.executable, "-m", "stead", "run", "--standalone", "--nproc-per-node", str(nproc),
                   "--max-restarts", "1", "--log-format", "json", str(TRAIN), *script_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return _recovery_s(stamps, nproc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per launcher")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    workdir = Path(tempfile.mkdtemp(prefix="stead-bench-recovery-"))
    try:
        results: dict[str, list[float]] = {"torchrun": [], "stead": []}
        for _ in range(runs):
            for launcher in results:
                results[launcher].append(_run(launcher, workdir, args.nproc))
                print(f"{launcher:<9} crash -> first step {results[launcher][-1]:7.3f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    stead_s, torchrun_s = statistics.median(results["stead"]), statistics.median(results["torchrun"])
    print(f"median over {runs} run(s), {args.nproc} workers: stead {stead_s:.3f} s, torchrun {torchrun_s:.3f} s, "
          f"stead is {torchrun_s / stead_s:.1f}x faster")
    print(json.dumps({"bench": "recovery", "stead_s": round(stead_s, 3), "torchrun_s": round(torchrun_s, 3),
                      "ratio": round(torchrun_s / stead_s, 1), "runs": runs, "nproc": args.nproc,
                      "goal_met": stead_s <= 0.5 and torchrun_s / stead_s >= 8}))


if __name__ == "__main__":
    main()
