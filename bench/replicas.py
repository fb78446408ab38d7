"""Peer replicas on test hosts (issue 40): a lost host's rank restored from another host's memory, against disk.

Three test hosts (``tests.support.hosts``: network namespaces, each its own address, link, /dev/shm and /tmp,
sharing this bench's folder as machines share a filesystem): an FSDP2 job over gloo on two of them
(``--nnodes 2:2``, one worker per host, ``bench/_replica_train.py``: each rank's shard of the parameters and of
Adam's moments is ``MiB`` MiB, flash-checkpointed every step), the third a spare that offers itself once the job
runs. Each figure comes from a run with replicas (``ckpt.replicas=1``, "peer") and one without
(``ckpt.replicas=0``, "disk": every ``PERSIST_EVERY``-th step is also written to the shared folder, the newest
step every rank wrote is what a replacement can read: a sharded state has no other copy of the lost rank's shard),
for each size:

* **save stall**: the median seconds of ``save()`` on rank 0 while the job runs, over the memcpy floor of the same
  bytes measured in the worker (goal with replicas: <= 1.1x the floor, as without);
* **replica lag and bandwidth** (peer): from each commit to its replicas in place on the other host (the agents'
  ``ckpt_replicated`` lines), and the bytes sent over the seconds spent sending them (the copy out of the slot, the
  transfer and the holder's hash check), against a plain socket copy of as many bytes between the two job hosts
  while they train (goal: >= 0.8x; against the same copy between idle hosts once the job ended, too; and against
  each of two such copies made at once, one each way, as the two hosts' replicas travel: both hosts commit a step
  together and send their replicas together, over the same cores on this machine); each ratio also with each
  host's first two sends left out ("steady": they wait for the holder to allocate and fault its two buffers of
  the rank's replicas, once per job);
* **host loss**: the second job host killed (every process, its memory and link gone) -> every rank of the new
  round (the spare in its place) has finished a step (goal with replicas: <= 1.5 s at 256 MiB, and faster than
  disk), and -> every rank has restored (its ``ckpt_restored`` line); the page cache is dropped at the kill (as
  root), as the files on a shared filesystem would not be in the replacement host's; and the steps every rank had
  finished before the kill that the new round trains again (goal: 0 beyond the last committed step).

The last line is one JSON object with the figures under the issue's names (the 256 MiB run's, or the largest
size run's when it was not run), and each size's under ``by_size``. ``--quick``: 32 MiB only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.hosts import RDZV_PORT, Bench, Failed, _lines, _until, _warm_spare
from tests.support.hosts import Host, Hosts, HostsUnavailable, test_hosts

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bench" / "_replica_train.py"
#: steps every rank has done before the spare is started, and after it is warm before the host is killed
WARM_STEPS = 6
AFTER_SPARE_STEPS = 4
RUN_TIMEOUT_S = 240.0
#: every Nth step is also written to disk (what a restore from disk can go back to), in both modes
PERSIST_EVERY = 10
_RESTORED = re.compile(r"^(\S+) \[info\s*\] ckpt_restored\s", re.MULTILINE)
#: root may drop the page cache: a checkpoint on a shared filesystem is not in the cache of the host that replaces
#: a lost one (here every host shares this machine's cache, so it is dropped at the kill, in both modes)
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_FETCHED = re.compile(r"ckpt_replica_fetched\s.*?seconds=([\d.]+)")
_REPLICATED = re.compile(r"ckpt_replicated\s.*?bytes=(\d+).*?lag_s=([\d.]+).*?sending_s=([\d.]+)")

_SOCKET_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(8 << 20); view = memoryview(buf); got = 0; began = None
while True:
    n = c.recv_into(view)
    if not n:
        break
    began = began or time.perf_counter(); got += n
c.sendall(b"done")
print(got, flush=True)
"""
_SOCKET_SENDER = """
import socket, sys, time
n = int(sys.argv[3]); data = bytearray(n)
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
time.sleep(max(0.0, float(sys.argv[4]) - time.time()))
began = time.perf_counter(); c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(4)
print(n / (time.perf_counter() - began), flush=True)
"""


def _stalls(path: Path, rank: int) -> tuple[float | None, list[float]]:
    floor, saves = None, []
    for line in path.read_text().splitlines() if path.exists() else []:
        who, kind, value = line.split()
        if int(who) != rank:
            continue
        if kind == "floor":
            floor = float(value)
        else:
            saves.append(float(value))
    return floor, saves


