"""The master process of bench/master_scale.py: a real master (RPC server, reactor, store) for N simulated nodes.

Run as ``python bench/_scale_master.py --nodes N --store URL --listen-fd FD ...``. It
serves on the listening socket it was handed (so that a restarted master is found
where the last one was), submits the job (MIN = MAX = N) unless the store holds it,
prints one JSON line (address, token, pid) once it serves, and runs until SIGTERM
(or until its stdin closes: the benchmark that started it is gone).
The nodes are launched on a RecordingPlatform: it runs nothing; the simulated
agents of the benchmark register as those nodes, and it says on stdout which
nodes were relaunched or killed, for the benchmark to start or stop them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

from stead.core.config import Settings
from stead.core.events import JobSubmitted
from stead.core.logging import configure_logging
from stead.core.master import Master, MasterConfig
from stead.core.platform import NodeSpec
from stead.testing.platforms import RecordingPlatform


class _Lines:
    """JSON lines for the benchmark on stdout, written by a thread of their own: a benchmark slow to read them (its
    core busy with 10,000 simulated agents) must not stop the master's event loop on a full pipe (it did, for good:
    the master stopped answering heartbeats, lost nodes, and had more relaunches to report)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._write, name="bench-lines", daemon=True).start()

    def send(self, line: dict[str, object]) -> None:
        self._queue.put(json.dumps(line))

    def _write(self) -> None:
        while True:
            print(self._queue.get(), flush=True)


class _ReportingPlatform(RecordingPlatform):
    """Runs nothing; tells the benchmark (a JSON line on stdout) which nodes to start and stop, as a platform would
    start and stop their agents. Incarnation 1 is the benchmark's to start; relaunches are reported."""

    def __init__(self, lines: _Lines) -> None:
        super().__init__()
        self._lines = lines

    async def launch(self, spec: NodeSpec) -> None:
        await super().launch(spec)
        if spec.incarnation > 1:
            self._lines.send({"launch": [spec.node_id, spec.incarnation]})

    async def kill(self, node_id: str, incarnation: int) -> None:
        self._lines.send({"kill": [node_id, incarnation]})
        await super().kill(node_id, incarnation)


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    return NodeSpec(job="", node_id=node_id, incarnation=incarnation, command=("simulated",))


class _GcPauses:
    """How long the garbage collector stopped the master, per generation (written next to the store at exit)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.by_generation: dict[int, list[float]] = {0: [], 1: [], 2: []}
        #: (time.time() at its end, generation, seconds) of each pause over 100 ms
        self.long: list[tuple[float, int, float]] = []
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self.started = now
        else:
            self.by_generation[info["generation"]].append(now - self.started)
            if now - self.started > 0.1:
                self.long.append((time.time(), info["generation"], round(now - self.started, 3)))

    def summary(self) -> dict[str, object]:
        return {"gc_long_pauses": self.long} | {f"gc{g}_{k}": v for g, pauses in self.by_generation.items()
                for k, v in (("count", len(pauses)), ("total_s", round(sum(pauses), 4)),
                             ("max_ms", round(1e3 * max(pauses, default=0.0), 2)))}


async def _serve(args: argparse.Namespace, pauses: _GcPauses) -> None:
    settings = Settings.from_mapping({
        "heartbeat_interval_s": args.interval, "heartbeat_timeout_s": args.timeout, "progress_interval_s": 1.0,
        "health_check": "off", "retry_deadline_s": 120.0})
    lines = _Lines()
    config = MasterConfig(job=args.job, store_url=args.store, settings=settings, platform=_ReportingPlatform(lines),
                          node_spec=_spec, plugins=["diagnosis"], tcp_store=False, listen_fd=args.listen_fd,
                          token_file=str(Path(args.workdir) / f"{args.job}.token"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: sys.stdin.buffer.read1() or stop.set())  # EOF: the benchmark died
    async with Master(config) as master:
        await master.submit_job(JobSubmitted(job=args.job, min_nodes=args.nodes, max_nodes=args.nodes,
                                             nproc_per_node=1, max_restarts=1000, max_node_relaunches=1000,
                                             join_timeout_s=3600.0))
        lines.send({"address": master.address, "token": master.token, "pid": os.getpid()})
        await stop.wait()
        # the pauses while it served (not those of its shutdown)
        (Path(args.workdir) / f"{args.job}.gc.json").write_text(json.dumps(pauses.summary()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--profile", default="", help="write cProfile statistics of the master to this file")
    args = parser.parse_args()
    configure_logging("json", level="warning")
    pauses = _GcPauses()
    if not args.profile:
        asyncio.run(_serve(args, pauses))
        return
    import cProfile

    with cProfile.Profile() as profile:
        asyncio.run(_serve(args, pauses))
    profile.dump_stats(args.profile)


if __name__ == "__main__":
    main()
