"""One job over several hosts: stead run vs torchrun on test hosts made of network namespaces (issue 39).

The hosts are ``tests.support.hosts``: each its own address (10.77.0.x), link, /dev/shm and /tmp, all sharing
the repository, the Python environment and this bench's temporary folder, as machines share a filesystem. Every
host runs the same command line (``GLOO_SOCKET_IFNAME=eth0``, the same ``STEAD_JOB_TOKEN``), one worker per host,
gloo, the same script (examples/train.py) under both launchers. examples/train.py writes a wall-clock line
``rank restart step time`` to ``--timestamps`` after every step (and one when it crashes), so both launchers are
timed the same way, as in bench/recovery.py. Measured:

* **startup** (3 hosts, static rendezvous ``--nnodes 3 --node-rank R --master-addr H --master-port P``, torchrun
  vs stead, interleaved): from the moment every host's command has been started to the moment every rank has
  finished its first step;
* **worker crash** (3 hosts, c10d rendezvous ``--rdzv-backend c10d --rdzv-endpoint H:P``, rank 1 exits at step
  ``CRASH_STEP``, ``--max-restarts 1`` under both): from the crash to the first step of the new round on every
  rank (goal: stead <= 0.5 s and >= 8x faster). c10d, because it is how torchrun restarts a round across hosts:
  its static rendezvous does not coordinate a restart (each host's agent restarts on its own; here host 0's
  waited forever). A launcher's run that fails is counted (``*_failed_runs``, the first failure's reason) and
  not retried;
* **host loss**, stead only (torchrun's static job cannot go on without a host): a host that is not the master's
  killed (every process SIGKILLed, its memory and link gone) -> every rank of the new round has stepped.
  *Shrink*: ``--nnodes 2:3`` c10d on 3 hosts, the job goes on with 2.
  *Spare*: ``--nnodes 3:3`` c10d on 4 hosts, the 4th started once the job is at MAX (it offers itself and
  waits, its spare agent warm: the host is killed once that agent's zygote is ready, as it is on a spare that
  waited more than a few seconds), then takes the lost host's place (goal: <= 2 s);
* **partition** (stead, ``--nnodes 2:3`` c10d on 3 hosts): one non-master host's link down for
  ``PARTITION_S`` seconds, then up: the longest stall of rank 0's steps after the partition (from the partition,
  and from the heal, to stepping again), the steps lost (redone by a new round: the script keeps no checkpoint,
  so a new round starts over at step 0; 0 when the old round just goes on), and whether the host came back.

* **the master's host lost** (stead, ``--rdzv-backend etcd`` on 3 hosts, etcd on a 4th, ``--nnodes 2``): the host
  whose `stead run` was elected (started first; it stays the spare, the two nodes on the other hosts) killed: the
  longest gap between two steps of any rank from the kill until 30 steps after a standby's master took the job
  over (goal: <= 2 s), and the worker processes started anew (goal: 0; a new incarnation of a rank counts).

Figures are printed as they come; the last line is one JSON object with the figures under
the issue's names. ``--quick`` runs each measurement once (else medians of ``--runs``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.hosts import IFNAME, Host, Hosts, HostsUnavailable, test_hosts
from tests.support.hosts_etcd import etcd_on

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
BIN = Path(sys.prefix) / "bin"
#: late enough that the first round is warm (stead's zygote has imported torch)
CRASH_STEP = 100
STEPS = 130
#: a startup run stops soon after its first step
STARTUP_STEPS = 10
STEP_TIME_S = 0.03
#: the host-loss and partition jobs run until the bench has its figure (then the hosts are removed)
LONG_STEPS = 100_000
#: steps every rank has done before a host is killed or cut off
WARM_STEPS = 60
PARTITION_S = 10.0
#: the bound on a host-loss or partition job reaching its figure (ends a hung run: the figure is then null)
RUN_TIMEOUT_S = 60.0
#: the bound on a startup or worker-crash job (a whole run takes 10-30 s on 2 cores)
JOB_TIMEOUT_S = 60.0
#: how long the other hosts' launchers may go on once one has failed (torchrun's host 0 waits forever)
FAILED_GRACE_S = 10.0
#: how long the partitioned job is watched after the heal for the host to come back
AFTER_HEAL_S = 30.0
POLL_S = 0.05
#: tries of a startup or worker-crash run before that repetition gives no figure (torchrun's restart across hosts
#: is flaky here, as bench/recovery.py found on one host)
ATTEMPTS = 3
MASTER_PORT = 29500
RDZV_PORT = 29400


class Failed(RuntimeError):
    """A run did not give its figure; the message says why (it goes to the JSON as the figure's note)."""


def _lines(stamps: Path) -> list[tuple[int, int, str, float]]:
    if not stamps.exists():
        return []
    out = []
    for line in stamps.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:  # a line being written has fewer
            out.append((int(parts[0]), int(parts[1]), parts[2], float(parts[3])))
    return out


def _round_stepped(stamps: Path, after: float, ranks: int) -> float | None:
    """When every rank 0..ranks-1 of a round that started after ``after`` had finished its first step (step 0: the
    script keeps no checkpoint, so every round starts over), the latest of those; None while not yet."""
    firsts: dict[int, float] = {}
    for rank, _, step, when in _lines(stamps):
        if step == "0" and when > after:
            firsts.setdefault(rank, when)
    return max(firsts[r] for r in range(ranks)) if all(r in firsts for r in range(ranks)) else None


async def _until(predicate: object, what: str, procs: Sequence[asyncio.subprocess.Process] = (),
                 timeout_s: float = RUN_TIMEOUT_S) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()  # type: ignore[operator]
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"no {what} within {timeout_s:g} s")
        if procs and all(p.returncode is not None for p in procs):
            raise Failed(f"every launcher ended ({[p.returncode for p in procs]}) before {what}")
        await asyncio.sleep(POLL_S)


