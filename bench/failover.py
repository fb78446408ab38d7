"""Master failover: SIGKILL the master of a running 2x2 job and see what training noticed.

Three ways, in one run:

* **`stead run`** (the local default): the job runs under `stead run`, which supervises
  its master process. The master (found with `stead status --json`) gets SIGKILL;
  `stead run` starts another on the same address, which adopts the running agents.
* **By hand, with an outage** (as on a cluster): a `stead master` process and two
  `stead agent` processes; the master gets SIGKILL and, ``--outage`` seconds later, a
  new `stead master` starts on the same store and address.

* **The store crashes** (etcd, as on a cluster): the job runs under `stead run` on a
  real etcd, which gets SIGKILL and, 10 s later, starts again on its data. The master
  rides the outage out; the workers never wait for the store.

Figures of each:

* ``max_step_gap_s``: the longest time between two steps of rank 0 over the whole run
  (beside the median step time): what the failover cost training;
* ``adopt_s``: until every agent has registered with the new master (from the kill
  under `stead run`, which includes starting the new master; from the new master's
  start by hand);
* ``steps_lost``: steps missing or run twice in rank 0's log (goal 0);
* ``workers_restarted``: worker processes started after the first round's (goal 0).

The last line is one JSON object: the `stead run` figures under those names, the
by-hand ones prefixed ``outage_``, the etcd ones ``etcd_outage_`` (goals: no gap over
twice the median step, no step lost, no worker restarted).
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
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stead.cli.run_args import parse_run_args
from stead.core.config import Settings
from stead.core.events import JobSubmitted
from stead.core.master import Master, MasterConfig
from stead.core.runspec import RUN_SPEC_ENV, spec_text
from stead.testing.etcd import EtcdServer
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
    env = {**os.environ, RUN_SPEC_ENV: spec_text(parse_run_args(argv, cwd=str(work)))}
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
    started = sum(len(_log_times(p, "worker_started")) for p in logs)
    return {"outage_s": outage_s, **_step_figures(done, steps),
            "steps_in_outage": sum(1 for t, _ in done if killed_at < t < restarted_at),
            "adopt_s": round(adopt_s, 3), "workers_restarted": started - NODES * NPROC,
            "agents_exit_codes": codes}  # type: ignore[dict-item]


def _under_stead_run(work: Path, job: str, steps: int, fault: Callable[[Path], dict[str, float]],
                     *flags: str) -> dict[str, float | int]:
    """A 2x2 job under `stead run` (``flags`` added); ``fault(run_log)`` runs once the workers step and returns
    figures of its own. The step figures, the workers restarted and the exit code join them."""
    (work / "train.py").write_text(TRAIN_LOGGING_STEPS)
    log_path, steps_log = work / "run.log", work / "steps.log"
    with open(log_path, "w") as err:
        run = subprocess.Popen([sys.executable, "-m", "stead", "run", "--job-name", job, "--log-format", "json",
                                *flags, "--nnodes", str(NODES), "--nproc-per-node", str(NPROC), "train.py",
                                str(steps)], cwd=work, stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait(lambda: len(read_steps(steps_log)) >= 40, "the first steps")
        extra = fault(log_path)
        code = run.wait(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return {**_step_figures(read_steps(steps_log), steps), **extra,
            "workers_restarted": len(_log_times(log_path, "worker_started")) - NODES * NPROC, "exit_code": code}


def run_supervised(steps: int, work: Path) -> dict[str, float | int]:
    """The job under `stead run`; its master gets SIGKILL once the workers step."""

    def kill_master(log_path: Path) -> dict[str, float]:
        status = subprocess.run([sys.executable, "-m", "stead", "status", "--job", "failover-run", "--json"],
                                cwd=work, capture_output=True, text=True, check=True)
        os.kill(json.loads(status.stdout)["master_pid"], signal.SIGKILL)
        killed_at = time.time()
        print(f"stead run: master killed at step {read_steps(work / 'steps.log')[-1][1]}", flush=True)
        _wait(lambda: len([t for t in _log_times(log_path, "agent_registered") if t > killed_at]) >= NODES,
              "every agent registered with the new master")
        adopt_s = sorted(t for t in _log_times(log_path, "agent_registered") if t > killed_at)[NODES - 1] - killed_at
        print(f"stead run: the new master had adopted both nodes {adopt_s:.2f} s after the kill", flush=True)
        return {"adopt_s": round(adopt_s, 3)}

    return _under_stead_run(work, "failover-run", steps, kill_master)


def run_etcd_outage(steps: int, work: Path, outage_s: float) -> dict[str, float | int]:
    """The job under `stead run` on etcd; etcd gets SIGKILL once the workers step, and starts again on its data
    ``outage_s`` later."""
    with EtcdServer() as etcd:

        def kill_etcd(log_path: Path) -> dict[str, float]:
            etcd.kill()
            print(f"etcd: killed at step {read_steps(work / 'steps.log')[-1][1]}; back in {outage_s:g} s", flush=True)
            time.sleep(outage_s)
            etcd.start()
            return {}

        return _under_stead_run(work, "failover-etcd", steps, kill_etcd, "--store", etcd.url)


def _step_figures(done: list[tuple[float, int]], steps: int) -> dict[str, float | int]:
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(done)]
    seen = [s for _, s in done]
    return {"steps": steps, "median_step_s": round(statistics.median(gaps), 4), "max_step_gap_s": round(max(gaps), 3),
            "steps_lost": len(set(range(steps)) - set(seen)) + (len(seen) - len(set(seen)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outage", type=float, default=30.0, help="seconds with no master at all (default 30)")
    parser.add_argument("--etcd-outage", type=float, default=10.0,
                        help="seconds etcd is down (SIGKILL, then started on its data) under a job (default 10)")
    parser.add_argument("--quick", action="store_true", help="a 5 s outage of the master and of etcd")
    args = parser.parse_args()
    outage = 5.0 if args.quick else args.outage
    etcd_outage = 5.0 if args.quick else args.etcd_outage
    steps = int(outage / 0.06) + 300
    with tempfile.TemporaryDirectory(prefix="stead-bench-failover-") as tmp:
        supervised = run_supervised(600, Path(tmp))
    with tempfile.TemporaryDirectory(prefix="stead-bench-failover-") as tmp:
        by_hand = run(outage, steps, Path(tmp))
    with tempfile.TemporaryDirectory(prefix="stead-bench-failover-") as tmp:
        on_etcd = run_etcd_outage(int(etcd_outage / 0.06) + 400, Path(tmp), etcd_outage)
    print(f"{'':<28} {'max step gap':>12} {'median step':>11} {'adopt':>7} {'lost':>5} {'restarted':>9}")
    for name, figures in (("stead run, master killed", supervised), (f"by hand, {outage:g} s outage", by_hand),
                          (f"etcd killed for {etcd_outage:g} s", on_etcd)):
        adopt = f"{figures['adopt_s']:>5.2f} s" if "adopt_s" in figures else f"{'-':>7}"
        print(f"{name:<28} {figures['max_step_gap_s']:>10.3f} s {figures['median_step_s']:>9.3f} s "
              f"{adopt} {figures['steps_lost']:>5} {figures['workers_restarted']:>9}")
    print(f"by hand: {by_hand['steps_in_outage']} steps while no master ran")
    outage = {k if k.startswith("outage") else f"outage_{k}": v for k, v in by_hand.items()}
    etcd = {f"etcd_outage_{k}": v for k, v in on_etcd.items()} | {"etcd_outage_s": etcd_outage}
    print(json.dumps({"bench": "failover", **supervised, **outage, **etcd,
                      "goal_adopt_s": 2.0, "goal_steps_lost": 0, "goal_workers_restarted": 0,
                      "goal_etcd_outage_max_step_gap_s": round(2 * float(on_etcd["median_step_s"]), 4)}))


if __name__ == "__main__":
    main()
