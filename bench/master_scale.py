"""The master at cluster scale: simulated agents against a real master process, N = 100 .. 10,000 nodes.

A real master (bench/_scale_master.py: RPC server, reactor, diagnosis plugin, a
sqlite or etcd store) runs pinned to core 0; simulated agents
(:class:`stead.testing.swarm.Swarm`, the real agent protocol over loopback, no
workers) run in this process, pinned to core 1. For each store and N it measures:

- rendezvous: from the first registration to every node holding its rank, and the CPU
  seconds the master and the simulated agents spent meanwhile (which side it waited for);
- heartbeats at the interval given: round trip p50/p99 as the agents time it, the
  master's CPU (share of one core) and its memory per node;
- progress: StepProgress records the master wrote per second while every node stepped;
- a lost node: from its last heartbeat to the first StopWorkers its peers got, minus
  the heartbeat timeout;
- a mass failure: min(N, 1000) nodes report a worker failure at once: the decisions
  recorded for that round, and the events the store took per second until the next
  round ran;
- the master's garbage-collector pauses while it served: the longest of each generation
  (and, printed, which part of the run each pause over 100 ms fell in).

The goals hold on both stores: etcd's rows run to 10,000 nodes too (``--etcd-max``), its
snapshots written in chunks of what one etcd request takes.

Then, at a 1 s interval, the largest N the master holds with p99 < 100 ms, with one
heartbeat per call and with heartbeats batched per aggregator (100 nodes a call). Last
line: one JSON object with each figure and its goal. ``--quick`` runs small sizes only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stead.core.errors import SteadError  # noqa: E402
from stead.core.events import RecoveryDecided, StepProgress  # noqa: E402
from stead.core.events.log import EventLog  # noqa: E402
from stead.core.statemachine.job import node_ids  # noqa: E402
from stead.core.store import open_store  # noqa: E402
from stead.testing.etcd import EtcdServer  # noqa: E402
from stead.testing.swarm import Swarm  # noqa: E402

MASTER_CORE, AGENT_CORE = 0, 1
GOALS = {"hb10s_n10000_p99_ms": "< 100", "hb10s_n10000_master_cpu": "< 0.25", "hb1s_max_nodes": "max, p99 < 100 ms",
         "rdzv_n1000_s": "< 2", "lost_n10000_detect_over_timeout_s": "< 1", "mass_failure_n1000_decisions": "== 1",
         # the same on etcd, whose writes are bounded (1.5 MiB a request) and slower
         "etcd_n10000_hb10s_p99_ms": "< 100", "etcd_n10000_master_cpu": "< 0.25",
         "etcd_n10000_lost_detect_over_timeout_s": "< 1", "etcd_n1000_mass_decisions": "== 1"}
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class MasterProc:
    proc: asyncio.subprocess.Process
    address: str
    token: str

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextlib.asynccontextmanager
async def master(job: str, nodes: int, store: str, interval: float, hb_timeout: float, listener: socket.socket,
                 workdir: Path) -> AsyncIterator[MasterProc]:
    command = [str(ROOT / "bench" / "_scale_master.py"), "--job", job, "--nodes", str(nodes), "--store", store,
               "--listen-fd", str(listener.fileno()), "--interval", str(interval), "--timeout", str(hb_timeout),
               "--workdir", str(workdir)]
    if os.environ.get("STEAD_SCALE_PROFILE"):  # a directory: cProfile statistics of each master go there
        command += ["--profile", str(Path(os.environ["STEAD_SCALE_PROFILE"]) / f"{job}.prof")]
    proc = await asyncio.create_subprocess_exec(sys.executable, *command, stdout=subprocess.PIPE,
                                                stdin=subprocess.PIPE, pass_fds=[listener.fileno()], cwd=workdir)
    try:
        os.sched_setaffinity(proc.pid, {MASTER_CORE})
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the master exited with {await proc.wait()} before serving")
        info = json.loads(line)
        yield MasterProc(proc, info["address"], info["token"])
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(60):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


@dataclass
class Run:
    store: str
    nodes: int
    interval: float
    figures: dict[str, Any] = field(default_factory=dict)


async def _settle(pid: int, *, idle: float = 0.5, limit_s: float = 120.0) -> float:
    """Wait until the master has worked through the round's start (thousands of reports and events after the
    last rank assignment): its CPU over the last 2 s under ``idle``. Returns how long that took."""
    started = time.monotonic()
    cpu, at = _cpu_s(pid), started
    while time.monotonic() - started < limit_s:
        await asyncio.sleep(2.0)
        now_cpu, now = _cpu_s(pid), time.monotonic()
        if (now_cpu - cpu) / (now - at) < idle:
            break
        cpu, at = now_cpu, now
    return time.monotonic() - started


async def _follow_platform(m: MasterProc, swarm: Swarm) -> None:
    """Start and stop simulated nodes as the master's platform launches and kills them."""
    assert m.proc.stdout is not None
    while line := await m.proc.stdout.readline():
        order = json.loads(line)
        if "launch" in order:
            node_id, incarnation = order["launch"]
            swarm.start([node_id], incarnation=incarnation)
        elif "kill" in order:
            swarm.kill(*order["kill"])


