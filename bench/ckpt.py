"""Flash checkpoint: how long a save stalls training and how long a restore takes, against the floor and peers.

For each size of CPU state (1 GiB and 4 GiB; ``--quick``: 64 and 256 MiB), in the same run:

* ``floor``: memcpy (libc memmove, one per tensor) into stead's own pre-faulted shared-memory slots, and
  back (the first copy into the slot the first save does not use, so both first copies meet fresh pages);
* ``stead``: FlashCheckpointer.save through a real agent extension and master plugin (in this process),
  the first save (both slots pre-faulted in the background from the size hint) and the steady state;
  restore: load() into the same tensors (the model's parameters) after a restart, once the agent has
  verified the slot's checksums (that verification overlaps the new workers' start; reported apart);
* ``torch.save`` + fsync, and torch.load + copy into the parameters;
* ``dcp.save``, ``dcp.async_save`` (time until it returns: the training stall), and ``dcp.load`` in place;
* the checksum of every tensor byte (XXH3-64, what the agent computes off the training thread) in GB/s
  beside memcpy's, and the sum of words it replaced.

Goals: stead's stall <= 1.1x the floor (first save included), restore <= 1.2x the floor. The steady copies
are timed several times, alternating with the floor's, and compared by their medians; this 2-core VM's
copy speed drifts, so each size prints every sample. The agent and the master run in a child process, as
in a job (in-process they would compete with the copies for the GIL). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog
import torch
import torch.distributed.checkpoint as dcp

from stead.plugins.ckpt import VerifyState, checksum, sum64, tensor_bytes
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.testing import LocalCluster, environ_set
from stead.plugins.ckpt.worker import FlashCheckpointer

GIB = 1 << 30
TENSORS = 32
_MADV_POPULATE_WRITE = 23


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    """A model-like state: TENSORS float32 tensors, every page touched."""
    per = nbytes // TENSORS // 4
    return {f"layer{i}.weight": torch.empty(per, dtype=torch.float32).fill_(i + 0.5) for i in range(TENSORS)}


_SCRATCH = (torch.ones(64 << 20, dtype=torch.uint8), torch.zeros(64 << 20, dtype=torch.uint8))


def warm() -> None:
    """Copy memory for ~0.1 s first: this VM copies at half speed for a moment after it idled."""
    src, dst = _SCRATCH
    for _ in range(8):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes, the machine warmed the same way before every measurement."""
    warm()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _offsets(state: dict[str, torch.Tensor]) -> list[int]:
    offsets, cursor = [], 0
    for tensor in state.values():
        offsets.append(cursor)
        cursor += -(-tensor.numel() * tensor.element_size() // 64) * 64
    return offsets


def _copy_in(state: dict[str, torch.Tensor], offsets: list[int], base: int) -> None:
    for tensor, offset in zip(state.values(), offsets, strict=True):
        ctypes.memmove(base + offset, tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _copy_out(state: dict[str, torch.Tensor], offsets: list[int], base: int) -> None:
    for tensor, offset in zip(state.values(), offsets, strict=True):
        ctypes.memmove(tensor.data_ptr(), base + offset, tensor.numel() * tensor.element_size())


class NodeProcess:
    """The master's ckpt plugin and one node's agent extension in a child process, driven over pipes."""

    def __init__(self, work: Path, *, job: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-node", str(work), job],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def command(self, line: str) -> dict[str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError("the node process died")
        answer = dict(json.loads(reply))
        if "error" in answer:
            raise RuntimeError(f"the node process failed at {line!r}: {answer['error']}")
        return answer

    def round(self, round_: int, restart_count: int) -> dict[str, str]:
        """Start a round (the agent's before_round hook); the environment its worker gets."""
        return self.command(f"round {round_} {restart_count}")

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if self.proc.poll() is None:
                self.command("stop")
        except (RuntimeError, OSError):
            if exc_type is None:
                raise  # else the node process failed first: its error is the one to see
        self.proc.wait(timeout=120)


def make_worker(env: dict[str, str], settings: CheckpointSettings, **kwargs: Any) -> FlashCheckpointer:
    """A FlashCheckpointer as a worker started with ``env`` creates it."""
    with environ_set(env):
        return FlashCheckpointer(rank=0, world_size=1, local_rank=0, settings=settings, **kwargs)


#: the flash checkpoint's settings for a bench: nothing persisted, and patience for slow machines
def bench_settings(work: Path) -> CheckpointSettings:
    return CheckpointSettings(dir=str(work / "stead"), persist_on_failure=False, agent_timeout_s=600,
                              verify_wait_s=600)


def prefaulted_worker(node: NodeProcess, settings: CheckpointSettings,
                      state: dict[str, Any]) -> tuple[FlashCheckpointer, float]:
    """A worker of round 1 of ``node`` sized for ``state``, once its reserve thread has faulted both slots in (one
    after the other, in the background while training starts), and the seconds that took."""
    env = node.round(1, 0)
    started = time.perf_counter()
    ckpt = make_worker(env, settings, size_hint=state)
    ckpt._wait_reserved()
    assert ckpt._reserving is not None
    ckpt._reserving.join()
    return ckpt, time.perf_counter() - started


def serve_node(work: Path, job: str) -> None:
    """``--serve-node``: run the master plugin and an agent; answer ``round R RESTARTS`` with the worker env.

    A failure is answered at once (``{"error": traceback}``) and ends the process without closing the cluster
    (closing waits for the bench's open connections: both processes would hang), its segments freed first."""
    settings = CheckpointSettings(dir=str(work / "stead"), persist_on_failure=False)
    with LocalCluster(work, settings, job=job) as cluster:
        try:
            ext = cluster.agent()
            for line in sys.stdin:
                words = line.split()
                if words[0] == "stop":
                    cluster.stop_agent()
                    print("{}", flush=True)
                    return
                round_, restarts = int(words[1]), int(words[2])
                cluster.round(round_, restart_count=restarts)
                env = {**ext.worker_env(round=round_, local_rank=0), "STEAD_ROUND": str(round_), "STEAD_JOB": job}
                print(json.dumps(env), flush=True)
        except BaseException:
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
            print(json.dumps({"error": error}), flush=True)
            for agent in cluster.agents.values():
                agent._unlink_all()  # os._exit skips the atexit hook that would
            os._exit(1)


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.005)


def bench_size(nbytes: int, repeats: int, work: Path) -> dict[str, Any]:
    state = make_state(nbytes)
    real = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {"bytes": real}

    # -- stead (the agent and the master in another process, as in a job), and the floor in stead's own slots,
    # -- measured alternately so that both see the same machine ------------------------------------------
    settings = bench_settings(work)
    floor_saves: list[float] = []
    floor_restores: list[float] = []
    stead_saves: list[float] = []
    stead_restores: list[float] = []
    offsets = _offsets(state)
    with NodeProcess(work, job=f"bench-{real}") as node:
        ckpt, out["stead_prefault_s"] = prefaulted_worker(node, settings, state)

        def checksummed() -> bool:
            return all(s.checks_seq == s.seq for s in ckpt._ctl.slots() if s.complete)

        # the first copies: the floor into slot 1, the first save into slot 0, both pre-faulted the same way
        spare = ckpt._mapped(1)
        assert spare is not None
        out["floor_first_s"] = timed(lambda: _copy_in(state, offsets, spare.base))
        out["stead_first_s"] = timed(lambda: ckpt.save(1, state))
        assert ckpt._ctl.slot(0).holds(1, 1)
        _wait(checksummed, "the agent's checksums")
        step = 1
        for attempt in range(repeats):
            step += 1
            # the floor writes the slot the next save overwrites anyway: not the one of the committed step
            target = next(s.index for s in ckpt._ctl.slots() if not s.holds(step - 1, 1))
            mapped = ckpt._mapped(target)
            assert mapped is not None

            def floor_save(m: Any = mapped) -> None:
                _copy_in(state, offsets, m.base)

            def stead_save(k: int = step) -> None:
                assert ckpt.save(k, state)

            pair = (floor_save, stead_save) if attempt % 2 == 0 else (stead_save, floor_save)
            for fn in pair:
                (floor_saves if fn is floor_save else stead_saves).append(timed(fn))
            _wait(checksummed, "the agent's checksums")
        ckpt.close()
        for attempt in range(repeats):
            env = node.round(2 + attempt, 1 + attempt)
            started = time.perf_counter()
            restarted = make_worker(env, settings)
            slot = next(s for s in restarted._ctl.slots() if s.holds(step, 1))
            _wait(lambda w=restarted, i=slot.index: w._ctl.slot(i).verify_state is VerifyState.OK,  # type: ignore[misc]
                  "the agent's check")
            out.setdefault("stead_verify_s", time.perf_counter() - started)
            mapped = restarted._mapped(slot.index)
            assert mapped is not None
            mapped.wait_populated()  # faulted in while the new worker starts, like the verification
            out.setdefault("stead_restore_prefault_s", time.perf_counter() - started)

            def floor_restore(m: Any = mapped) -> None:
                _copy_out(state, offsets, m.base)

            def stead_restore(worker: FlashCheckpointer = restarted) -> None:
                assert worker.load(state) is not None

            pair = (floor_restore, stead_restore) if attempt % 2 == 0 else (stead_restore, floor_restore)
            for fn in pair:
                (floor_restores if fn is floor_restore else stead_restores).append(timed(fn))
            restarted.close()
        assert float(state["layer3.weight"][0]) == 3.5
    gc.collect()

    out["floor_s"] = statistics.median(floor_saves)
    out["floor_restore_s"] = statistics.median(floor_restores)
    out["stead_s"] = statistics.median(stead_saves)
    out["stead_restore_s"] = statistics.median(stead_restores)
    out["samples"] = {"floor": [round(x, 4) for x in floor_saves], "stead": [round(x, 4) for x in stead_saves],
                      "floor_restore": [round(x, 4) for x in floor_restores],
                      "stead_restore": [round(x, 4) for x in stead_restores]}

    # -- checksums: XXH3-64 (what stead computes, off the training thread) and the sum of words it replaced -----
    def hash_all(fn: Callable[[memoryview], int]) -> float:
        return min(timed(lambda: [fn(tensor_bytes(t)) for t in state.values()]) for _ in range(3))

    out["checksum_xxh3_s"] = hash_all(checksum)
    out["checksum_sum64_s"] = hash_all(sum64)
    out["checksum_gbps"] = real / out["checksum_xxh3_s"] / 1e9
    out["memcpy_gbps"] = real / out["floor_s"] / 1e9

    # -- torch.save / torch.load ------------------------------------------------------------------------
    path = work / "state.pt"

    def torch_save() -> None:
        with open(path, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())

    out["torch_save_s"] = timed(torch_save)

    def torch_load() -> None:
        loaded = torch.load(path, weights_only=True)
        for key, tensor in state.items():
            tensor.copy_(loaded[key])

    out["torch_load_s"] = timed(torch_load)
    path.unlink()
    gc.collect()

    # -- torch.distributed.checkpoint ---------------------------------------------------------------------
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = work / "dcp"
        out["dcp_save_s"] = timed(lambda: dcp.save(state, checkpoint_id=str(folder), no_dist=True))
        out["dcp_load_s"] = timed(lambda: dcp.load(state, checkpoint_id=str(folder), no_dist=True))
        shutil.rmtree(folder)
        future: list[Any] = []
        out["dcp_async_block_s"] = timed(
            lambda: future.append(dcp.async_save(state, checkpoint_id=str(work / "dcp-async"), no_dist=True)))
        result = future[0]
        (result.upload_completion if hasattr(result, "upload_completion") else result).result()
        shutil.rmtree(work / "dcp-async")
    state.clear()
    gc.collect()
    out["ratio_first"] = out["stead_first_s"] / out["floor_first_s"]
    out["ratio_steady"] = out["stead_s"] / out["floor_s"]
    out["ratio_restore"] = out["stead_restore_s"] / out["floor_restore_s"]
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n >> 20} MiB"


def report(size: dict[str, Any]) -> None:
    name = _gib(size["bytes"])
    print(f"\n{name} of CPU state ({TENSORS} tensors)")
    rows = [
        ("save: memcpy into pre-faulted shm (floor), first", size["floor_first_s"], None),
        ("save: memcpy into pre-faulted shm (floor), steady", size["floor_s"], None),
        ("save: stead FlashCheckpointer, first", size["stead_first_s"], size["ratio_first"]),
        ("save: stead FlashCheckpointer, steady", size["stead_s"], size["ratio_steady"]),
        ("save: torch.save + fsync", size["torch_save_s"], size["torch_save_s"] / size["floor_s"]),
        ("save: dcp.save", size["dcp_save_s"], size["dcp_save_s"] / size["floor_s"]),
        ("save: dcp.async_save (blocking part)", size["dcp_async_block_s"],
         size["dcp_async_block_s"] / size["floor_s"]),
        ("restore: memcpy from shm (floor)", size["floor_restore_s"], None),
        ("restore: stead load() into the parameters", size["stead_restore_s"], size["ratio_restore"]),
        ("restore: torch.load + copy into the parameters", size["torch_load_s"],
         size["torch_load_s"] / size["floor_restore_s"]),
        ("restore: dcp.load in place", size["dcp_load_s"], size["dcp_load_s"] / size["floor_restore_s"]),
    ]
    for label, seconds, ratio in rows:
        shown = f"{ratio:6.2f}x floor" if ratio is not None else ""
        print(f"  {label:<50} {seconds:8.3f} s  {shown}")
    print(f"  (stead, off the training thread: pre-fault both slots {size['stead_prefault_s']:.2f} s from the size "
          f"hint; before a restore, the agent's checksum verification {size['stead_verify_s']:.2f} s and the new "
          f"worker's pre-fault of the slot {size['stead_restore_prefault_s']:.2f} s, both overlapping the new "
          "workers' start)")
    print(f"  checksum of every tensor byte: XXH3-64 {size['checksum_xxh3_s']:.3f} s "
          f"({size['checksum_gbps']:.1f} GB/s; memcpy {size['memcpy_gbps']:.1f} GB/s), "
          f"the sum of words it replaced {size['checksum_sum64_s']:.3f} s")
    print(f"  samples (s): {json.dumps(size['samples'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB and 256 MiB, fewer repeats (< 1 minute)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve-node", nargs=2, metavar=("WORKDIR", "JOB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30),  # warnings and errors only
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if args.serve_node:
        serve_node(Path(args.serve_node[0]), args.serve_node[1])
        return
    sizes = [64 << 20, 256 << 20] if args.quick else [GIB, 4 * GIB]
    repeats = 3 if args.quick else args.repeats
    work = Path(tempfile.mkdtemp(prefix="stead-bench-ckpt-"))
    results = []
    try:
        for nbytes in sizes:
            print(f"measuring {_gib(nbytes)} ...", flush=True)
            results.append(bench_size(nbytes, repeats, work))
            report(results[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {
        _gib(r["bytes"]).replace(" ", ""): {k: (round(v, 4) if isinstance(v, float) else v)
                                            for k, v in r.items() if k != "samples"}
        for r in results
    }
    worst_save = max(max(r["ratio_first"], r["ratio_steady"]) for r in results)
    worst_restore = max(r["ratio_restore"] for r in results)
    print(f"\nworst stead save stall {worst_save:.2f}x the floor (goal <= 1.1), worst restore {worst_restore:.2f}x "
          "(goal <= 1.2)")
    print(json.dumps({"bench": "ckpt", "quick": args.quick, "sizes": figures,
                      "worst_save_ratio": round(worst_save, 3), "worst_restore_ratio": round(worst_restore, 3),
                      "goal_met": worst_save <= 1.1 and worst_restore <= 1.2}))


if __name__ == "__main__":
    main()
