"""The Hugging Face Trainer under `stead run` (flash checkpoint every step) against torchrun (the Trainer's own
checkpoints and ``resume_from_checkpoint``), with one worker crash, measured in the same run.

The job (bench/_hf_train.py): a GPT-2 of 4 M parameters built from a config, 2 gloo workers on the CPU,
``STEPS`` optimizer steps. Rank 1 dies after its ``CRASH_AT``-th step. Under torchrun the Trainer saves its
own checkpoint every ``SAVE_STEPS`` steps (``save_model`` plus the optimizer, scheduler and generators) and
the restarted workers resume from the newest; under stead the callback's flash save runs every step, and the
restarted workers resume from the agent's memory. Both may restart 3 times: torchrun's restarted workers here
sometimes fail gloo's first connect ("connectFullMesh ... Connection refused") and need another restart, which
then counts in its recovery, as it would for its user. A hook on ``PYTHONPATH`` writes each optimizer step's
wall-clock time and the crash's, so both are timed alike:

* ``hf_recovery_*_s``: the crash -> every rank of the new workers has finished its first step (imports, the
  Trainer's set-up and the restore included);
* ``hf_steps_lost_*``: optimizer steps rank 1 ran more than ``STEPS`` (work done again after the restore);
* ``hf_save_stall_*_s``: the median time one save holds the training loop (stead: the callback's save,
  every step; the Trainer: ``_save_checkpoint``), against ``memcpy_s``, a copy of the same tensors into
  buffers made beforehand.

Goals (issue 42): steps lost <= 1, save stall <= 1.2x the memcpy, recovery >= 8x faster than torchrun.
Last line: one JSON object with the figures. ``--quick`` runs each launcher once (the default: twice).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
STEPS, CRASH_AT, SAVE_STEPS = 40, 25, 10
#: a run takes about a minute; torchrun's restarted workers sometimes wait for ever in their rendezvous
RUN_TIMEOUT_S = 300
#: tries per measurement: torchrun's restarted workers sometimes fail gloo's first connect or hang in their
#: rendezvous (a launcher's flake, not the restore's), which ends or stalls its job
ATTEMPTS = 3

HOOK = """
import os
import sys
import time

if os.environ.get("BENCH_STAMPS") and "stead agent" not in " ".join(sys.argv):  # stead's zygote too: no RANK yet
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = [0]

    def _after_step(optimizer, args, kwargs):
        rank = os.environ.get("RANK")
        if rank is None:
            return
        steps[0] += 1
        with open(os.environ["BENCH_STAMPS"], "a") as out:
            out.write(f"{rank} {os.getpid()} {time.time()}\\n")
            if rank == "1" and steps[0] == int(os.environ["BENCH_CRASH_AT"]) and not os.path.exists("crashed"):
                open("crashed", "w").close()
                out.write(f"crash {os.getpid()} {time.time()}\\n")
                out.flush()
                os._exit(17)

    register_optimizer_step_post_hook(_after_step)
