"""Master failover: SIGKILL the master of a running 2x2 job, start another, and see what training noticed.

The job (2 nodes x 2 gloo workers, ~0.05 s steps) runs under a `stead master` process and
two `stead agent` processes started by hand, as on a cluster. Once it trains, the master
gets SIGKILL; after ``--outage`` seconds with no master at all, a new `stead master`
starts on the same store and address. Figures:

* ``max_step_gap_s``: the longest time between two steps of rank 0 over the whole run
  (beside the median step time): what the outage cost training;
* ``adopt_s``: from the new master's start until every agent has registered with it;
* ``steps_lost``: steps missing or run twice in rank 0's log (goal 0);
* ``workers_restarted``: worker processes started after the first round's (goal 0).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stead.core.agent.main import RUN_ARGV_ENV
from stead.core.config import Settings
from stead.core.events import JobSubmitted
from stead.core.master import Master, MasterConfig
from stead.testing.steps import TRAIN_LOGGING_STEPS, free_port, read_steps

NODES, NPROC = 2, 2


def _wait(predicate: object, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"bench/failover.py: gave up waiting for {what}")
        time.sleep(0.05)


def _log_times(path: Path, event: str) -> list[float]:
    """Wall-clock times of the JSON log lines of ``event`` in ``path``."""
    times = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                times.append(datetime.fromisoformat(record["timestamp"].rstrip("Z")).timestamp())
    return times


async def _submit(config: MasterConfig, steps: int) -> None:
    async with Master(config) as master:
        await master.submit_job(JobSubmitted(job=config.job, min_nodes=NODES, max_nodes=NODES, nproc_per_node=NPROC,
                                             entrypoint=(sys.executable, "-u", "train.py", str(steps))))


def run(outage_s: float, steps: int, work: Path) -> dict[str, float | int]:
    (work / "train.py").write_text(TRAIN_LOGGING_STEPS)
    url, port, token = f"sqlite:///{work / 'job.db'}", free_port(), str(work / "job.token")
    asyncio.run(_submit(MasterConfig(job="failover", store_url=url, settings=Settings(), port=port, token_file=token),
                        steps))
    master_cmd = [sys.executable, "-m", "stead", "master", "--store", url, "--job", "failover", "--port", str(port),
                  "--token-file", token, "--log-format", "json"]
    argv = ["--job-name", "failover", "--store", url, "--nnodes", str(NODES), "--nproc-per-node", str(NPROC),
            "train.py", str(steps)]
    env = {**os.environ, RUN_ARGV_ENV: json.dumps(argv)}
    logs = [work / f"node-{i}.log" for i in range(NODES)]
    with contextlib.ExitStack() as files:
        def log_file(name: str) -> IO[str]:
            return files.enter_context(open(work / name, "w"))

        first = subprocess.Popen(master_cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=log_file("master-1.log"))
        _wait(lambda: Path(token).exists(), "the first master")
        agents = [subprocess.Popen([sys.executable, "-m", "stead", "agent", "--master", f"127.0.0.1:{port}",
                                    "--token-file", token, "--node-id", f"node-{i}", "--incarnation", "1",
                                    "--log-format", "json"], cwd=work, env=env, stdout=subprocess.DEVNULL,
                                   stderr=log_file(logs[i].name)) for i in range(NODES)]
        second = None
        try:
            log_path = work / "steps.log"
            _wait(lambda: len(read_steps(log_path)) >= 40, "the first steps")
            first.send_signal(signal.SIGKILL)
            first.wait()
            killed_at = time.time()
            print(f"master killed at step {read_steps(log_path)[-1][1]}; no master for {outage_s:g} s", flush=True)
            time.sleep(outage_s)
            restarted_at = time.time()
            second = subprocess.Popen(master_cmd, cwd=work, stdout=subprocess.DEVNULL,
                                      stderr=log_file("master-2.log"))
            _wait(lambda: all(any(t > restarted_at for t in _log_times(p, "agent_registered")) for p in logs),
                  "every agent registered with the new master")
            adopt_s = max(min(t for t in _log_times(p, "agent_registered") if t > restarted_at) for p in logs) \
                - restarted_at
            print(f"new master adopted both nodes {adopt_s:.2f} s after it started", flush=True)
            codes = [agent.wait(timeout=600) for agent in agents]
            second.wait(timeout=60)
        finally:
            for process in (first, *agents, *([second] if second else [])):
                if process.poll() is None:
                    process.kill()
                    process.wait()
    done = read_steps(work / "steps.log")
    times = [t for t, _ in done]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    stepped_in_outage = sum(1 for t in times if killed_at < t < restarted_at)
    seen = [s for _, s in done]
    lost = len(set(range(steps)) - set(seen)) + (len(seen) - len(set(seen)))
    started = sum(len(_log_times(p, "worker_started")) for p in logs)
    return {"outage_s": outage_s, "steps": steps, "steps_in_outage": stepped_in_outage,
            "median_step_s": round(statistics.median(gaps), 4), "max_step_gap_s": round(max(gaps), 3),
            "adopt_s": round(adopt_s, 3), "steps_lost": lost, "workers_restarted": started - NODES * NPROC,
            "agents_exit_codes": codes}  # type: ignore[dict-item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=30.0, help="seconds with no master at all (default 30)")
    parser.add_argument("--quick", action="store_true", help="a 5 s outage")
    args = parser.parse_args()
    outage = 5.0 if args.quick else args.outage
    steps = int(outage / 0.06) + 300
    with tempfile.TemporaryDirectory(prefix="stead-bench-failover-") as tmp:
        figures = run(outage, steps, Path(tmp))
    print(f"{figures['steps_in_outage']} steps while no master ran; longest gap between steps "
          f"{figures['max_step_gap_s']} s (median step {figures['median_step_s']} s); steps lost "
          f"{figures['steps_lost']}; workers restarted {figures['workers_restarted']}; adopted in "
          f"{figures['adopt_s']} s (goal < 2 s)")
    print(json.dumps({"bench": "failover", **figures, "goal_adopt_s": 2.0}))


if __name__ == "__main__":
    main()
