"""Resizing a running job: stead (stead scale, a lost node) against torchrun's elastic membership change.

One DDP script (bench/_scale_train.py, gloo, one step every ~50 ms, rank 0 logging each step's time and world
size) runs under both launchers, one after the other:

- **stead**: ``stead run --nnodes 1:4 --start-nodes 1``; then ``stead scale --nodes 2`` and ``--nodes 4``;
  then one node's agent is SIGKILLed (``--max-node-relaunches 0``: not replaced).
- **torchrun**: ``torchrun --nnodes 1:2`` with c10d rendezvous on a loopback port; a second torchrun (the
  second node) is started mid-run; then it is SIGKILLed.

For each change: ``pause_s``, the gap in training (the last step at the old world size to the first at the
new one), and ``available_s``, from the new node being there to the first step at the new size (stead: the
node's agent joined; torchrun: its process started, which is all a torchrun node is) or, for a loss, from the
kill to the first step at the smaller size. stead's nodes start while the job trains, so their start-up is no
pause; ``launch_s`` gives it (agent launched to first step at the new size) beside torchrun's.

Goal: a pause under 1 s per resize, and at least 8x less than torchrun's. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bench" / "_scale_train.py"
BIN = Path(sys.executable).parent
JOB = "scalebench"
#: how long a resize may take before the bench gives up on it
CHANGE_TIMEOUT_S = 120.0
#: how long torchrun's surviving node gets to train again after the other was lost (it may never: see the README)
TORCHRUN_LOST_TIMEOUT_S = 90.0
#: trained at each size before the next change, so that every node is warm
SETTLE_S = 3.0


def _steps(log: Path) -> list[tuple[float, int, int]]:
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            out.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return out


def _first_at(log: Path, world: int, since: float, proc: subprocess.Popen[str],
              timeout_s: float = CHANGE_TIMEOUT_S) -> float:
    """When the first step at ``world`` after ``since`` ended."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = [t for t, w, _ in _steps(log) if w == world and t >= since]
        if found:
            return found[0]
        if proc.poll() is not None:
            raise RuntimeError(f"the launcher exited ({proc.returncode}) before training at world size {world}")
        time.sleep(0.05)
    raise RuntimeError(f"no step at world size {world} within {timeout_s:g} s")


def _pause(log: Path, since: float, first_new: float) -> tuple[float, float]:
    """The longest gap between steps from ``since`` to the first step at the new size, and the time lost in all
    the gaps of that stretch (each gap beyond the usual step time; several when a change took more rounds)."""
    times = [t for t, _, _ in _steps(log)]
    stretch = [t for t in times if since <= t <= first_new]
    before = [t for t in times if t < since]
    if before:
        stretch.insert(0, before[-1])
    gaps = [b - a for a, b in itertools.pairwise(stretch)]
    usual = statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 2 else 0.0
    return max(gaps, default=float("nan")), sum(max(0.0, g - usual) for g in gaps)


