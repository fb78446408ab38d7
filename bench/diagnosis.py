"""Hang detection: how long a hung rank goes unnoticed, and whether a healthy job is ever flagged.

Latency: a real `stead run` job (3 gloo workers, CPU, DDP, no stead call in the script)
whose rank 1 sleeps forever in a step, for step times of 0.1 s, 1 s and 10 s; the time
from the hang (the worker writes it down) to the `diagnosis.hang` event, with every
default setting. Compared with the reference system's default hang window (5-10 min;
its lower end is used), gloo's default collective timeout (30 min) and NCCL's (10 min).

False alarms: the detector itself (the plugin's StepClock, the code the plugin runs)
replayed over a long healthy run whose step times are heavy-tailed (Pareto, clipped to
10x the fastest), progress sampled as the agents report it (every heartbeat, at most one
record per progress_interval_s).

Health check cost: a real 3-node job (one gloo worker each) run with every node checked
(``--set health_check=all``) and without; per node, the whole check as its agent ran it
(forked from the warm zygote, so it waits for the zygote's torch import as the workers would:
a matmul, then all-reduces with two partners), from the ``node.health`` events, and how
much later every worker of the job's first round was running.

Last line: JSON with hang_detect_s_step{0.1,1,10}s, false_alarms, health_check_s_per_node
(the median), health_check_round_delay_s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stead.plugins.diagnosis.hang import StepClock  # noqa: E402
from stead.plugins.diagnosis.settings import DiagnosisSettings  # noqa: E402

REFERENCE_WINDOW_S = 300.0  # the reference system's default hang window: 5-10 minutes
GLOO_TIMEOUT_S = 1800.0
NCCL_TIMEOUT_S = 600.0

TRAIN = """
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
step_time = float(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(int(sys.argv[2])):
    if step == int(sys.argv[3]) and rank == 1 and restart == 0:
        open("hung-at", "w").write(repr(time.time()))
        time.sleep(3600)
    loss = model(torch.ones(4, 8)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(step_time)
dist.destroy_process_group()
"""


def hang_latency(step_time: float, workdir: Path) -> float:
    job = f"hang-{str(step_time).replace('.', '-')}s"
    folder = workdir / job
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN)
    hang_step = max(5, int(20 / step_time)) if step_time < 10 else 8  # enough steps to learn the pace
    steps = hang_step + 3
    proc = subprocess.run([sys.executable, "-m", "stead", "run", "--job-name", job, "--nproc-per-node", "3",
                           "--max-restarts", "1", "--log-format", "json", "train.py", str(step_time), str(steps),
                           str(hang_step)], cwd=folder, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"the {step_time} s job failed:\n{proc.stderr[-3000:]}")
    hung_at = float((folder / "hung-at").read_text())
    events = subprocess.run([sys.executable, "-m", "stead", "events", "--job", job, "--json"], cwd=folder,
                            capture_output=True, text=True, check=True).stdout
    for line in events.splitlines():
        record = json.loads(line)
        if record.get("type") == "diagnosis.hang":
            return float(record["at"]) - hung_at
    raise RuntimeError(f"the {step_time} s job recovered, but no diagnosis.hang event is in its log")


SHORT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
"""


def _records(job: str, folder: Path) -> list[dict[str, object]]:
    out = subprocess.run([sys.executable, "-m", "stead", "events", "--job", job, "--json"], cwd=folder,
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def health_check_cost(workdir: Path, mode: str) -> tuple[list[float], float]:
    """(each node's check in seconds, seconds from the job's submission to every worker of its first round
    running) with ``mode``."""
    job = f"health-{mode}"
    folder = workdir / job
    folder.mkdir()
    (folder / "train.py").write_text(SHORT)
    proc = subprocess.run([sys.executable, "-m", "stead", "run", "--job-name", job, "--nnodes", "3",
                           "--nproc-per-node", "1", "--set", f"health_check={mode}", "--log-format", "json",
                           "train.py"], cwd=folder, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} health check job failed:\n{proc.stderr[-3000:]}")
    records = _records(job, folder)
    at = {r["type"]: float(r["at"]) for r in reversed(records)}  # type: ignore[arg-type]
    checks = [float(r["data"]["seconds"]) for r in records if r["type"] == "node.health"]  # type: ignore[index]
    return checks, at["round.completed"] - at["job.submitted"]


def false_alarms(steps: int, seed: int) -> tuple[int, float]:
    """Alarms over ``steps`` healthy steps (Pareto step times, at most 10x apart); also the longest step."""
    s = DiagnosisSettings()
    clock = StepClock(floor_s=s.hang_floor_s, factor=s.hang_factor, first_step_s=s.first_step_s, phase_s=s.phase_s)
    rng = random.Random(seed)
    base = 2.0  # 2-20 s steps: past the floor, the pace model itself is what is tested
    heartbeat, interval = 0.5, 1.0
    clock.start_round(1, 0.0)
    now, done, alarms, longest = 0.0, -1, 0, 0.0
    last_record, next_beat = -interval, heartbeat
    ends: list[float] = []
    t = 0.0
    for _ in range(steps):
        step_time = base * min(10.0, rng.paretovariate(1.2))
        longest = max(longest, step_time)
        t += step_time
        ends.append(t)
    i = 0
    while i < len(ends):
        now = next_beat
        while i < len(ends) and ends[i] <= now:
            done, i = done + 1, i + 1
        if clock.stalled(now) is not None:
            alarms += 1
            clock.start_round(1, now)  # count each alarm once
        if done >= 0 and now - last_record >= interval and (clock.step is None or done > clock.step):
            clock.observe(1, done, now)
            last_record = now
        next_beat += heartbeat
    return alarms, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 1 s step job and a shorter healthy run")
    args = parser.parse_args()
    step_times = [1.0] if args.quick else [0.1, 1.0, 10.0]
    results: dict[str, float | int | None] = {}
    with tempfile.TemporaryDirectory(prefix="stead-bench-diagnosis-") as tmp:
        for step_time in step_times:
            seconds = hang_latency(step_time, Path(tmp))
            results[f"hang_detect_s_step{step_time:g}s"] = round(seconds, 1)
            print(f"step time {step_time:>4g} s: hang detected after {seconds:6.1f} s  (reference window "
                  f"{REFERENCE_WINDOW_S:.0f} s: {REFERENCE_WINDOW_S / seconds:.0f}x; gloo timeout "
                  f"{GLOO_TIMEOUT_S:.0f} s, NCCL {NCCL_TIMEOUT_S:.0f} s)", flush=True)
        checks, checked_start = health_check_cost(Path(tmp), "all")
        _, plain_start = health_check_cost(Path(tmp), "off")
    per_node = statistics.median(checks)
    print(f"health check: {len(checks)} nodes, {per_node:.2f} s per node (median; {min(checks):.2f}-"
          f"{max(checks):.2f} s; from the command to the report, the wait for the node's warm zygote included); "
          f"every worker of the first round ran {checked_start:.2f} s after submission with it, "
          f"{plain_start:.2f} s without", flush=True)
    steps = 5_000 if args.quick else 50_000
    alarms = 0
    for seed in range(3):
        found, longest = false_alarms(steps, seed)
        alarms += found
        print(f"healthy run {seed}: {steps} steps of 2-{longest:.1f} s (Pareto, clipped at 10x): {found} "
              "false alarm(s)", flush=True)
    print(json.dumps({"bench": "diagnosis", **results, "false_alarms": alarms, "healthy_steps": 3 * steps,
                      "reference_hang_window_s": REFERENCE_WINDOW_S, "gloo_timeout_s": GLOO_TIMEOUT_S,
                      "nccl_timeout_s": NCCL_TIMEOUT_S, "health_check_s_per_node": round(per_node, 2),
                      "health_check_round_delay_s": round(checked_start - plain_start, 2)}))


if __name__ == "__main__":
    main()