def _first_after(stamps: Path, after: float, rank: int) -> tuple[int, float] | None:
    steps = [(int(step), when) for r, _, step, when in _lines(stamps) if r == rank and step.isdigit() and when > after]
    return min(steps, key=lambda s: s[1]) if steps else None


async def _socket_bandwidth(sender: Host, receiver: Host, nbytes: int) -> float:
    """Bytes per second of one plain TCP copy of ``nbytes`` from ``sender`` to ``receiver``."""
    return (await _socket_copies([(sender, receiver)], nbytes))[0]


async def _socket_copies(pairs: list[tuple[Host, Host]], nbytes: int) -> list[float]:
    """Bytes per second of each of plain TCP copies of ``nbytes`` made at once, one per (sender, receiver) pair."""
    procs = [await receiver.spawn([sys.executable, "-c", _SOCKET_RECEIVER, receiver.address],
                                  stdout=asyncio.subprocess.PIPE) for _, receiver in pairs]
    try:
        ports = []
        for proc in procs:
            assert proc.stdout is not None
            ports.append(int((await asyncio.wait_for(proc.stdout.readline(), 30)).decode()))
        start = time.time() + 2.0  # (each sender's start and allocation done: they send together)
        results = await asyncio.gather(*(sender.run([sys.executable, "-c", _SOCKET_SENDER, receiver.address,
                                                     str(port), str(nbytes), str(start)])
                                         for (sender, receiver), port in zip(pairs, ports, strict=True)))
        for rc, _, err in results:
            if rc != 0:
                raise Failed(f"the plain socket copy failed: {err[-500:]}")
        return [float(out.split()[-1]) for _, out, _ in results]
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


class ReplicaBench(Bench):
    async def host_loss(self, hosts: Hosts, mib: int, replicas: int) -> dict[str, float | int | None]:  # type: ignore[override]
        run = self.new_run(f"{'peer' if replicas else 'disk'}-{mib}")
        stamps, stalls = run / "steps.txt", run / "stalls.txt"
        argv = [sys.executable, "-m", "stead", "run", "--log-level", "debug",  # the agents' ckpt_replicated lines
                "--nnodes", "2:2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{RDZV_PORT}", "--rdzv-id",
                run.name, "--max-restarts", "3", "--set", f"ckpt.replicas={replicas}",
                "--set", f"ckpt.dir={run / 'checkpoints'}", str(TRAIN), "--mib", str(mib),
                "--persist-every", str(PERSIST_EVERY),
                "--timestamps", str(stamps), "--stalls", str(stalls)]
        procs = [await self.launch(hosts[i], run, argv) for i in (0, 1)]

        def past(step: int) -> bool:
            return len({r for r, _, s, _ in _lines(stamps) if s.isdigit() and int(s) >= step}) >= 2
        try:
            await _until(lambda: past(WARM_STEPS), f"both ranks past step {WARM_STEPS}", procs, RUN_TIMEOUT_S)
            procs.append(await self.launch(hosts[2], run, argv))
            log = run / f"{hosts[2].name}.log"
            await _until(lambda: log.exists() and _warm_spare(log.read_text(errors="replace")),
                         "spare host accepted and warm", procs, RUN_TIMEOUT_S)
            now = max(int(s) for _, _, s, _ in _lines(stamps) if s.isdigit())
            await _until(lambda: past(now + AFTER_SPARE_STEPS), "steps after the spare joined", procs, RUN_TIMEOUT_S)
            loaded = both_ways = None
            if replicas:  # a plain socket copy of one replica's bytes between the two job hosts, as they train
                _, _, step_bytes = _replicated(run)
                if step_bytes:
                    loaded = await _socket_bandwidth(hosts[0], hosts[1], step_bytes)
                    # and two at once, one each way: both hosts commit a step together and send its replicas
                    # together, over the same cores here
                    both_ways = statistics.mean(await _socket_copies([(hosts[0], hosts[1]), (hosts[1], hosts[0])],
                                                                     step_bytes))
            _drop_page_cache()  # the checkpoint files are not in the replacement host's page cache
            killed = time.time()
            done = min(max((int(s) for r, _, s, w in _lines(stamps) if r == rank and s.isdigit() and w <= killed),
                           default=-1) for rank in (0, 1))
            await hosts.kill(1)
            firsts = await _until(lambda: (lambda a, b: (a, b) if a and b else None)(
                _first_after(stamps, killed, 0), _first_after(stamps, killed, 1)),
                "both ranks stepping after the kill", [procs[0], procs[2]], RUN_TIMEOUT_S)
        except Failed as exc:
            raise Failed(f"{exc}:\n{self.tail(run)}") from None
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGINT)
        assert isinstance(firsts, tuple)
        restored = firsts[1][0] - 1
        floor, saves = _stalls(stalls, 0)
        before = saves[2:] or saves  # the first saves allocate and fault their slots
        lags, rate, step_bytes = _replicated(run)
        steady = _steady_rate(run)
        restored_at = [datetime.datetime.fromisoformat(m.group(1)).timestamp() for name in ("h0.log", "h2.log")
                       for m in _RESTORED.finditer((run / name).read_text(errors="replace"))]
        restored_at = [t for t in restored_at if t > killed]
        fetched = [float(m.group(1)) for m in _FETCHED.finditer((run / "h2.log").read_text(errors="replace"))]
        for proc in procs:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 60)
        return {"host_loss_s": round(max(w for _, w in firsts) - killed, 3), "restored_step": restored,
                "restored_s": round(max(restored_at) - killed, 3) if len(restored_at) >= 2 else None,
                "replica_fetch_s": fetched[0] if fetched else None,
                "steps_rolled_back": max(0, done - restored), "save_stall_s": _median(before),
                "memcpy_floor_s": floor, "replica_lag_s": _median(lags), "replica_bytes_per_s": rate,
                "replica_steady_bytes_per_s": steady,
                "replica_step_bytes": step_bytes,
                "socket_loaded_bytes_per_s": None if loaded is None else round(loaded),
                "socket_loaded_both_ways_bytes_per_s": None if both_ways is None else round(both_ways)}


