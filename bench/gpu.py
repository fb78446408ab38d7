"""The GPU paths on a real GPU: flash checkpoint from CUDA memory, ``overlap`` mode, NVML, a GPU job that recovers.

For each size of CUDA state (1, 4 and 16 GiB; ``--quick``: 256 MiB and 1 GiB; ``--sizes``), in the same run:

* ``floor``: a synchronous device-to-host copy (cudaMemcpy, ``copy_(non_blocking=False)``) of each tensor into
  stead's own shared-memory slot, registered as pinned memory (``cudaHostRegister``) the way stead does; and
  host-to-device back from it for the restore;
* ``stead``: FlashCheckpointer.save from the CUDA tensors through a real agent extension and master plugin
  (in a child process, as in bench/ckpt.py): the first save and the steady state, alternating with the
  floor (the size hint had both slots pre-faulted and registered in the background); restore: load() into
  the same CUDA tensors after a restart (the new worker registers the slot in the background as it starts:
  ``cudaHostRegister`` timed apart as ``pin_s``), against the pinned floor and a pageable one;
* ``torch.save`` + fsync and ``dcp.async_save``'s blocking part (``--peers-max-gib``: up to which size);
* at the first size only, ``copy_mode="overlap"``: the training stream runs a matmul workload (the next
  step's forward and backward, twice the copy's time) right after save() returns; its stall is how much
  longer that workload takes to finish than alone, against the copy's own time (goal: <= 0.1x);
* NVML as the agent reads it (stead.core.agent.gpu.GpuHealth: memory in use, utilisation, problems) beside
  ``nvidia-smi --query-gpu``'s answer, with a known amount of memory allocated;
* a 1-node, 1-worker ``stead run`` job (bench/_gpu_train.py: a small model on CUDA, gloo, a step every
  0.4 s) that saves flash checkpoints, crashes once and recovers: seconds from the crash to the first step
  after, and whether the restored CUDA tensors hash as they did when saved; its log is kept in
  ``$OUT/gpu_job.log`` and its warnings printed. Without a GPU this part runs on CPU (its figures are
  printed, the JSON's GPU values stay null).

Goals (issue 44): save stall <= 1.1x the floor from 1 GiB up; restore <= 1.2x; overlap stall <= 0.1x the
copy; bit-identical tensors after recovery. Without CUDA every GPU part prints that it is skipped and the last
line is the JSON object all the same, its values null. Last line: one JSON object, also written to
``$OUT/gpu.json`` when OUT is set.

On a GPU machine with no package index: ``sh bench/gpu_wheels.sh`` here (it fills ``.whl/``, ignored by git),
then there, from the repository's root with ``.whl`` carried along::

    python3 -c "import zipfile,glob;[zipfile.ZipFile(w).extractall('.whl/site') for w in glob.glob('.whl/*.whl')]" \
      && rm -rf .whl/site/stead && export PYTHONPATH=$PWD/.whl/site:$PWD PYTHONUNBUFFERED=1 \
      && python3 -m pytest -q -p no:cacheprovider tests/plugins/ckpt/test_cuda.py tests/plugins/ckpt/test_overlap.py \
      && timeout 540 python3 bench/gpu.py 2>&1 | tee $OUT/gpu.log

The whole run takes ~4 minutes on an H100 (the 16 GiB torch.save and dcp.async_save half of it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog
import torch
import torch.distributed.checkpoint as dcp

from bench.ckpt import NodeProcess, _offsets, _wait, bench_settings, make_worker, prefaulted_worker
from stead.core.agent.gpu import GpuHealth
from stead.plugins.ckpt import VerifyState
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import FlashCheckpointer

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
TENSORS = 16
TRAIN = ROOT / "bench" / "_gpu_train.py"
#: the job takes ~40 s on a GPU; this only ends a hung one
JOB_TIMEOUT_S = 240
#: the job's pace: its crash (at step 42) comes ~17 s after its worker started, once the agent's standby zygote
#: (a Python with torch imported: 7 s on the H100 machine) is ready, as in a job that has run a while. Crashing
#: 4 s in (the GPU's own pace) measured the standby's start: 6.3 s instead of the restart's 0.6 s.
JOB_STEP_S = 0.4
#: the overlap workload runs this many times longer than the copy alone (so the copy can hide behind it)
OVERLAP_WORK_FACTOR = 2.0


def log(line: str) -> None:
    print(line, flush=True)


def _gib(n: int) -> str:
    return f"{n / GIB:g} GiB" if n >= GIB else f"{n >> 20} MiB"


def _sync() -> None:
    torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes, the device idle before and after (every queued copy counted)."""
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    per = nbytes // TENSORS // 4
    return {f"layer{i}.weight": torch.empty(per, dtype=torch.float32, device="cuda").fill_(i + 0.5)
            for i in range(TENSORS)}