def _events(workdir: Path) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "stead", "events", "--job", JOB, "--json"], cwd=workdir,
                         capture_output=True, text=True, timeout=60, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _finish(procs: list[subprocess.Popen[str]], stop: Path) -> None:
    stop.touch()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_stead(workdir: Path, nproc: int) -> dict[str, dict[str, float]]:
    log, stop = workdir / "stead-steps.txt", workdir / "stead-stop"
    command = [sys.executable, "-m", "stead", "run", "--job-name", JOB, "--nnodes", "1:4", "--start-nodes", "1",
               "--nproc-per-node", str(nproc), "--max-node-relaunches", "0", "--log-format", "json", str(TRAIN),
               "--steplog", str(log), "--stop", str(stop), "--phases", str(workdir / "stead-phases.txt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(workdir / "stead.err", "w") as err:
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                start_new_session=True)
    figures: dict[str, dict[str, float]] = {}
    try:
        _first_at(log, nproc, 0.0, proc)
        time.sleep(SETTLE_S)
        for old, new in ((1, 2), (2, 4)):
            asked = time.time()
            subprocess.run([sys.executable, "-m", "stead", "scale", "--job", JOB, "--nodes", str(new)], cwd=workdir,
                           check=True, capture_output=True, text=True, timeout=60)
            first = _first_at(log, new * nproc, asked, proc)
            events = [e for e in _events(workdir) if e["at"] >= asked]
            joined = max(e["at"] for e in events if e["type"] == "node.joined")
            launched = min(e["at"] for e in events if e["type"] == "node.started")
            pause, lost = _pause(log, asked, first)
            figures[f"up_{old}to{new}"] = {"pause_s": pause, "lost_s": lost, "available_s": first - joined,
                                           "launch_s": first - launched, "asked_s": first - asked,
                                           "rounds": len({e["data"]["round"] for e in events
                                                          if e["type"] == "round.started"})}
            print(f"stead    {old} -> {new} nodes: pause {pause:.3f} s (lost {lost:.3f} s), joined -> stepping "
                  f"{first - joined:.3f} s, launched -> stepping {first - launched:.3f} s", flush=True)
            time.sleep(SETTLE_S)
        started = [e for e in _events(workdir) if e["type"] == "node.started" and e["data"]["node_id"] == "node-3"]
        pid = int(started[-1]["data"]["pid"])
        killed = time.time()
        os.kill(pid, signal.SIGKILL)  # the node's agent: its workers die with it
        first = _first_at(log, 3 * nproc, killed, proc)
        pause, lost = _pause(log, killed, first)
        figures["lost_4to3"] = {"pause_s": pause, "lost_s": lost, "available_s": first - killed}
        print(f"stead    lost a node (4 -> 3): pause {figures['lost_4to3']['pause_s']:.3f} s, kill -> stepping "
              f"{first - killed:.3f} s", flush=True)
        time.sleep(1.0)
    finally:
        _finish([proc], stop)
    return figures


def run_torchrun(workdir: Path, nproc: int) -> dict[str, dict[str, float]]:
    log, stop = workdir / "torchrun-steps.txt", workdir / "torchrun-stop"
    port = _free_port()
    command = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "scalebench", "--max-restarts", "5",
               "--monitor-interval", "0.1", str(TRAIN), "--steplog", str(log), "--stop", str(stop)]
    # (torch 2.13's restarted workers never come up when they share the rendezvous store: see README)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs: list[subprocess.Popen[str]] = []

    def node(name: str) -> subprocess.Popen[str]:
        with open(workdir / f"torchrun-{name}.err", "w") as err:
            proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                    start_new_session=True)
        procs.append(proc)
        return proc

    figures: dict[str, dict[str, float]] = {}
    try:
        first_node = node("a")
        _first_at(log, nproc, 0.0, first_node)
        time.sleep(SETTLE_S)
        started = time.time()
        second = node("b")
        first = _first_at(log, 2 * nproc, started, first_node)
        pause, lost = _pause(log, started, first)
        figures["up_1to2"] = {"pause_s": pause, "lost_s": lost, "available_s": first - started,
                              "launch_s": first - started}
        print(f"torchrun 1 -> 2 nodes: pause {figures['up_1to2']['pause_s']:.3f} s, second node started -> "
              f"stepping {first - started:.3f} s", flush=True)
        time.sleep(SETTLE_S)
        killed = time.time()
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
        try:
            first = _first_at(log, nproc, killed, first_node, timeout_s=TORCHRUN_LOST_TIMEOUT_S)
        except RuntimeError as exc:  # a lower bound, said as one
            print(f"torchrun lost a node (2 -> 1): {exc}; counted as {TORCHRUN_LOST_TIMEOUT_S:g} s (at least)",
                  flush=True)
            figures["lost_2to1"] = {"pause_s": TORCHRUN_LOST_TIMEOUT_S, "lost_s": TORCHRUN_LOST_TIMEOUT_S,
                                    "available_s": TORCHRUN_LOST_TIMEOUT_S, "resumed": 0.0}
        else:
            pause, lost = _pause(log, killed, first)
            figures["lost_2to1"] = {"pause_s": pause, "lost_s": lost, "available_s": first - killed, "resumed": 1.0}
            print(f"torchrun lost a node (2 -> 1): pause {figures['lost_2to1']['pause_s']:.3f} s, kill -> stepping "
                  f"{first - killed:.3f} s", flush=True)
    finally:
        _finish(procs, stop)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1, help="workers per node (default 1: 4 nodes on 2 cores)")
    parser.add_argument("--quick", action="store_true", help="the same run (it takes about four minutes)")
    parser.add_argument("--launchers", default="stead,torchrun", help="stead, torchrun or both (default)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, the job's store)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="stead-bench-scale-"))
    launchers = set(args.launchers.split(","))
    try:
        stead = run_stead(workdir, args.nproc) if "stead" in launchers else {}
        torchrun = run_torchrun(workdir, args.nproc) if "torchrun" in launchers else {}
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if not stead or not torchrun:
        print(json.dumps({"bench": "scale", "nproc": args.nproc, "stead": stead, "torchrun": torchrun}))
        return
    ups = [stead["up_1to2"]["pause_s"], stead["up_2to4"]["pause_s"]]
    worst_up, lost = max(ups), stead["lost_4to3"]["pause_s"]
    ratio_up = torchrun["up_1to2"]["pause_s"] / stead["up_1to2"]["pause_s"]
    ratio_lost = torchrun["lost_2to1"]["pause_s"] / lost
    print(f"pause per resize: stead {', '.join(f'{p:.3f}' for p in ups)} s (growing), {lost:.3f} s (a lost node); "
          f"torchrun {torchrun['up_1to2']['pause_s']:.3f} s (growing), {torchrun['lost_2to1']['pause_s']:.3f} s "
          f"(a lost node): {ratio_up:.1f}x and {ratio_lost:.1f}x")

    def rounded(figures: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        return {k: {n: round(v, 3) for n, v in f.items()} for k, f in figures.items()}

    print(json.dumps({
        "bench": "scale", "nproc": args.nproc,
        "stead_up_pause_s": round(worst_up, 3), "stead_lost_pause_s": round(lost, 3),
        "torchrun_up_pause_s": round(torchrun["up_1to2"]["pause_s"], 3),
        "torchrun_lost_pause_s": round(torchrun["lost_2to1"]["pause_s"], 3),
        "ratio_up": round(ratio_up, 1), "ratio_lost": round(ratio_lost, 1),
        "torchrun_lost_resumed": bool(torchrun["lost_2to1"]["resumed"]),
        "stead": rounded(stead), "torchrun": rounded(torchrun),
        "goal_met": max(worst_up, lost) < 1.0 and min(ratio_up, ratio_lost) >= 8,
    }))


if __name__ == "__main__":
    main()