"""


def _env(workdir: Path, mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEAD_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(workdir / "hooks"), env.get("PYTHONPATH", "")]),
               BENCH_MODE=mode, BENCH_STEPS=str(STEPS), BENCH_SAVE_STEPS=str(SAVE_STEPS),
               BENCH_CRASH_AT=str(CRASH_AT), BENCH_STAMPS=str(workdir / "stamps.txt"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TMPDIR=str(workdir))  # torchrun never removes its torchelastic_* log folder: in the run's folder
    return env


def _measure(stamps: Path) -> tuple[float, int]:
    """(crash -> every rank's first step after it, steps rank 1 ran beyond STEPS)."""
    crash_pid, crash = "", 0.0
    lines = [line.split() for line in stamps.read_text().splitlines()]
    for who, pid, when in lines:
        if who == "crash":
            crash_pid, crash = pid, float(when)
    if not crash_pid:
        raise RuntimeError(f"no crash in {stamps}")
    firsts: dict[str, float] = {}
    for who, _pid, when in lines:
        if who != "crash" and float(when) > crash:
            firsts.setdefault(who, float(when))
    if len(firsts) < 2:
        raise RuntimeError(f"the job did not step again after the crash: {stamps}")
    rank1_steps = sum(1 for who, _pid, _when in lines if who == "1")
    return max(firsts.values()) - crash, rank1_steps - STEPS


def _run(mode: str, base: Path, attempt: int) -> dict[str, Any]:
    for tries in range(ATTEMPTS):
        try:
            return _run_once(mode, base / f"{mode}-{attempt}-{tries}", f"{attempt}{tries}")
        except RuntimeError as exc:
            last = exc
            print(f"{mode} #{attempt}: try {tries + 1} failed: {str(exc).splitlines()[0]} "
                  f"{[line for line in str(exc).splitlines() if 'Error' in line][-1:]}", flush=True)
    raise last


def _run_once(mode: str, workdir: Path, attempt: str) -> dict[str, Any]:
    (workdir / "hooks").mkdir(parents=True)
    (workdir / "hooks" / "sitecustomize.py").write_text(textwrap.dedent(HOOK))
    shutil.copy(ROOT / "_hf_train.py", workdir / "train.py")
    if mode == "stead":
        command = [sys.executable, "-m", "stead", "run", "--nproc-per-node", "2", "--max-restarts", "3",
                   "--job-name", f"hf{attempt}", "train.py"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "--max-restarts", "3", "--monitor-interval", "0.1", "train.py"]
    proc = subprocess.Popen(command, cwd=workdir, env=_env(workdir, mode), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # torchrun's restarted workers sometimes wait for ever in their rendezvous
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{mode} run did not end within {RUN_TIMEOUT_S} s (killed)") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({proc.returncode}):\n{stderr[-4000:]}")
    recovery, lost = _measure(workdir / "stamps.txt")
    stalls = [json.loads(p.read_text()) for p in workdir.glob("stall-*.json")]
    saves = [s for stall in stalls for s in stall["saves_s"]]
    return {"recovery_s": recovery, "steps_lost": lost, "save_s": statistics.median(saves),
            "memcpy_s": statistics.median(stall["memcpy_s"] for stall in stalls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="run each launcher once")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each launcher, interleaved (default 2)")
    opts = parser.parse_args()
    repeats = 1 if opts.quick else opts.repeats
    runs: dict[str, list[dict[str, Any]]] = {"stead": [], "trainer": []}
    with tempfile.TemporaryDirectory(prefix="stead-bench-frameworks-") as tmp:
        for attempt in range(repeats):
            for mode in ("trainer", "stead"):
                result = _run(mode, Path(tmp), attempt)
                runs[mode].append(result)
                print(f"{'stead run' if mode == 'stead' else 'torchrun':9} #{attempt}: recovery "
                      f"{result['recovery_s']:.2f} s, steps lost {result['steps_lost']}, save stall "
                      f"{result['save_s'] * 1e3:.1f} ms per save (memcpy of the same tensors "
                      f"{result['memcpy_s'] * 1e3:.1f} ms)", flush=True)

    def median(mode: str, key: str) -> float:
        return float(statistics.median(run[key] for run in runs[mode]))

    figures = {
        "hf_recovery_stead_s": round(median("stead", "recovery_s"), 3),
        "hf_recovery_torchrun_s": round(median("trainer", "recovery_s"), 3),
        "hf_steps_lost_stead": max(run["steps_lost"] for run in runs["stead"]),
        "hf_steps_lost_torchrun": max(run["steps_lost"] for run in runs["trainer"]),
        "hf_save_stall_stead_s": round(median("stead", "save_s"), 4),
        "hf_save_stall_trainer_s": round(median("trainer", "save_s"), 4),
        "memcpy_s": round(median("stead", "memcpy_s"), 4),
    }
    figures["hf_recovery_speedup"] = round(figures["hf_recovery_torchrun_s"] / figures["hf_recovery_stead_s"], 2)
    figures["hf_save_stall_vs_memcpy"] = round(figures["hf_save_stall_stead_s"] / figures["memcpy_s"], 2)
    figures["hf_save_stall_trainer_vs_stead"] = round(
        figures["hf_save_stall_trainer_s"] / figures["hf_save_stall_stead_s"], 1)
    print(f"recovery: stead {figures['hf_recovery_stead_s']:.2f} s, torchrun {figures['hf_recovery_torchrun_s']:.2f}"
          f" s ({figures['hf_recovery_speedup']}x; goal >= 8x); steps lost: stead {figures['hf_steps_lost_stead']}, "
          f"torchrun {figures['hf_steps_lost_torchrun']} (goal <= 1); save stall: stead "
          f"{figures['hf_save_stall_vs_memcpy']}x a memcpy (goal <= 1.2x), the Trainer's own save "
          f"{figures['hf_save_stall_trainer_vs_stead']}x stead's")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