class Bench:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.token = secrets.token_urlsafe(32)
        self.runs = 0

    def env(self) -> dict[str, str]:
        return {**os.environ, "STEAD_JOB_TOKEN": self.token, "GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"}

    async def launch(self, host: Host, run: Path, argv: list[str]) -> asyncio.subprocess.Process:
        """``argv`` on ``host`` in a folder of its own under ``run``, its output in ``run/<host>.log``."""
        folder = run / host.name
        folder.mkdir(parents=True, exist_ok=True)
        with open(run / f"{host.name}.log", "ab") as out:  # noqa: ASYNC230 (a local file, opened at once)
            return await host.spawn(argv, env=self.env(), cwd=folder, stdout=out, stderr=out)

    def new_run(self, what: str) -> Path:
        self.runs += 1
        run = self.workdir / f"{self.runs:02d}-{what}"
        run.mkdir()
        return run

    @staticmethod
    def errors(run: Path) -> str:
        """Each host's last error line (an exception's name and message), for the JSON."""
        found = []
        for log in sorted(run.glob("*.log")):
            lines = [ln.removeprefix("[rank0]: ").removeprefix("[rank1]: ").removeprefix("[rank2]: ").strip()
                     for ln in log.read_text(errors="replace").splitlines()]
            errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
            if errors:
                found.append(f"{log.stem}: {errors[-1][:200]}")
        return "; ".join(found) or "no error in the hosts' output"

    @staticmethod
    def tail(run: Path) -> str:
        lines = []
        for log in sorted(run.glob("*.log")):
            text = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            lines += [f"  {log.stem}: {ln[:240]}" for ln in text[-4:]]
        return "\n".join(lines)

    # -- startup (static) and worker crash (c10d): 3 hosts ---------------------------------------------------

    async def job(self, hosts: Hosts, launcher: str, backend: str) -> float:
        """static: launch -> first step on every rank; c10d (rank 1 crashes once): crash -> first step of the new
        round on every rank."""
        run = self.new_run(f"{backend}-{launcher}")
        stamps = run / "steps.txt"
        crashing = backend == "c10d"
        flags = ["--nnodes", str(len(hosts)), "--nproc-per-node", "1", "--max-restarts", "1"]
        if crashing:
            flags += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}",
                      "--rdzv-id", f"crash{self.runs}"]
        else:
            flags += ["--master-addr", hosts[0].address, "--master-port", str(MASTER_PORT)]
        script = [str(TRAIN), "--steps", str(STEPS if crashing else STARTUP_STEPS), "--step-time", str(STEP_TIME_S),
                  "--timestamps", str(stamps)]
        if crashing:
            script += ["--crash-at-step", str(CRASH_STEP), "--crash-rank", "1"]
        if launcher == "torchrun":
            head = [str(BIN / "torchrun"), *flags, "--monitor-interval", "0.1"]
        else:
            head = [sys.executable, "-m", "stead", "run", *flags, "--job-name", f"job{self.runs}"]
        procs = []
        for rank, host in enumerate(hosts):
            node_rank = [] if crashing else ["--node-rank", str(rank)]
            procs.append(await self.launch(host, run, [*head, *node_rank, *script]))
        launched, started = time.time(), time.monotonic()
        deadline = started + JOB_TIMEOUT_S
        failed_at = None
        while any(p.returncode is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + FAILED_GRACE_S):
                raise Failed(f"{launcher} ({backend}) did not finish (exit codes {[p.returncode for p in procs]}, "
                             f"None: still running after {now - started:.0f} s): {self.errors(run)}\n"
                             f"{self.tail(run)}")
            await asyncio.sleep(POLL_S)
        codes = [p.returncode for p in procs]
        if any(codes):
            raise Failed(f"{launcher} ({backend}) failed (exit codes {codes}): {self.errors(run)}\n{self.tail(run)}")
        if not crashing:
            first = _round_stepped(stamps, launched, len(hosts))
            if first is None:
                raise Failed(f"{launcher}: incomplete timestamps in {stamps}")
            return first - launched
        crash = [when for _, _, step, when in _lines(stamps) if step == "crash"]
        again = _round_stepped(stamps, crash[0], len(hosts)) if crash else None
        if again is None:
            raise Failed(f"{launcher}: incomplete timestamps in {stamps} (crash {crash})")
        return again - crash[0]

    # -- host loss and partition: elastic (c10d) -------------------------------------------------------------

    def elastic_argv(self, hosts: Hosts, nnodes: str, stamps: Path, job: str) -> list[str]:
        return [sys.executable, "-m", "stead", "run", "--nnodes", nnodes, "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}", "--rdzv-id", job,
                "--max-restarts", "3", str(TRAIN), "--steps", str(LONG_STEPS), "--step-time", str(STEP_TIME_S),
                "--timestamps", str(stamps)]

    async def start_elastic(self, hosts: Hosts, first: int, nnodes: str, run: Path, ranks: int
                            ) -> tuple[Path, list[asyncio.subprocess.Process]]:
        """hosts[:first] running one c10d job, every rank past WARM_STEPS."""
        stamps = run / "steps.txt"
        argv = self.elastic_argv(hosts, nnodes, stamps, run.name)
        procs = [await self.launch(hosts[i], run, argv) for i in range(first)]

        def warm() -> bool:
            done = {rank for rank, _, step, _ in _lines(stamps) if step.isdigit() and int(step) >= WARM_STEPS}
            return len(done) >= ranks
        try:
            await _until(warm, f"{ranks} ranks past step {WARM_STEPS}", procs)
        except Failed as exc:
            raise Failed(f"{exc}:\n{self.tail(run)}") from None
        return stamps, procs

    async def host_loss(self, hosts: Hosts, spare: bool) -> float:
        """Kill the last job host (not the master's): seconds until every rank of the new round stepped."""
        n = len(hosts) - 1 if spare else len(hosts)
        run = self.new_run("spare" if spare else "shrink")
        stamps, procs = await self.start_elastic(hosts, n, f"{n}:{n}" if spare else f"{n - 1}:{n}", run, n)
        if spare:
            argv = self.elastic_argv(hosts, f"{n}:{n}", stamps, run.name)
            procs.append(await self.launch(hosts[n], run, argv))
            log = run / f"{hosts[n].name}.log"
            try:  # a spare host waits warm: its agent's zygote has imported the script's modules (~2.5 s here)
                await _until(lambda: log.exists() and _warm_spare(log.read_text(errors="replace")),
                             "spare host accepted and warm", procs, timeout_s=60)
            except Failed as exc:
                raise Failed(f"{exc}:\n{self.tail(run)}") from None
        victim = n - 1
        killed = time.time()
        await hosts.kill(victim)
        ranks = n if spare else n - 1
        try:
            again = await _until(lambda: _round_stepped(stamps, killed, ranks),
                                 f"round of {ranks} ranks stepping after host h{victim} was killed", procs)
        except Failed as exc:
            raise Failed(f"{exc}:\n{self.tail(run)}") from None
        assert isinstance(again, float)
        return again - killed

    async def master_host_loss(self, hosts: Hosts) -> tuple[float, int, float]:
        """--rdzv-backend etcd on hosts h0-h2 (etcd on h3), --nnodes 2: h0 started first is elected, the nodes go
        to h1 and h2 (the master's host stays the spare); h0 killed. (the longest gap between two steps of any
        rank from the kill until the standby's master took the job over and 30 more steps, the worker processes
        started anew, seconds from the kill to the takeover)."""
        run = self.new_run("master-host")
        stamps = run / "steps.txt"
        async with etcd_on(hosts[3]) as etcd:
            argv = [sys.executable, "-m", "stead", "run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd, "--rdzv-id", run.name, str(TRAIN),
                    "--steps", str(LONG_STEPS), "--step-time", str(STEP_TIME_S), "--timestamps", str(stamps)]
            procs = [await self.launch(hosts[0], run, argv)]
            log0 = run / f"{hosts[0].name}.log"
            await _until(lambda: log0.exists() and "elected its master" in log0.read_text(errors="replace"),
                         "h0 elected", procs)
            procs += [await self.launch(hosts[i], run, argv) for i in (1, 2)]

            def warm() -> bool:
                return len({rank for rank, _, step, _ in _lines(stamps)
                            if step.isdigit() and int(step) >= WARM_STEPS}) >= 2
            try:
                await _until(warm, f"2 ranks past step {WARM_STEPS}", procs)
            except Failed as exc:
                raise Failed(f"{exc}:\n{self.tail(run)}") from None
            killed = time.time()
            await hosts.kill(0)
            took = re.compile(r"\((taking the job over)\)")

            def taken_over() -> float | None:
                for host in (1, 2):
                    log = run / f"h{host}.log"
                    if took.search(log.read_text(errors="replace")):
                        return time.time()
                return None
            try:
                over = await _until(taken_over, "a standby's master taking the job over", procs[1:])
                assert isinstance(over, float)
                done = max((int(step) for _, _, step, _ in _lines(stamps) if step.isdigit()), default=0)
                await _until(lambda: any(s.isdigit() and int(s) >= done + 30 for _, _, s, _ in _lines(stamps)),
                             "30 steps after the takeover", procs[1:])
            except Failed as exc:
                raise Failed(f"{exc}:\n{self.tail(run)}") from None
            lines = _lines(stamps)
            gaps = [b - a for rank in (0, 1) for a, b in itertools.pairwise(
                [w for r, _, step, w in lines if r == rank and step.isdigit()]) if b > killed - 1]
            restarted = len({(r, restart) for r, restart, _, _ in lines}) - 2
            for proc in procs[1:]:
                proc.send_signal(2)  # stop the standbys' job: the figure is in
            return max(gaps), restarted, over - killed

    async def partition(self, hosts: Hosts) -> dict[str, object]:
        """Cut the last host off for PARTITION_S, heal it, watch what the job does."""
        n = len(hosts)
        run = self.new_run("partition")
        stamps, procs = await self.start_elastic(hosts, n, f"{n - 1}:{n}", run, n)
        victim = n - 1
        cut = time.time()
        await hosts.partition(victim)
        await asyncio.sleep(PARTITION_S)
        healed = time.time()
        await hosts.heal(victim)
        with contextlib.suppress(Failed):  # a round with the host back, or the old round going on
            await _until(lambda: _round_stepped(stamps, healed, n), "the host back", procs, timeout_s=AFTER_HEAL_S)
        before = [(s, w) for s, w in _rank0_steps(stamps, 0) if w <= cut]
        after = _rank0_steps(stamps, cut)
        if not before or not after:
            return {"partition_recovery_s": None,
                    "partition_note": f"rank 0 did not step again within {AFTER_HEAL_S:g} s of the heal:\n"
                                      + self.tail(run)}
        times = [before[-1][1], *(w for _, w in after)]
        stall, resumed = max((b - a, b) for a, b in itertools.pairwise(times))
        rounds = sum(1 for step, _ in after if step == 0)
        # the steps done before the stall that a new round did again (0 when the old round went on)
        lost = max(step for step, w in [*before, *after] if w < resumed) + 1 if rounds else 0
        back = _round_stepped(stamps, healed, n)
        return {"partition_recovery_s": round(resumed - cut, 3), "partition_from_heal_s": round(resumed - healed, 3),
                "partition_max_step_gap_s": round(stall, 3), "partition_steps_lost": lost,
                "partition_new_rounds": rounds,
                "partition_host_back_s": None if back is None else round(back - healed, 3)}