async def _records(store_url: str, job: str) -> list[Any]:
    store = await open_store(store_url)
    try:
        return await EventLog(store, job).read()
    finally:
        await store.close()


async def measure(run: Run, store_url: str, job: str, *, window_s: float, lost: bool, mass: int, batch: int,
                  workdir: Path, rdzv_timeout_s: float = 600.0) -> None:
    n, interval = run.nodes, run.interval
    # at a 1 s interval, 10 s: the simulated agents share one core, and while 10,000 of them register it falls
    # behind on the first heartbeats of those that did (real agents each have their own)
    timeout = max(3 * interval, 10.0)
    listener = socket.create_server(("127.0.0.1", 0))
    marks: dict[str, float] = {}
    try:
        async with master(job, n, store_url, interval, timeout, listener, workdir) as m, \
                Swarm(m.address, m.token, interval_s=interval, batch=batch, call_timeout_s=30.0) as swarm:
            platform = asyncio.create_task(_follow_platform(m, swarm))
            rss0 = _rss(m.pid)
            marks["start"] = time.time()
            started, master_cpu0, swarm_cpu0 = time.monotonic(), _cpu_s(m.pid), time.process_time()
            swarm.start(node_ids(n), patience_s=60)  # the master may not have recorded all N yet
            await swarm.wait(lambda s: len(s.assigned(1)) == n, timeout_s=rdzv_timeout_s)
            joined = max(node.registered_at or 0.0 for node in swarm.nodes.values())
            assigned = max(node.assigned_at[1] for node in swarm.nodes.values())
            run.figures.update(join_s=joined - started, rdzv_s=assigned - started, rdzv_after_join_s=assigned - joined,
                               # which side the rendezvous waited for: CPU seconds of each over it
                               rdzv_master_cpu_s=_cpu_s(m.pid) - master_cpu0,
                               rdzv_swarm_cpu_s=time.process_time() - swarm_cpu0)
            marks["assigned"] = time.time()
            ranks = swarm.assigned(1)
            assert sorted(ranks.values()) == list(range(n)), "ranks are not 0..N-1, each once"
            await asyncio.sleep(min(interval, 2.0))  # every node has beaten once since the round started
            run.figures["settle_s"] = await _settle(m.pid)
            swarm.latencies.clear()
            swarm.heartbeat_errors = 0
            cpu0, wall0, swarm_cpu0 = _cpu_s(m.pid), time.monotonic(), time.process_time()
            marks["steady"] = time.time()
            step = 0
            at = time.time()
            while time.monotonic() - wall0 < window_s:
                step += 1
                swarm.set_step(step)
                await asyncio.sleep(1.0)
            cpu = (_cpu_s(m.pid) - cpu0) / (time.monotonic() - wall0)
            # the simulated agents' own core: near 1, they (not the master) are what holds the heartbeats up
            swarm_cpu = (time.process_time() - swarm_cpu0) / (time.monotonic() - wall0)
            window_end = time.time()
            lat = list(swarm.latencies)
            run.figures.update(hb_p50_ms=_pct(lat, 0.5) * 1e3, hb_p99_ms=_pct(lat, 0.99) * 1e3, hb_calls=len(lat),
                               hb_errors=swarm.heartbeat_errors, master_cpu=cpu, swarm_cpu=swarm_cpu,
                               rss_per_node_kb=(_rss(m.pid) - rss0) / n / 1024, progress_window=(at, window_end))
            marks["steady_end"] = time.time()
            if lost:
                victim = f"node-{n // 2}"
                swarm.silence(victim)
                await swarm.wait(lambda s: bool(s.stopped(1)), timeout_s=timeout + 2 * interval + 30)
                first_stop = min(swarm.stopped(1).values())
                last_beat = swarm.nodes[victim].last_beat or first_stop
                run.figures["lost_detect_over_timeout_s"] = first_stop - last_beat - timeout
                await swarm.wait(lambda s: len(s.assigned(2)) == n, timeout_s=120)
                current = 2
            else:
                current = 1
            marks["mass"] = time.time()
            if mass:
                failing = node_ids(n)[:mass]
                t0, at0 = time.monotonic(), time.time()
                await swarm.fail(failing, round=current)
                await swarm.wait(lambda s: len(s.assigned(current + 1)) == n, timeout_s=120)
                run.figures.update(mass_failed=mass, mass_recovery_s=time.monotonic() - t0,
                                   mass_window=(at0, time.time()), mass_round=current)
            platform.cancel()
    finally:
        listener.close()
    gc_file = workdir / f"{job}.gc.json"  # the master's garbage-collector pauses, written as it exits
    if gc_file.exists():
        gc_figures = json.loads(gc_file.read_text())
        long = gc_figures.pop("gc_long_pauses")
        run.figures.update(gc_figures)
        if long:  # which part of the run each long pause fell in
            def part(at: float) -> str:
                return max((k for k, t in marks.items() if t <= at), key=marks.__getitem__, default="start")
            print(f"{run.store} N={run.nodes}: garbage-collector pauses over 100 ms: " + ", ".join(
                f"gen{g} {s * 1e3:.0f} ms in {part(at)}" for at, g, s in long), flush=True)
    records = await _records(store_url, job)
    a, b = run.figures.pop("progress_window")
    progress = [r for r in records if isinstance(r.event, StepProgress) and a <= r.at <= b]
    run.figures["progress_records_per_s"] = len(progress) / (b - a)
    if "mass_window" in run.figures:
        a, b = run.figures.pop("mass_window")
        in_window = [r for r in records if a <= r.at <= b]
        run.figures["mass_events"] = len(in_window)
        run.figures["mass_events_per_s"] = len(in_window) / max(1e-9, in_window[-1].at - a) if in_window else 0.0
        run.figures["mass_decisions"] = sum(1 for r in records if isinstance(r.event, RecoveryDecided)
                                            and r.event.round == run.figures["mass_round"])