def _drop_page_cache() -> None:
    with contextlib.suppress(OSError):  # (not root: the cache stays, and disk reads look faster than they are)
        DROP_CACHES.write_text("1\n")


def _replicated(run: Path) -> tuple[list[float], int | None, int]:
    """From the job hosts' ckpt_replicated lines: the lags, the bytes per second sent, and one step's bytes."""
    lags, sent, sending = [], 0, 0.0
    for sizes, lag, seconds in _sends(run):
        sent += sizes
        lags.append(lag)
        sending += seconds
    return lags, round(sent / sending) if sending else None, sent // len(lags) if lags else 0


def _steady_rate(run: Path) -> int | None:
    """The bytes per second sent, each host's first two sends left out (they wait for the holder to allocate and
    fault its two buffers of the rank's replicas: once per job, not per step)."""
    sends = [s for host in _sends(run, per_host=True) for s in host[2:]]
    sending = sum(seconds for _, _, seconds in sends)
    return round(sum(sizes for sizes, _, _ in sends) / sending) if sending else None


def _sends(run: Path, *, per_host: bool = False) -> list[Any]:
    """(bytes, lag, sending seconds) of each send the job hosts' ckpt_replicated lines tell (a list per host)."""
    hosts = []
    for name in ("h0.log", "h1.log"):
        log = run / name
        hosts.append([(int(m.group(1)), float(m.group(2)), float(m.group(3)))
                      for m in _REPLICATED.finditer(log.read_text(errors="replace") if log.exists() else "")])
    return hosts if per_host else [s for host in hosts for s in host]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


