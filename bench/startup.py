"""Launch to first training step: stead run vs torchrun, the same script, measured in the same run.

examples/train.py (gloo, a small DDP model) is started under ``torchrun`` and under
``stead run`` with every default on, on 1 node and on 2 nodes (2 workers each; two
torchrun processes with a c10d rendezvous on a free loopback port, or one
``stead run --nnodes 2``). Each run is timed from just before the launcher process
is started to the moment every rank has finished its first step (the script writes a
wall-clock timestamp after every step). Launchers are interleaved and each figure is
the median of ``--runs`` runs (at least 3).

Last line: one JSON object with ``stead_over_torchrun_1node`` and
``stead_over_torchrun_2node`` (ratios of the medians; the goal is <= 1.0).
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
BIN = Path(sys.executable).parent
NPROC = 2
STEPS = 3
RUN_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _first_step_s(stamps: Path, world: int, started: float) -> float:
    firsts: dict[int, float] = {}
    for line in stamps.read_text().splitlines():
        rank, _, _, when = line.split()
        firsts.setdefault(int(rank), float(when))
    if len(firsts) < world:
        raise RuntimeError(f"only ranks {sorted(firsts)} of {world} reported a step in {stamps}")
    return max(firsts.values()) - started


def _commands(launcher: str, nodes: int, stamps: Path) -> list[list[str]]:
    script = [str(TRAIN), "--steps", str(STEPS), "--step-time", "0", "--timestamps", str(stamps)]
    if launcher == "stead":
        return [[sys.executable, "-m", "stead", "run", "--nnodes", str(nodes), "--nproc-per-node", str(NPROC),
                 "--log-format", "json", *script]]
    if nodes == 1:
        return [[str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(NPROC), *script]]
    endpoint = f"127.0.0.1:{_free_port()}"
    return [[str(BIN / "torchrun"), "--nnodes", str(nodes), "--node-rank", str(rank), "--nproc-per-node", str(NPROC),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "bench", *script]
            for rank in range(nodes)]


def _run(launcher: str, nodes: int, workdir: Path) -> float:
    stamps = workdir / f"{launcher}-{nodes}-{time.time_ns()}.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.time()
    procs = [subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for command in _commands(launcher, nodes, stamps)]
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            err = f"did not finish within {RUN_TIMEOUT_S} s"
        if proc.returncode != 0:
            errors.append(err[-2000:])
    if errors:
        raise RuntimeError(f"{launcher} ({nodes} node(s)) failed:\n" + "\n".join(errors))
    return _first_step_s(stamps, nodes * NPROC, started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per launcher and node count (at least 3)")
    args = parser.parse_args()
    runs = max(3, args.runs)
    workdir = Path(tempfile.mkdtemp(prefix="stead-bench-startup-"))
    results: dict[tuple[str, int], list[float]] = {(who, n): [] for n in (1, 2) for who in ("torchrun", "stead")}
    try:
        for _ in range(runs):
            for launcher, nodes in results:  # interleaved: a slow minute of the machine hits both
                seconds = _run(launcher, nodes, workdir)
                results[(launcher, nodes)].append(seconds)
                print(f"{launcher:<9} {nodes} node(s): launch -> first step {seconds:6.2f} s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    median = {key: statistics.median(values) for key, values in results.items()}
    print(f"\nmedian of {runs} runs, {NPROC} workers per node | torchrun | stead run | stead / torchrun")
    for nodes in (1, 2):
        t, s = median[("torchrun", nodes)], median[("stead", nodes)]
        print(f"{nodes} node(s)                              | {t:6.2f} s | {s:7.2f} s | {s / t:.2f}")
    ratios = {f"stead_over_torchrun_{n}node": round(median[("stead", n)] / median[("torchrun", n)], 2)
              for n in (1, 2)}
    print(json.dumps({"bench": "startup", **ratios,
                      **{f"{who}_{n}node_s": round(v, 2) for (who, n), v in median.items()}, "runs": runs,
                      "nproc_per_node": NPROC, "goal_met": all(r <= 1.0 for r in ratios.values())}))


if __name__ == "__main__":
    main()
