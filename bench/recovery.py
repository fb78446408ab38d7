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
import signal
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
#: a whole run takes 10-20 s; this only ends a hung one
RUN_TIMEOUT_S = 300
#: tries per measurement before giving up
ATTEMPTS = 3


def _recovery_s(timestamps: Path, nproc: int) -> float:
    crash = None
    firsts: dict[int, float] = {}
    for line in timestamps.read_text().splitlines():
        rank, restart, step, when = line.split()
        if step == "crash":
            crash = float(when)
        elif int(restart) >= 1:  # the first step the new incarnation finished, whatever its number
            firsts.setdefault(int(rank), float(when))
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
    proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every worker it left
        proc.communicate()
        raise RuntimeError(f"{launcher} did not finish within {RUN_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} failed ({proc.returncode}):\n{err[-3000:]}")
    return _recovery_s(stamps, nproc)


def _measure(launcher: str, workdir: Path, nproc: int, failures: dict[str, int]) -> float:
    """One successful run's recovery time; a failed run is retried (torchrun's restart is flaky here)."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _run(launcher, workdir, nproc)
        except RuntimeError as exc:
            failures[launcher] += 1
            lines = [ln.strip() for ln in str(exc).splitlines() if "rror" in ln] or [repr(exc)]
            last = lines[-1][:200]
            print(f"{launcher:<9} run failed (attempt {attempt} of {ATTEMPTS}): {last}", flush=True)
    raise SystemExit(f"{launcher} failed {ATTEMPTS} times in a row; see the errors above")


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
        failures = dict.fromkeys(results, 0)
        for _ in range(runs):
            for launcher in results:
                results[launcher].append(_measure(launcher, workdir, args.nproc, failures))
                print(f"{launcher:<9} crash -> first step {results[launcher][-1]:7.3f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    stead_s, torchrun_s = statistics.median(results["stead"]), statistics.median(results["torchrun"])
    print(f"median over {runs} run(s), {args.nproc} workers: stead {stead_s:.3f} s, torchrun {torchrun_s:.3f} s, "
          f"stead is {torchrun_s / stead_s:.1f}x faster")
    print(json.dumps({"bench": "recovery", "stead_s": round(stead_s, 3), "torchrun_s": round(torchrun_s, 3),
                      "ratio": round(torchrun_s / stead_s, 1), "runs": runs, "nproc": args.nproc,
                      "torchrun_failed_runs": failures["torchrun"], "stead_failed_runs": failures["stead"],
                      "goal_met": stead_s <= 0.5 and torchrun_s / stead_s >= 8}))


if __name__ == "__main__":
    main()
