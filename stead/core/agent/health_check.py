"""A node's part of a health check, run by its agent as a worker process (``python -m stead.core.agent.health_check``).

It reads its orders as JSON from ``STEAD_HEALTH_ORDERS`` (check, nodes, index, store_host,
store_port, timeout_s), times a matmul on the node's device (the first GPU, or the CPU), posts
the time to the check's store, and all-reduces with one partner per stage
(:func:`stead.core.statemachine.health.stages`; gloo on CPU, NCCL on GPU). Each all-reduce's
result is checked, so a link that corrupts data fails like one that breaks. It prints one JSON
line on stdout: ``matmul_s``, ``collectives`` (peer, seconds or error), ``device`` and ``error``.

``STEAD_FAULT_HEALTH=NODE:INCARNATION:KIND`` injects a fault into that node incarnation's check,
for tests and demos: ``slow`` (each timed matmul does 4x the work), ``fail`` (the matmul raises);
``host:HOST:KIND`` into the check of every node on that host (its platform's name for it,
``STEAD_NODE_HOST``): a faulty machine.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from stead.core.platform import HOST_ENV
from stead.core.statemachine.health import stages

__all__ = ["FAULT_ENV", "ORDERS_ENV", "main"]

ORDERS_ENV = "STEAD_HEALTH_ORDERS"
FAULT_ENV = "STEAD_FAULT_HEALTH"
#: the matmul: (size x size) @ (size x size), the best of REPEATS (what the hardware can do)
_CPU_SIZE, _GPU_SIZE, _REPEATS = 768, 4096, 20
#: the all-reduce: this many float32 values, timed over REPEATS after one that connects
_CPU_VALUES, _GPU_VALUES, _ALLREDUCE_REPEATS = 256 * 1024, 16 * 1024 * 1024, 3
#: the share of the timeout the matmul times of the other nodes are waited for
_WAIT_SHARE = 0.5


def _fault(node: str, incarnation: int, env: Mapping[str, str]) -> str:
    wanted = env.get(FAULT_ENV, "")
    target, _, kind = wanted.rpartition(":")
    host = env.get(HOST_ENV, "")
    return kind if target == f"{node}:{incarnation}" or (host and target == f"host:{host}") else ""


def _device(torch: Any) -> tuple[Any, str]:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index), f"cuda:{index} {torch.cuda.get_device_name(index)}"
    return torch.device("cpu"), "cpu"


def _matmul_s(torch: Any, device: Any, fault: str) -> float:
    """The best time of a matmul: GPU wall time, or on CPU the process's CPU time on one thread (a node's
    workers or neighbours on a shared machine take turns on the cores, which no wall clock on a CPU hides)."""
    if fault == "fail":
        raise RuntimeError(f"injected fault ({FAULT_ENV})")
    gpu = device.type == "cuda"
    size = _GPU_SIZE if gpu else _CPU_SIZE
    if not gpu:
        torch.set_num_threads(1)
    clock = time.perf_counter if gpu else time.process_time
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(_REPEATS):
        start = clock()
        for _ in range(4 if fault == "slow" else 1):  # a slow node: the same work takes four times as long
            c = a @ b
        if gpu:
            torch.cuda.synchronize(device)
        best = min(best, clock() - start)
    if not bool(torch.isfinite(c).all()):
        raise RuntimeError("the matmul gave non-finite values on random inputs: the device computes wrongly")
    return best


def _allreduce_s(torch: Any, dist: Any, store: Any, rank: int, device: Any, timeout_s: float) -> float:
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        group = dist.ProcessGroupNCCL(store, rank, 2)
    else:
        group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    values = _GPU_VALUES if device.type == "cuda" else _CPU_VALUES
    tensor = torch.ones(values, device=device)
    group.allreduce([tensor]).wait(timeout)  # the first one connects the pair
    start = time.perf_counter()
    for _ in range(_ALLREDUCE_REPEATS):
        group.allreduce([tensor]).wait(timeout)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    expected = float(2 ** (_ALLREDUCE_REPEATS + 1))
    if not bool((tensor == expected).all()):
        raise RuntimeError(f"the all-reduce gave wrong values (expected {expected:g} everywhere)")
    if hasattr(group, "shutdown"):
        group.shutdown()
    return elapsed / _ALLREDUCE_REPEATS


def run(orders: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """This node's part of the check; never raises (what went wrong is in ``error`` or per collective)."""
    import torch
    import torch.distributed

    dist: Any = torch.distributed  # torch's stubs do not export the store classes
    deadline = time.monotonic() + float(orders["timeout_s"])
    nodes: list[str] = list(orders["nodes"])
    me: int = int(orders["index"])
    result: dict[str, Any] = {"matmul_s": None, "collectives": [], "device": "", "error": ""}
    fault = _fault(nodes[me], int(orders["incarnation"]), env)
    device = torch.device("cpu")
    try:
        device, result["device"] = _device(torch)
        result["matmul_s"] = _matmul_s(torch, device, fault)
    except Exception as exc:
        result["error"] = f"matmul: {type(exc).__name__}: {exc}"
    if len(nodes) < 2:
        return result
    try:
        store = dist.TCPStore(orders["store_host"], int(orders["store_port"]), is_master=False, use_libuv=True,
                              timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
        check = dist.PrefixStore(f"health/{orders['check']}/", store)
        check.set(f"matmul/{me}", json.dumps(result["matmul_s"]))
    except Exception as exc:  # this node cannot reach the job's store: its network is in doubt
        result["error"] = result["error"] or f"store: {type(exc).__name__}: {exc}"
        return result
    try:
        wait_s = max(1.0, (deadline - time.monotonic()) * _WAIT_SHARE)
        check.wait([f"matmul/{i}" for i in range(len(nodes))], datetime.timedelta(seconds=wait_s))
        times = [json.loads(check.get(f"matmul/{i}")) for i in range(len(nodes))]
    except Exception:  # another node never posted (it died, or failed to reach the store): no pairs, no blame here
        return result
    plan = stages(len(nodes), times)
    for number, pairs in enumerate(plan, start=1):
        pair = next((p for p in pairs if me in p), None)
        if pair is None:
            continue
        peer = nodes[pair[1] if pair[0] == me else pair[0]]
        left = deadline - time.monotonic()
        entry: dict[str, Any] = {"peer": peer, "seconds": None, "error": ""}
        try:
            if left < 1.0:
                raise TimeoutError("no time left in the check")
            pair_store = dist.PrefixStore(f"stage{number}/{pair[0]}-{pair[1]}/", check)
            entry["seconds"] = _allreduce_s(torch, dist, pair_store, pair.index(me), device,
                                            left / (len(plan) - number + 1))
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        result["collectives"].append(entry)
    return result


def main() -> int:
    orders = json.loads(os.environ[ORDERS_ENV])
    print(json.dumps(run(orders, os.environ)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