def _views(mapped: Any, state: dict[str, torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    return [mapped.view(off, t.numel() * t.element_size(), t.dtype, tuple(t.shape))
            for t, off in zip(state.values(), offsets, strict=True)]


def _checksummed(ckpt: FlashCheckpointer) -> bool:
    return all(s.checks_seq == s.seq for s in ckpt._ctl.slots() if s.complete)


def bench_size(nbytes: int, repeats: int, work: Path, *, peers: bool, overlap: bool) -> dict[str, Any]:
    state = make_state(nbytes)
    real = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {"bytes": real}
    settings = bench_settings(work)
    floor_saves: list[float] = []
    stead_saves: list[float] = []
    floor_restores: list[float] = []
    pageable_restores: list[float] = []
    stead_restores: list[float] = []
    pins: list[float] = []
    offsets = _offsets(state)
    with NodeProcess(work, job=f"gpu-{real}") as node:
        ckpt, out["stead_prefault_s"] = prefaulted_worker(node, settings, state)
        spare = ckpt._mapped(1)
        assert spare is not None
        out["floor_pin_s"] = timed(spare.pin_for_cuda)  # cudaHostRegister of the whole slot, once
        views = _views(spare, state, offsets)  # released before the slots are closed

        def floor_into(views: list[torch.Tensor]) -> None:
            for view, tensor in zip(views, state.values(), strict=True):
                view.copy_(tensor, non_blocking=False)

        out["floor_first_s"] = timed(lambda: floor_into(views))
        out["stead_first_s"] = timed(lambda: ckpt.save(1, state))  # registers slot 0 inside
        assert ckpt._ctl.slot(0).holds(1, 1)
        _wait(lambda: _checksummed(ckpt), "the agent's checksums")
        step = 1
        for attempt in range(repeats):
            step += 1
            target = next(s.index for s in ckpt._ctl.slots() if not s.holds(step - 1, 1))
            mapped = ckpt._mapped(target)
            assert mapped is not None
            views = _views(mapped, state, offsets)

            def floor_save(v: list[torch.Tensor] = views) -> None:
                floor_into(v)

            def stead_save(k: int = step) -> None:
                assert ckpt.save(k, state)

            pair = (floor_save, stead_save) if attempt % 2 == 0 else (stead_save, floor_save)
            for fn in pair:
                (floor_saves if fn is floor_save else stead_saves).append(timed(fn))
            _wait(lambda: _checksummed(ckpt), "the agent's checksums")
        views = []
        ckpt.close()
        expected = [float(t[0]) for t in state.values()]
        for attempt in range(repeats):
            for tensor in state.values():
                tensor.zero_()
            env = node.round(2 + attempt, 1 + attempt)
            restarted = make_worker(env, settings)
            slot = next(s for s in restarted._ctl.slots() if s.holds(step, 1))
            _wait(lambda w=restarted, i=slot.index: w._ctl.slot(i).verify_state is VerifyState.OK,  # type: ignore[misc]
                  "the agent's check")
            mapped = restarted._mapped(slot.index)
            assert mapped is not None
            mapped.wait_populated()
            # stead first, on a slot it has not registered (as after a real restart): load() registers it
            stead_restores.append(timed(lambda w=restarted: w.load(state)))  # type: ignore[misc]
            if [float(t[0]) for t in state.values()] != expected:
                raise RuntimeError("stead's restore into CUDA tensors did not bring back the saved values")
            views = _views(mapped, state, offsets)

            def floor_restore(v: list[torch.Tensor] = views) -> None:
                for view, tensor in zip(v, state.values(), strict=True):
                    tensor.copy_(view, non_blocking=False)

            was_pinned = mapped._pinned
            if was_pinned:  # to time the pageable floor and the registration, undo load()'s registration
                torch.cuda.cudart().cudaHostUnregister(mapped.base)
                mapped._pinned = False
            pageable_restores.append(timed(floor_restore))
            pins.append(timed(mapped.pin_for_cuda))
            floor_restores.append(timed(floor_restore))
            out["stead_pinned_restore"] = was_pinned
            views = []
            restarted.close()
    gc.collect()
    out["floor_s"] = statistics.median(floor_saves)
    out["stead_s"] = statistics.median(stead_saves)
    out["floor_restore_s"] = statistics.median(floor_restores)
    out["pageable_restore_s"] = statistics.median(pageable_restores)
    out["stead_restore_s"] = statistics.median(stead_restores)
    out["pin_s"] = statistics.median(pins)
    out["samples"] = {"floor": floor_saves, "stead": stead_saves, "floor_restore": floor_restores,
                      "pageable_restore": pageable_restores, "stead_restore": stead_restores, "pin": pins}
    out["d2h_gbps"] = real / out["floor_s"] / 1e9
    out["h2d_gbps"] = real / out["floor_restore_s"] / 1e9
    out["ratio_first"] = out["stead_first_s"] / out["floor_first_s"]
    out["ratio_steady"] = out["stead_s"] / out["floor_s"]
    out["ratio_restore"] = out["stead_restore_s"] / out["floor_restore_s"]
    # each on its own: one failing (a torch without dcp.async_save's no_dist, say) keeps stead's figures
    for wanted, part, run in ((overlap, "overlap", lambda: bench_overlap(state, work, settings)),
                              (peers, "peers", lambda: bench_peers(state, work))):
        if not wanted:
            continue
        try:
            out.update(run())
        except Exception as exc:
            log(f"{_gib(real)}: {part}: FAILED: {exc!r}")
            out[f"{part}_error"] = repr(exc)
    state.clear()
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_overlap(state: dict[str, torch.Tensor], work: Path, settings: CheckpointSettings) -> dict[str, Any]:
    """``copy_mode="overlap"``: how long the training stream's next work is held up by a save, against the copy."""
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")

    def workload(n: int) -> None:
        c = a
        for _ in range(n):
            c = torch.mm(c, b).clamp_(-1, 1)

    one = min(timed(lambda: workload(10)) for _ in range(3)) / 10
    out: dict[str, Any] = {}
    with NodeProcess(work, job=f"gpu-overlap-{id(state)}") as node:
        env = node.round(1, 0)
        ckpt = make_worker(env, settings, size_hint=state, copy_mode="overlap")
        ckpt._wait_reserved()
        assert ckpt._reserving is not None
        ckpt._reserving.join()
        assert ckpt.save(1, state)  # registers the slot; the figures below are the steady state
        ckpt._finish_previous()
        _wait(lambda: _checksummed(ckpt), "the agent's checksums")
        copies, stalls, returns, alones = [], [], [], []
        step = 1
        for _ in range(4):
            step += 1
            _sync()
            start = time.perf_counter()
            assert ckpt.save(step, state)
            returned = time.perf_counter() - start
            assert ckpt._finishing is not None
            ckpt._finishing.join()  # the copy is done (the finishing thread waited for its event)
            copy_s = time.perf_counter() - start
            n = max(1, int(OVERLAP_WORK_FACTOR * copy_s / one))
            alone = timed(lambda k=n: workload(k))  # type: ignore[misc]
            _wait(lambda: _checksummed(ckpt), "the agent's checksums")
            _sync()
            start = time.perf_counter()
            step += 1
            assert ckpt.save(step, state)
            workload(n)  # the next step's work, queued at once on the training (current) stream
            _sync()
            with_save = time.perf_counter() - start
            ckpt._finish_previous()
            _wait(lambda: _checksummed(ckpt), "the agent's checksums")
            copies.append(copy_s)
            returns.append(returned)
            alones.append(alone)
            stalls.append(max(0.0, with_save - alone))
        ckpt.close()
    out["overlap_copy_s"] = statistics.median(copies)
    out["overlap_return_s"] = statistics.median(returns)
    out["overlap_stall_s"] = statistics.median(stalls)
    out["overlap_work_s"] = statistics.median(alones)
    out["overlap_stall_ratio"] = out["overlap_stall_s"] / out["overlap_copy_s"]
    return out


def bench_peers(state: dict[str, torch.Tensor], work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    path = work / "state.pt"

    def torch_save() -> None:
        with open(path, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())

    out["torch_save_s"] = timed(torch_save)
    path.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        future: list[Any] = []
        out["dcp_async_block_s"] = timed(
            lambda: future.append(dcp.async_save(state, checkpoint_id=str(work / "dcp-async"), no_dist=True)))
        result = future[0]
        (result.upload_completion if hasattr(result, "upload_completion") else result).result()
        shutil.rmtree(work / "dcp-async")
    gc.collect()
    return out


def report(size: dict[str, Any]) -> None:
    log(f"\n{_gib(size['bytes'])} of CUDA state ({TENSORS} tensors)")
    floor, floor_r = size["floor_s"], size["floor_restore_s"]
    rows = [
        ("save: D2H cudaMemcpy into pinned shm (floor), first", size["floor_first_s"], None),
        ("save: D2H cudaMemcpy into pinned shm (floor), steady", floor, None),
        ("save: stead FlashCheckpointer, first (registers the slot)", size["stead_first_s"], size["ratio_first"]),
        ("save: stead FlashCheckpointer, steady", size["stead_s"], size["ratio_steady"]),
    ]
    if "torch_save_s" in size:
        rows += [("save: torch.save + fsync", size["torch_save_s"], size["torch_save_s"] / floor),
                 ("save: dcp.async_save (blocking part)", size["dcp_async_block_s"], size["dcp_async_block_s"] / floor)]
    rows += [
        ("restore: H2D cudaMemcpy from pinned shm (floor)", floor_r, None),
        ("restore: H2D from the same shm, pageable", size["pageable_restore_s"], size["pageable_restore_s"] / floor_r),
        ("restore: stead load() into the CUDA tensors", size["stead_restore_s"], size["ratio_restore"]),
        ("cudaHostRegister of one slot", size["pin_s"], None),
    ]
    if "overlap_copy_s" in size:
        rows += [("overlap: save() returns after", size["overlap_return_s"], None),
                 ("overlap: the copy completes after", size["overlap_copy_s"], None),
                 ("overlap: the training stream's stall", size["overlap_stall_s"], None)]
    for label, seconds, ratio in rows:
        shown = f"{ratio:6.2f}x floor" if ratio is not None else ""
        log(f"  {label:<60} {seconds:8.4f} s  {shown}")
    log(f"  D2H {size['d2h_gbps']:.1f} GB/s, H2D {size['h2d_gbps']:.1f} GB/s; first-save floor registration "
        f"{size['floor_pin_s']:.3f} s (what the background left); pre-fault and registration of both slots "
        f"{size['stead_prefault_s']:.2f} s (background); the restored slot was pinned before load() ran (in the "
        f"background since the worker started): {size['stead_pinned_restore']}")
    if "overlap_stall_ratio" in size:
        log(f"  overlap: stall {size['overlap_stall_ratio']:.2f}x the copy (goal <= 0.1; a workload of "
            f"{size['overlap_work_s']:.3f} s alone queued right after save())")
    samples = {k: [round(x, 4) for x in v] for k, v in size["samples"].items()}
    log(f"  samples (s): {json.dumps(samples)}")


def bench_nvml() -> dict[str, Any]:
    """The agent's NVML readings against nvidia-smi's, with 2 GiB allocated by this process."""
    health = GpuHealth()
    why = health.open()
    if why:
        log(f"nvml: skipped: {why}")
        return {"nvml_error": why}
    hold = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda").fill_(1)
    _sync()
    try:
        used, busy = health.usage()
        problems = health.check()
        query = "name,memory.used,memory.total,utilization.gpu,ecc.errors.uncorrected.volatile.total"
        try:
            smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            smi = f"nvidia-smi failed: {exc!r}"
        out = {"nvml_gpus": health.gpus, "nvml_used_mib": None if used is None else used / 2**20,
               "nvml_util_pct": busy, "nvml_problems": [str(p) for p in problems], "smi": smi}
        fields = [f.strip() for f in smi.split("\n")[0].split(",")]
        if len(fields) == 5 and used is not None:
            with contextlib.suppress(ValueError):
                out["nvml_vs_smi_used_mib"] = used / 2**20 - float(fields[1])
        log(f"nvml (agent): {health.gpus} GPU(s), used {out['nvml_used_mib']} MiB, utilisation {busy} %, "
            f"problems {out['nvml_problems']}\nnvidia-smi ({query}): {smi}")
        return out
    finally:
        del hold
        health.close()
        torch.cuda.empty_cache()


def bench_job(work: Path) -> dict[str, Any]:
    """A 1-node, 1-worker ``stead run`` job that crashes at a step and recovers from its flash checkpoint."""
    folder = work / "job"
    folder.mkdir()
    command = [sys.executable, "-m", "stead", "run", "--standalone", "--nproc-per-node", "1", "--max-restarts",
               "1", "--log-format", "json", str(TRAIN), "--out", str(folder), "--step-s", str(JOB_STEP_S)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        keep_job_log(err)
        return {"job_error": f"stead run did not finish within {JOB_TIMEOUT_S} s: {err[-2000:]}"}
    keep_job_log(err)
    if proc.returncode != 0:
        return {"job_error": f"stead run failed ({proc.returncode}): {err[-3000:]}"}
    crash, first = None, None
    for line in (folder / "steps").read_text().splitlines():
        restart, what, when = line.split()
        if what == "crash":
            crash = float(when)
        elif int(restart) >= 1 and first is None:
            first = float(when)
    restored = (folder / "restored").read_text().split() if (folder / "restored").exists() else []
    if crash is None or first is None or len(restored) != 4:
        saved = sorted(int(p.name.removeprefix("hash-")) for p in folder.glob("hash-*"))
        return {"job_error": f"incomplete: crash={crash} first step after={first} restored={restored} "
                             f"steps saved={saved}"}
    out = {"recovery_s": first - crash, "restored_step": int(restored[0]), "restored_device": restored[1],
           "restored_identical": restored[3] == "1"}
    log(f"job: crashed, recovered in {out['recovery_s']:.3f} s (crash -> first step after), restored step "
        f"{out['restored_step']} on {out['restored_device']}, tensors bit-identical: {out['restored_identical']}")
    return out


def keep_job_log(err: str) -> None:
    """The job's log (JSON lines): whole in ``$OUT/gpu_job.log``; its warnings and errors printed here."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_job.log").write_text(err)
    notable = [line for line in err.splitlines() if '"level": "warning"' in line or '"level": "error"' in line
               or '"event": "ckpt_' in line or "Traceback" in line or "Error" in line]
    for line in notable[:40]:
        log(f"  job log: {line[:400]}")


def summarise(results: list[dict[str, Any]], extra: dict[str, Any], *, cuda: bool, quick: bool,
              seconds: float) -> dict[str, Any]:
    """The JSON object of the figures so far (the goals' keys null where not measured)."""
    by = {r["bytes"]: r for r in results}

    def ratio(gib: float, key: str) -> float | None:
        found = by.get(int(gib * GIB) // TENSORS // 4 * 4 * TENSORS)  # the bytes make_state allocates
        return None if found is None else round(found[key], 3)

    overlap = next((r["overlap_stall_ratio"] for r in results if "overlap_stall_ratio" in r), None)
    figures = {_gib(r["bytes"]).replace(" ", ""): {k: (round(v, 4) if isinstance(v, float) else v)
                                                   for k, v in r.items() if k != "samples"} for r in results}
    recovered = "recovery_s" in extra
    return {
        "bench": "gpu", "quick": quick, "device": torch.cuda.get_device_name(0) if cuda else None,
        "torch": torch.__version__,
        "gpu_save_ratio_1g": ratio(1, "ratio_steady"), "gpu_save_ratio_16g": ratio(16, "ratio_steady"),
        "gpu_first_save_ratio_1g": ratio(1, "ratio_first"), "gpu_first_save_ratio_16g": ratio(16, "ratio_first"),
        "gpu_restore_ratio_1g": ratio(1, "ratio_restore"), "gpu_restore_ratio_16g": ratio(16, "ratio_restore"),
        "gpu_overlap_stall_ratio": None if overlap is None else round(overlap, 3),
        "gpu_recovery_s": round(extra["recovery_s"], 3) if cuda and recovered else None,
        "gpu_restored_identical": extra.get("restored_identical") if cuda else None,
        "cpu_recovery_s": round(extra["recovery_s"], 3) if not cuda and recovered else None,
        "cpu_restored_identical": extra.get("restored_identical") if not cuda else None,
        "seconds": round(seconds, 1), "sizes": figures,
        **{k: v for k, v in extra.items() if k not in ("recovery_s", "restored_identical")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB and 1 GiB, fewer repeats")
    parser.add_argument("--sizes", default="", help="comma-separated sizes in GiB (default 1,4,16)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers-max-gib", type=float, default=16, help="torch.save/dcp only up to this size")
    parser.add_argument("--skip-job", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if args.sizes:
        sizes = [int(float(s) * GIB) for s in args.sizes.split(",")]
    else:
        sizes = [256 << 20, GIB] if args.quick else [GIB, 4 * GIB, 16 * GIB]
    repeats = 2 if args.quick else args.repeats
    cuda = torch.cuda.is_available()
    shm = CheckpointSettings().shm_dir
    free = f"{shutil.disk_usage(shm).free / GIB:.1f} GiB" if os.path.isdir(shm) else "(missing)"
    log(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device "
        f"{torch.cuda.get_device_name(0) if cuda else 'none'}, {shm} free {free}, {os.cpu_count()} CPUs")
    out_dir = os.environ.get("OUT")
    work = Path(tempfile.mkdtemp(prefix="stead-bench-gpu-"))
    results: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    started = time.perf_counter()

    def emit(name: str) -> str:
        line = json.dumps(summarise(results, extra, cuda=cuda, quick=args.quick,
                                    seconds=time.perf_counter() - started))
        if out_dir:  # after each part, so that a run cut short still leaves what it measured
            Path(out_dir, name).write_text(line + "\n")
        return line

    try:
        # the job and NVML first: the cheapest parts, and the ones a run cut short must not lose
        if args.skip_job:
            log("job: skipped (--skip-job)")
        else:
            log(f"job: 1 worker on {'CUDA' if cuda else 'CPU (no GPU: the JSON keeps gpu_recovery_s null)'}, "
                "crashing once ...")
            extra.update(bench_job(work))
            if "job_error" in extra:
                log(f"job: FAILED: {extra['job_error']}")
            emit("gpu.partial.json")
        if cuda:
            extra.update(bench_nvml())
            for index, nbytes in enumerate(sizes):
                log(f"measuring {_gib(nbytes)} ... ({time.perf_counter() - started:.0f} s so far)")
                try:
                    results.append(bench_size(nbytes, repeats, work, peers=nbytes <= args.peers_max_gib * GIB,
                                              overlap=index == 0))
                    report(results[-1])
                except Exception as exc:  # one size failing must not lose the others' figures
                    log(f"{_gib(nbytes)}: FAILED: {exc!r}")
                    extra.setdefault("errors", []).append(f"{_gib(nbytes)}: {exc!r}")
                gc.collect()
                torch.cuda.empty_cache()
                emit("gpu.partial.json")
        else:
            log("no CUDA device: skipped the save/restore floors and stead's copies from CUDA tensors, "
                "torch.save/dcp from CUDA, overlap mode and NVML (their JSON values are null)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(emit("gpu.json"), flush=True)


if __name__ == "__main__":
    main()
