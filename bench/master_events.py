"""Events appended and folded per second by the master's reactor, per store backend.

For each store (memory, sqlite, etcd: a real server started here on a free
loopback port) it measures, in the same run:

* ``raw``: atomic batched key creation straight on the store (the floor the log stands on),
* ``reactor batched``: ``Reactor.submit_many`` with batches of 64 events: append + fold + deliver,
* ``reactor single``: one ``Reactor.submit`` per event (one store round trip each).

The last line is one JSON object with the figures. ``--quick`` runs a smaller set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stead.core.config import Settings
from stead.core.events import JobSubmitted, StepProgress
from stead.core.events.log import EventLog
from stead.core.master.reactor import Reactor
from stead.core.statemachine import Effect
from stead.core.store import StateStore, open_store

BATCH = 64


class _NoEffects:
    async def run(self, effect: Effect) -> None:
        return None


async def _raw(store: StateStore, n: int) -> float:
    prefix = f"/bench/{uuid.uuid4().hex}/"
    start = time.perf_counter()
    for i in range(0, n, BATCH):
        keys = range(i, min(n, i + BATCH))
        await store.create_all([(f"{prefix}{j:020d}", b'{"type":"progress.step"}') for j in keys])
    return n / (time.perf_counter() - start)


async def _reactor(store: StateStore, n: int, *, batch: int) -> float:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    settings = Settings(snapshot_every=10**9)
    async with Reactor(EventLog(store, job), _NoEffects(), settings=settings) as reactor:
        await reactor.resume()
        await reactor.submit(JobSubmitted(job=job, min_nodes=1, max_nodes=1, nproc_per_node=1))
        events = [StepProgress(round=1, step=i) for i in range(n)]
        start = time.perf_counter()
        for i in range(0, n, batch):
            await reactor.submit_many(events[i:i + batch])
        elapsed = time.perf_counter() - start
        assert reactor.state.step == n - 1
    return n / elapsed


async def _measure(url: str, n: int, n_single: int) -> dict[str, float]:
    store = await open_store(url)
    try:
        return {
            "raw": await _raw(store, n),
            "batched": await _reactor(store, n, batch=BATCH),
            "single": await _reactor(store, n_single, batch=1),
        }
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events (under a minute)")
    args = parser.parse_args()
    from stead.core.logging import configure_logging

    configure_logging(level="warning")
    n, n_single = (3_000, 300) if args.quick else (30_000, 2_000)
    results: dict[str, dict[str, float]] = {}
    from stead.testing.etcd import EtcdServer

    with tempfile.TemporaryDirectory() as tmp, EtcdServer() as etcd:
        for name, url in (("memory", "memory://"), ("sqlite", f"sqlite:///{tmp}/bench.db"), ("etcd", etcd.url)):
            results[name] = asyncio.run(_measure(url, n, n_single))
    print(f"{'store':<8} {'raw create_all/s':>18} {'reactor batched/s':>18} {'reactor single/s':>17} "
          f"{'batched/raw':>12}")
    for name, r in results.items():
        print(f"{name:<8} {r['raw']:>18,.0f} {r['batched']:>18,.0f} {r['single']:>17,.0f} "
              f"{r['batched'] / r['raw']:>12.2f}")
    figures = {"bench": "master_events", "events": n, "batch": BATCH}
    for name, r in results.items():
        figures[f"{name}_batched_per_s"] = round(r["batched"])
        figures[f"{name}_single_per_s"] = round(r["single"])
        figures[f"{name}_raw_per_s"] = round(r["raw"])
    figures["etcd_goal_met"] = results["etcd"]["batched"] >= 5_000
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