async def attempt(run: Run, *args: Any, **kwargs: Any) -> None:
    """:func:`measure`, with a failure recorded in the figures (``error``) instead of ending the benchmark."""
    try:
        await measure(run, *args, **kwargs)
    except (TimeoutError, SteadError, AssertionError, RuntimeError) as exc:
        run.figures["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"{run.store} N={run.nodes}: {run.figures['error']}", flush=True)


async def max_nodes(store_url: str, sizes: list[int], *, batch: int, workdir: Path) -> tuple[int, list[Run]]:
    """The largest N in ``sizes`` whose heartbeats at 1 s hold p99 < 100 ms (stops at the first that does not)."""
    best, runs = 0, []
    for n in sizes:
        run = Run(store="sqlite", nodes=n, interval=1.0)
        name = f"hb1s-{batch}-{n}"
        await attempt(run, store_url.format(n=name), name, window_s=10.0, lost=False, mass=0, batch=batch,
                      workdir=workdir, rdzv_timeout_s=180.0)  # a size that cannot hold does not converge: move on
        runs.append(run)
        _row(run, f"1 s, {'batched ' + str(batch) if batch else 'one per call'}")
        if "error" not in run.figures and run.figures["hb_p99_ms"] < 100 and run.figures["hb_errors"] == 0:
            best = n
        else:
            break
    return best, runs


def _row(run: Run, label: str) -> None:
    f = run.figures
    print(f"{run.store:6} N={run.nodes:6} {label:22} rdzv {f.get('rdzv_s', float('nan')):6.2f} s "
          f"(join {f.get('join_s', float('nan')):5.2f})  hb p50 {f.get('hb_p50_ms', float('nan')):7.1f} ms "
          f"p99 {f.get('hb_p99_ms', float('nan')):7.1f} ms  err {f.get('hb_errors', 0):4}  "
          f"cpu {f.get('master_cpu', float('nan')):5.2f} (agents {f.get('swarm_cpu', float('nan')):4.2f})  "
          f"rss/node {f.get('rss_per_node_kb', float('nan')):5.1f} KiB  "
          f"progress {f.get('progress_records_per_s', float('nan')):4.2f}/s  "
          f"lost +{f.get('lost_detect_over_timeout_s', float('nan')):5.2f} s  "
          f"mass {f.get('mass_decisions', '-')} decision(s), {f.get('mass_events_per_s', float('nan')):7.0f} ev/s"
          f"  gc max {max(f.get(f'gc{g}_max_ms', float('nan')) for g in range(3)):4.0f} ms",
          flush=True)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    sizes = args.sizes if args.sizes is not None else [100, 1000] if args.quick else [100, 1000, 10000]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="stead-scale-") as tmp, EtcdServer() as etcd:
        # etcd, a server of its own, runs on either core: started before this process pins itself to the agents'
        # core, whose affinity it would inherit (it starved there behind 10,000 joining agents: writes timed out)
        os.sched_setaffinity(0, {AGENT_CORE})
        workdir = Path(tmp)
        stores = {"sqlite": f"sqlite:///{workdir}/{{n}}.db", "etcd": etcd.url}
        for store, template in [(k, v) for k, v in stores.items() if k in args.stores]:
            for n in sizes:
                if store == "etcd" and n > args.etcd_max:
                    continue
                run = Run(store=store, nodes=n, interval=args.interval)
                name = f"{store}-{n}"
                await attempt(run, template.format(n=name), name, window_s=max(10.0, 3 * args.interval),
                              lost=True, mass=min(n, 1000), batch=0, workdir=workdir)
                _row(run, f"{args.interval:g} s, one per call")
                for key, value in run.figures.items():
                    out[f"{store}_n{n}_{key}"] = value
        if args.no_ladder:
            return out
        ladder = args.ladder or ([500, 1000, 2000] if args.quick else [1000, 2000, 3000, 4000, 6000, 8000, 10000])
        out["hb1s_max_nodes"], _ = await max_nodes(stores["sqlite"], ladder, batch=0, workdir=workdir)
        batched = args.batched or ([1000, 2000] if args.quick else [5000, 6000, 7000, 8000, 10000])
        out["hb1s_batched_max_nodes"], _ = await max_nodes(stores["sqlite"], batched, batch=100, workdir=workdir)
    big = sizes[-1] if sizes else 0
    interval = f"{args.interval:g}"
    result = {
        f"hb{interval}s_n{big}_p99_ms": out.get(f"sqlite_n{big}_hb_p99_ms"),
        f"hb{interval}s_n{big}_master_cpu": out.get(f"sqlite_n{big}_master_cpu"),
        "hb1s_max_nodes": out["hb1s_max_nodes"],
        "hb1s_batched_max_nodes": out["hb1s_batched_max_nodes"],
        "rdzv_n1000_s": out.get("sqlite_n1000_rdzv_s"),
        f"lost_n{big}_detect_over_timeout_s": out.get(f"sqlite_n{big}_lost_detect_over_timeout_s"),
        "mass_failure_n1000_decisions": out.get("sqlite_n1000_mass_decisions"),
        f"etcd_n{big}_hb{interval}s_p99_ms": out.get(f"etcd_n{big}_hb_p99_ms"),
        f"etcd_n{big}_master_cpu": out.get(f"etcd_n{big}_master_cpu"),
        "goals": GOALS,
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()},
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=10.0, help="heartbeat interval of the main runs (s)")
    parser.add_argument("--quick", action="store_true", help="N = 100 and 1,000 only")
    parser.add_argument("--sizes", type=int, nargs="*", help="the N of the main runs (default 100 1000 10000; "
                                                              "none: only the 1 s ladders)")
    parser.add_argument("--ladder", type=int, nargs="*", help="the N tried at 1 s, one heartbeat per call")
    parser.add_argument("--batched", type=int, nargs="*", help="the N tried at 1 s, heartbeats 100 per call")
    parser.add_argument("--etcd-max", type=int, default=10000, help="the largest N run on etcd")
    parser.add_argument("--stores", nargs="*", default=["sqlite", "etcd"], choices=["sqlite", "etcd"])
    parser.add_argument("--no-ladder", action="store_true", help="skip the search for the most nodes at 1 s (a "
                                                                  "partial run: prints the figures, not the summary)")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("master_scale needs 2 cores: the master on one, the simulated agents on the other")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
