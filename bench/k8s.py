"""Relaunching many pods on Kubernetes: from the relaunch decision until the informer has seen them all Running.

The Kubernetes platform (``stead.platforms.k8s``) runs against the test API server
(``tests.support.kube.FakeKubeApi``: the real REST and watch protocol over HTTP, with
20 ms of latency added to every request, as ``--latency-ms`` says) and a fake kubelet
that marks each bound pod Running without running it. For N = 30 and 300 nodes, every
node is launched and seen Running; then all of them are relaunched at once, as a mass
failure makes the master do (the old pods deleted, a new incarnation of each launched),
and the time runs from that decision until ``events()`` reported every new incarnation
started, which the platform does when its informer sees the pod Running.

In the same run, the same relaunch with ``k8s.create_concurrency=1`` (one pod at a time,
what a queue drained by one worker does) shows what concurrent creation buys. The
reference system's users measured about 10 minutes for 30 relaunched pods (its pods are
created from a queue drained every 3 s); that figure is theirs, not this machine's.

    python bench/k8s.py            # 30 and 300 nodes
    python bench/k8s.py --quick    # the same (it takes seconds)

The last line is JSON: ``relaunch_30_s``, ``relaunch_300_s`` and the one-at-a-time figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stead.core.config import Settings
from stead.core.events import NodeStarted
from stead.core.logging import configure_logging
from stead.core.platform import NodeSpec
from stead.platforms.k8s import SECRETS, K8sPlatform, K8sSettings, Kube
from stead.platforms.k8s.pods import token_secret
from tests.support.kube import FakeKubeApi, FakeKubelet

JOB = "bench"
IMAGE = "stead:bench"
#: a guard against a hung run, not a measured figure
TIMEOUT_S = 300.0


def _spec(index: int, incarnation: int) -> NodeSpec:
    return NodeSpec(job=JOB, node_id=f"node-{index}", incarnation=incarnation,
                    command=("python", "-m", "stead", "agent", "--master", "x:1", "--token-file", "t",
                             "--node-id", f"node-{index}", "--incarnation", str(incarnation)))


async def _started(events: object, want: set[tuple[str, int]]) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async for event in events:  # type: ignore[attr-defined]
            if isinstance(event, NodeStarted):
                want.discard((event.node_id, event.incarnation))
            if not want:
                return


async def relaunch(nodes: int, *, latency_s: float, concurrency: int) -> dict[str, float]:
    """Launch ``nodes`` pods, then relaunch them all; the seconds each phase took until every pod was Running."""
    hosts = tuple(f"host-{i}" for i in range(max(3, nodes // 50)))
    async with FakeKubeApi() as api, FakeKubelet(api.url, nodes=hosts, run=False, max_pods_per_node=nodes,
                                                 images={IMAGE: {}}):
        settings = K8sSettings(api_url=api.url, namespace="default", image=IMAGE, create_concurrency=concurrency,
                               master_host="127.0.0.1")
        async with Kube(settings, pool=2) as kube:  # the job's token Secret, which node pods mount
            await kube.create(SECRETS, token_secret(JOB, "default", "b" * 43), exist_ok=True)
        api.latency_s = latency_s
        async with K8sPlatform(Settings(shutdown_grace_s=30.0), settings, environ={}) as platform:
            events = platform.events()
            begin = time.perf_counter()
            async with anyio.create_task_group() as tasks:
                for i in range(nodes):
                    tasks.start_soon(platform.launch, _spec(i, 1))
            await _started(events, {(f"node-{i}", 1) for i in range(nodes)})
            first = time.perf_counter() - begin
            begin = time.perf_counter()  # the relaunch decision: every node killed and launched again at once
            async with anyio.create_task_group() as tasks:
                for i in range(nodes):
                    tasks.start_soon(platform.kill, f"node-{i}", 1)
                    tasks.start_soon(platform.launch, _spec(i, 2))
            await _started(events, {(f"node-{i}", 2) for i in range(nodes)})
            again = time.perf_counter() - begin
        return {"launch_s": first, "relaunch_s": again}


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="the same run (it is short already)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="latency the API server adds to a request")
    parser.add_argument("--sizes", default="30,300", help="node counts (comma-separated)")
    args = parser.parse_args(argv)
    configure_logging("console", level="warning")  # a line per pod would drown the figures
    latency = args.latency_ms / 1000
    sizes = [int(s) for s in args.sizes.split(",")]
    figures: dict[str, float] = {}
    print(f"API server latency {args.latency_ms:g} ms per request; the kubelet marks pods Running without "
          "running them", flush=True)
    print(f"{'nodes':>6} {'creation':>12} {'first launch':>13} {'relaunch all':>13}", flush=True)
    for nodes in sizes:
        for concurrency, label in ((64, "concurrent"), (1, "one by one")):
            if concurrency == 1 and nodes > 30 and args.quick:
                continue
            found = await relaunch(nodes, latency_s=latency, concurrency=concurrency)
            print(f"{nodes:>6} {label:>12} {found['launch_s']:>12.2f}s {found['relaunch_s']:>12.2f}s", flush=True)
            suffix = "" if concurrency > 1 else "_one_by_one"
            figures[f"relaunch_{nodes}{suffix}_s"] = round(found["relaunch_s"], 3)
            figures[f"launch_{nodes}{suffix}_s"] = round(found["launch_s"], 3)
    print("the reference system: about 600 s for 30 relaunched pods (its users' measurement, not this run's)")
    if "relaunch_300_s" in figures:
        print(f"goal: 300 relaunched in < 5 s: {'met' if figures['relaunch_300_s'] < 5 else 'not met'} "
              f"({figures['relaunch_300_s']:.2f} s)")
    print(json.dumps({"bench": "k8s", "latency_ms": args.latency_ms, **figures}))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(anyio.run(main, sys.argv[1:]))