async def _measure(sizes: list[int], keep: bool = False) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix="stead-bench-replicas-"))
    bench = ReplicaBench(workdir)
    shared = (ROOT, Path(sys.prefix), workdir)
    by_size: dict[str, dict[str, object]] = {}
    try:
        for mib in sizes:
            figures: dict[str, object] = {}
            for replicas in (1, 0):
                mode = "peer" if replicas else "disk"
                try:
                    async with test_hosts(3, shared=shared, skip_unavailable=False) as hosts:
                        got = await bench.host_loss(hosts, mib, replicas)
                        if replicas and got["replica_step_bytes"]:  # (the job stopped; h1 is gone)
                            figures["socket_idle_bytes_per_s"] = round(await _socket_bandwidth(
                                hosts[0], hosts[2], int(got["replica_step_bytes"])))
                except Failed as exc:
                    print(f"{mib} MiB, {mode}: no figure: {exc}", flush=True)
                    figures[f"{mode}_note"] = str(exc).splitlines()[0]
                    continue
                figures.update({f"{mode}_{k}": v for k, v in got.items()})
                print(f"{mib:5d} MiB/node {mode:<4}: host lost -> every rank restored {got['restored_s']} s, stepping "
                      f"again {got['host_loss_s']} s, restored "
                      f"step {got['restored_step']}, {got['steps_rolled_back']} step(s) trained again; save stall "
                      f"{got['save_stall_s']} s (memcpy {got['memcpy_floor_s']} s)"
                      + (f"; the spare fetched its rank's replica in {got['replica_fetch_s']} s"
                         f"; replicas in place {got['replica_lag_s']} s after commit, "
                         f"{(got['replica_bytes_per_s'] or 0) / 1e6:.0f} MB/s (each host's first two left "
                         f"out: {(got['replica_steady_bytes_per_s'] or 0) / 1e6:.0f} MB/s; a plain socket copy "
                         f"{(got['socket_loaded_bytes_per_s'] or 0) / 1e6:.0f} MB/s, each of two at once both ways "
                         f"{(got['socket_loaded_both_ways_bytes_per_s'] or 0) / 1e6:.0f} MB/s)" if replicas else ""),
                      flush=True)
            by_size[str(mib)] = figures
    finally:
        if keep:
            print(f"the runs' folders are kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    key = "256" if "256" in by_size else str(max(sizes))
    main = by_size.get(key, {})

    def ratio(a: object, b: object, digits: int = 3) -> float | None:
        return round(a / b, digits) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

    result: dict[str, object] = {
        "bench": "replicas", "mib_per_node": int(key), "hosts": 3,
        "save_stall_ratio_replicated": ratio(main.get("peer_save_stall_s"), main.get("peer_memcpy_floor_s")),
        "save_stall_ratio_unreplicated": ratio(main.get("disk_save_stall_s"), main.get("disk_memcpy_floor_s")),
        "replica_lag_s": main.get("peer_replica_lag_s"),
        "replica_bandwidth_ratio": ratio(main.get("peer_replica_bytes_per_s"),
                                         main.get("peer_socket_loaded_bytes_per_s")),
        "replica_bandwidth_ratio_both_ways": ratio(main.get("peer_replica_bytes_per_s"),
                                                   main.get("peer_socket_loaded_both_ways_bytes_per_s")),
        "replica_bandwidth_ratio_steady": ratio(main.get("peer_replica_steady_bytes_per_s"),
                                                main.get("peer_socket_loaded_bytes_per_s")),
        "replica_bandwidth_ratio_steady_both_ways": ratio(main.get("peer_replica_steady_bytes_per_s"),
                                                          main.get("peer_socket_loaded_both_ways_bytes_per_s")),
        "replica_bandwidth_ratio_idle_link": ratio(main.get("peer_replica_bytes_per_s"),
                                                   main.get("socket_idle_bytes_per_s")),
        "host_loss_peer_s": main.get("peer_host_loss_s"),
        "host_loss_disk_s": main.get("disk_host_loss_s"),
        "host_loss_peer_restored_s": main.get("peer_restored_s"),
        "host_loss_disk_restored_s": main.get("disk_restored_s"),
        "host_loss_peer_fetch_s": main.get("peer_replica_fetch_s"),
        "host_loss_steps_rolled_back": main.get("peer_steps_rolled_back"),
        "host_loss_disk_steps_rolled_back": main.get("disk_steps_rolled_back"),
        "by_size": by_size,
    }
    peer, disk = result["host_loss_peer_s"], result["host_loss_disk_s"]
    if isinstance(peer, float):
        result["host_loss_goal_met"] = (peer <= 1.5 or int(key) != 256) and (not isinstance(disk, float)
                                                                              or peer < disk)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB per node only")
    parser.add_argument("--sizes", default="256,1024", help="MiB of state per node, comma-separated")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (logs) and say where")
    args = parser.parse_args()
    sizes = [32] if args.quick else [int(s) for s in args.sizes.split(",")]
    try:
        result = asyncio.run(_measure(sizes, args.keep))
    except HostsUnavailable as exc:
        raise SystemExit(f"bench/replicas.py needs test hosts (network namespaces): {exc}") from None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