def _warm_spare(log: str) -> bool:
    """Whether a spare host's log says it joined the job and its spare agent's zygote is ready."""
    joined = log.find("joined job")
    waiting = log.find("spare_agent_waiting", max(joined, 0))
    return joined >= 0 and waiting >= 0 and "zygote_ready" in log[waiting:]


def _rank0_steps(stamps: Path, after: float) -> list[tuple[int, float]]:
    """Rank 0's (step, time) lines after ``after``."""
    return [(int(step), when) for rank, _, step, when in _lines(stamps) if rank == 0 and step.isdigit()
            and when > after]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


async def _measure(quick: bool, runs: int) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix="stead-bench-hosts-"))
    bench = Bench(workdir)
    shared = (ROOT, Path(sys.prefix), workdir)
    result: dict[str, object] = {"bench": "hosts", "runs": runs, "hosts": 3, "nproc_per_node": 1}
    try:
        startup: dict[str, list[float]] = {"torchrun": [], "stead": []}
        crash: dict[str, list[float]] = {"torchrun": [], "stead": []}
        failures: dict[str, list[str]] = {f"{launcher}_{backend}": [] for launcher in startup
                                          for backend in ("static", "c10d")}
        async with test_hosts(3, shared=shared, skip_unavailable=False) as hosts:
            for _ in range(runs):
                for backend, figures in (("static", startup), ("c10d", crash)):
                    for launcher in figures:
                        for attempt in range(1, ATTEMPTS + 1):
                            try:
                                figures[launcher].append(await bench.job(hosts, launcher, backend))
                                break
                            except Failed as exc:
                                failures[f"{launcher}_{backend}"].append(str(exc).splitlines()[0])
                                print(f"{launcher:<9} {backend} run failed (attempt {attempt} of {ATTEMPTS}): {exc}",
                                      flush=True)
                                for i in range(len(hosts)):  # nothing of the failed run left to take the ports
                                    await hosts.restart(i)
                        else:
                            continue
                        what = "launch -> first step" if backend == "static" else "crash -> first step"
                        print(f"{launcher:<9} {what} {figures[launcher][-1]:7.3f} s", flush=True)
        for name, errors in failures.items():
            result[f"{name}_failed_runs"] = len(errors)
            if errors:
                result[f"{name}_failure"] = errors[0]
        for launcher in startup:
            result[f"startup_{launcher}_s"] = _median(startup[launcher])
            result[f"worker_crash_{launcher}_s"] = _median(crash[launcher])
            result[f"worker_crash_{launcher}_measured"] = len(crash[launcher])
        t, s = result["worker_crash_torchrun_s"], result["worker_crash_stead_s"]
        if isinstance(t, float) and isinstance(s, float):
            result["worker_crash_ratio"] = round(t / s, 1)
            result["worker_crash_goal_met"] = s <= 0.5 and t / s >= 8
            print(f"worker crash (c10d): stead {s:.3f} s, torchrun {t:.3f} s, stead is {t / s:.1f}x faster; goal "
                  f"(stead <= 0.5 s and >= 8x faster) {'met' if result['worker_crash_goal_met'] else 'NOT met'}",
                  flush=True)

        for launcher in startup:
            if result[f"worker_crash_{launcher}_s"] is None:
                print(f"worker crash: no {launcher} figure, every run failed: {result[f'{launcher}_c10d_failure']}",
                      flush=True)
        result["host_loss_torchrun"] = "cannot continue"
        print("host loss: torchrun's static job cannot continue without the lost host (it waits for it, or fails)",
              flush=True)
        for name, spare, n in (("shrink", False, 3), ("spare", True, 4)):
            losses: list[float] = []
            notes: list[str] = []
            for _ in range(runs):
                try:
                    async with test_hosts(n, shared=shared, skip_unavailable=False) as hosts:
                        losses.append(await bench.host_loss(hosts, spare))
                    print(f"stead     host lost ({name}) -> stepping again {losses[-1]:7.3f} s", flush=True)
                except Failed as exc:
                    notes.append(str(exc))
                    print(f"stead     host lost ({name}): no figure: {exc}", flush=True)
                    break  # it will not work the next time either
            result[f"host_loss_{name}_s"] = _median(losses) if not notes else None
            if notes:
                result[f"host_loss_{name}_note"] = notes[0].splitlines()[0]
        spare_s = result["host_loss_spare_s"]
        if isinstance(spare_s, float):
            result["host_loss_spare_goal_met"] = spare_s <= 2.0
            print(f"host loss with a spare: goal (<= 2 s) {'met' if spare_s <= 2.0 else 'NOT met'}", flush=True)

        gaps: list[float] = []
        restarted: list[int] = []
        takeovers: list[float] = []
        for _ in range(runs):
            try:
                async with test_hosts(4, shared=shared, skip_unavailable=False) as hosts:
                    gap, again, over = await bench.master_host_loss(hosts)
            except Failed as exc:
                result["master_host_loss_note"] = str(exc).splitlines()[0]
                print(f"stead     master's host lost (etcd): no figure: {exc}", flush=True)
                break
            gaps.append(gap)
            restarted.append(again)
            takeovers.append(over)
            print(f"stead     master's host lost (etcd): standby took over after {over:.3f} s, longest step gap "
                  f"{gap:.3f} s, {again} worker(s) restarted", flush=True)
        result["master_host_loss_max_step_gap_s"] = round(max(gaps), 3) if gaps else None
        result["master_host_loss_workers_restarted"] = max(restarted) if restarted else None
        result["master_host_loss_takeover_s"] = _median(takeovers)
        if gaps:
            result["master_host_loss_goal_met"] = max(gaps) <= 2.0 and max(restarted) == 0

        try:
            async with test_hosts(3, shared=shared, skip_unavailable=False) as hosts:
                part = await bench.partition(hosts)
        except Failed as exc:
            part = {"partition_recovery_s": None, "partition_note": str(exc)}
        if isinstance(part.get("partition_note"), str):
            print(f"stead     {PARTITION_S:g} s partition: no figure: {part['partition_note']}", flush=True)
            part["partition_note"] = str(part["partition_note"]).splitlines()[0]
        else:
            back = part["partition_host_back_s"]
            print(f"stead     {PARTITION_S:g} s partition of h2: stepping again {part['partition_recovery_s']} s "
                  f"after the partition ({part['partition_from_heal_s']} s from the heal), longest step gap "
                  f"{part['partition_max_step_gap_s']} s, {part['partition_steps_lost']} steps lost, "
                  f"{part['partition_new_rounds']} new round(s); "
                  + (f"the host stepped in the job again {back} s after the heal" if back is not None else
                     f"the host did not train in the job again within {AFTER_HEAL_S:g} s of the heal"), flush=True)
        result.update(part)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per measurement")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    try:
        result = asyncio.run(_measure(args.quick, 1 if args.quick else args.runs))
    except HostsUnavailable as exc:
        raise SystemExit(f"bench/hosts.py needs test hosts (network namespaces): {exc}") from None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
