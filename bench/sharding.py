"""Shards leased per second by the master's ShardService over loopback, with 1, 8 and 64 clients.

The master side is the real thing: an ``RpcServer`` serving the sharding plugin's
servicer on a state store, every lease journaled (group commit) before it is
answered. The clients are real ``ShardClient`` connections, one per simulated
worker, run by a second process (as workers are): each leases ``--count`` shards a
call (the sampler's prefetch batching) and reports them consumed in its next call.
Figures count shards (a call may return several) and calls, per store (``memory``,
and ``sqlite``: durable on disk).

The last line is one JSON object with the figures. ``--quick`` runs shorter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stead.core.rpc import RpcServer, new_token
from stead.core.store import open_store
from stead.plugins.sharding.client import ShardClient
from stead.plugins.sharding.ledger import DatasetSpec
from stead.plugins.sharding.service import ShardService, StreamId
from stead.plugins.sharding.servicer import ShardServicer
from stead.plugins.sharding.settings import ShardingSettings

SHARD = 64
#: far more samples than any run leases: the dataset never runs out
SIZE = 10**15
GOAL = 20_000


async def _client(address: str, token: str, dataset: str, rank: int, world: int, count: int,
                  go: asyncio.Event, stop: float) -> tuple[int, int]:
    who = StreamId(dataset, 1, rank, world, f"node-{rank}", f"bench-{rank}")
    calls = slots = have = 0
    async with ShardClient(address, token, call_timeout_s=30) as client:
        reply = await client.lease(who, epoch=0, have=0, count=count, consumed=0, wait_s=30)  # the round starts
        have, leased = len(reply.ranges), sum(e - s for _, s, e in reply.ranges)
        await go.wait()
        while time.perf_counter() < stop:
            reply = await client.lease(who, epoch=0, have=have, count=count, consumed=leased, wait_s=1)
            have += len(reply.ranges)
            got = sum(e - s for _, s, e in reply.ranges)
            leased += got
            slots += got
            calls += 1
    return calls, slots // SHARD


async def _clients(address: str, token: str, dataset: str, world: int, count: int, seconds: float) -> None:
    """(In the client process.) Print {"calls", "shards", "seconds"} for ``world`` concurrent clients."""
    go = asyncio.Event()
    start = time.perf_counter() + 1.0  # every client connected and in the round before the clock starts
    tasks = [asyncio.ensure_future(_client(address, token, dataset, r, world, count, go, start + seconds))
             for r in range(world)]
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    go.set()
    results = await asyncio.gather(*tasks)
    print(json.dumps({"calls": sum(c for c, _ in results), "shards": sum(s for _, s in results),
                      "seconds": seconds}))


async def _measure(store_url: str, world: int, count: int, seconds: float) -> dict[str, float]:
    store = await open_store(store_url)
    token = new_token()
    service = ShardService(store, prefix="/bench/plugins/sharding/v1", settings=ShardingSettings())
    dataset = f"bench-{world}"
    await service.register(DatasetSpec(name=dataset, shard_size=SHARD, size=SIZE, epochs=1))
    try:
        async with RpcServer([ShardServicer(service)], token=token) as server:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--client", server.address, dataset, str(world), str(count),
                str(seconds), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate(token.encode())
            if proc.returncode != 0:
                raise RuntimeError(f"the client process failed with exit code {proc.returncode}")
    finally:
        await store.close()
    result = json.loads(out.decode().strip().splitlines()[-1])
    return {"leases_per_s": result["calls"] / seconds, "shards_per_s": result["shards"] / seconds}


async def _main(args: argparse.Namespace) -> None:
    seconds = 2.0 if args.quick else 6.0
    figures: dict[str, object] = {"bench": "sharding", "shards_per_lease": args.count, "shard_size": SHARD,
                                  "goal_shards_per_s": GOAL}
    print(f"lease calls over loopback, {args.count} shards of {SHARD} samples per call, {seconds:g} s each")
    print(f"{'store':<8} {'clients':>7} {'lease calls/s':>14} {'shards/s':>10}")
    with tempfile.TemporaryDirectory(prefix="stead-bench-") as tmp:
        for name in ("memory", "sqlite"):
            worst = float("inf")
            for world in (1, 8, 64):
                url = "memory://" if name == "memory" else f"sqlite:///{Path(tmp) / f'{world}.db'}"
                r = await _measure(url, world, args.count, seconds)
                print(f"{name:<8} {world:>7} {r['leases_per_s']:>14,.0f} {r['shards_per_s']:>10,.0f}", flush=True)
                figures[f"{name}_{world}_shards_per_s"] = round(r["shards_per_s"])
                figures[f"{name}_{world}_leases_per_s"] = round(r["leases_per_s"])
                worst = min(worst, r["shards_per_s"])
            figures[f"{name}_goal_met"] = worst >= GOAL
    print("sqlite commits with an fsync (synchronous=FULL): one client waits for one per call; "
          "concurrent clients share them (group commit)")
    print(json.dumps(figures))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        address, dataset, world, count, seconds = sys.argv[2:7]
        token = sys.stdin.read().strip()
        asyncio.run(_clients(address, token, dataset, int(world), int(count), float(seconds)))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 s per measurement instead of 6 (under a minute)")
    parser.add_argument("--count", type=int, default=32, help="shards asked for per lease call (default 32)")
    args = parser.parse_args()
    from stead.core.logging import configure_logging

    configure_logging(level="warning")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
