"""What ``stead.numerics.guard`` costs a DDP job, and how soon it catches a NaN (issue 43).

The job (``SCRIPT`` below, written to a temporary folder): DDP over ``--nproc`` workers (gloo on
the CPU, 4 by default; ``--device cuda``: NCCL, one GPU a worker), an MLP of about 10 M parameters, fixed
batches made from the step and the rank. Run with ``torch.distributed.run --standalone`` (the guard is a
library: its cost does not depend on the launcher), each configuration ``--repeats`` times, interleaved:

* ``overhead_ratio``: the mean step time with the guard (fingerprints every ``--fingerprint-every`` steps,
  default 100 as the setting's default: their cost is spread over the steps) over without it, the median of
  the interleaved runs (goal: <= 1.01);
* ``nan_detect_steps``: a NaN injected into rank 1's gradients at step ``NAN_STEP``
  (``STEAD_NUMERICS_INJECT``): the step the guard names minus the step it was injected at (goal: 0, the
  same step; the step is not applied);
* ``bitflip_detect_steps``: a bit flipped in rank 1's parameters after step ``BITFLIP_STEP``: the step at
  which the replicas' fingerprints name rank 1, minus the injected step (goal: < ``--fingerprint-every``);
* ``false_alarms``: guard errors (NaN or replica mismatch) over ``--healthy-steps`` steps of a healthy run
  (goal: 0).

Last line: one JSON object with the figures. ``--quick``: fewer steps, one run of each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NAN_STEP = 7
#: the step after which a bit of rank 1's parameters is flipped (not a multiple of any fingerprint cadence)
BITFLIP_STEP = 13
RUN_TIMEOUT_S = 900

SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import stead.numerics

device, steps, guarded = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
width, batch = int(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("nccl" if device == "cuda" else "gloo")
rank = dist.get_rank()
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if device == "cuda" else torch.device("cpu")
if device == "cuda":
    torch.cuda.set_device(dev)
torch.manual_seed(0)
layers = [torch.nn.Linear(width, width) for _ in range(4)]  # 4 x width^2: width 1600 -> 10.2 M parameters
model = DistributedDataParallel(torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())]).to(dev))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
if guarded:
    stead.numerics.guard(model)
times, alarms = [], []
for step in range(steps):
    g = torch.Generator(device=dev).manual_seed(1000 * step + rank)
    x = torch.randn(batch, width, generator=g, device=dev)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    try:
        model(x).square().mean().backward()
        opt.step()
    except (stead.numerics.NonFiniteGradientError, stead.numerics.ReplicaMismatchError) as exc:
        alarms.append(str(exc))
        print("ALARM " + json.dumps({"step": step, "error": str(exc)}), flush=True)
        break
    finally:
        opt.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - started)
if rank == 0:
    print("RESULT " + json.dumps({"times": times[3:], "alarms": len(alarms),
                                  "params": sum(p.numel() for p in model.parameters())}), flush=True)
if not alarms:
    dist.barrier()  # every rank done with the group before any tears it down (a gloo teardown race otherwise)
dist.destroy_process_group()
"""


def _run(workdir: Path, device: str, nproc: int, steps: int, guarded: bool, width: int, batch: int,
         inject: str = "", every: int = 100) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEAD_", "TORCHELASTIC_"))}
    env["STEAD_NUMERICS_FINGERPRINT_EVERY"] = str(every)
    env.update(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               TMPDIR=str(workdir))  # torchrun never removes its torchelastic_* log folder: in the bench's folder

    if inject:
        env["STEAD_NUMERICS_INJECT"] = inject
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "train.py", device, str(steps), "1" if guarded else "0", str(width), str(batch)]
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    alarms = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("ALARM ")]
    results = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if inject:
        return {"alarms": alarms, "stderr": proc.stderr[-3000:]}
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"the {'guarded' if guarded else 'plain'} run failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one run of each")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--nproc", type=int, default=None, help="workers (default: 4 on the CPU, 1 on CUDA)")
    parser.add_argument("--width", type=int, default=1600, help="the MLP's width (4 layers: 4 x width^2 weights)")
    parser.add_argument("--batch", type=int, default=64, help="samples a step on each worker (default 64)")
    parser.add_argument("--steps", type=int, default=None, help="steps a timing run (default 203, quick 23)")
    parser.add_argument("--fingerprint-every", type=int, default=None,
                        help="the replicas compare fingerprints every this many steps (default 100, quick 10)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs of each (default 3, quick 1)")
    parser.add_argument("--healthy-steps", type=int, default=None, help="steps of the false-alarm run (default 300)")
    opts = parser.parse_args()
    nproc = opts.nproc or (1 if opts.device == "cuda" else 4)
    steps = opts.steps or (23 if opts.quick else 203)
    every = opts.fingerprint_every or (10 if opts.quick else 100)
    repeats = opts.repeats or (1 if opts.quick else 3)
    healthy = opts.healthy_steps or (60 if opts.quick else 300)
    with tempfile.TemporaryDirectory(prefix="stead-bench-numerics-") as tmp:
        workdir = Path(tmp)
        (workdir / "train.py").write_text(textwrap.dedent(SCRIPT))
        runs: dict[bool, list[float]] = {False: [], True: []}
        params = 0
        for attempt in range(repeats):
            for guarded in (False, True):
                result = _run(workdir, opts.device, nproc, steps, guarded, opts.width, opts.batch, every=every)
                runs[guarded].append(statistics.fmean(result["times"]))
                params = result["params"]
                print(f"{'guarded' if guarded else 'plain':8} #{attempt}: mean step "
                      f"{runs[guarded][-1] * 1e3:.2f} ms", flush=True)
        plain, guarded_s = statistics.median(runs[False]), statistics.median(runs[True])
        caught = _run(workdir, opts.device, max(nproc, 2) if opts.device == "cpu" else nproc, NAN_STEP + 5, True,
                      opts.width, opts.batch, inject=f"nan:rank={min(1, nproc - 1)}:step={NAN_STEP}")
        named = [int(m.group(1)) for alarm in caught["alarms"]
                 if (m := re.search(r"at step (\d+)", alarm["error"]))]
        if not named:
            print(f"the injected NaN was not caught:\n{caught['stderr']}", flush=True)
        nan_steps = (min(named) - NAN_STEP) if named else None
        flipped = _run(workdir, opts.device, max(nproc, 3), BITFLIP_STEP + every + 3, True, opts.width,
                       opts.batch, inject=f"bitflip:rank=1:step={BITFLIP_STEP}", every=every)
        pinned = [int(m.group(1)) for alarm in flipped["alarms"]
                  if (m := re.search(r"replica mismatch: rank 1 \(host [^)]*\) at step (\d+)", alarm["error"]))]
        if not pinned:
            print(f"the flipped bit was not caught on rank 1:\n{flipped['stderr']}", flush=True)
        flip_steps = (min(pinned) - BITFLIP_STEP) if pinned else None
        quiet = _run(workdir, opts.device, nproc, healthy, True, opts.width, opts.batch, every=every)
    figures = {
        "bench": "numerics", "device": opts.device, "nproc": nproc, "params": params, "batch": opts.batch,
        "step_plain_s": round(plain, 5), "step_guarded_s": round(guarded_s, 5),
        "overhead_ratio": round(guarded_s / plain, 4), "overhead_goal_met": guarded_s / plain <= 1.01,
        "nan_detect_steps": nan_steps, "bitflip_detect_steps": flip_steps, "fingerprint_every": every,
        "bitflip_replicas": max(nproc, 3), "false_alarms": quiet["alarms"], "healthy_steps": healthy,
    }
    print(f"guard: mean step {guarded_s * 1e3:.2f} ms against {plain * 1e3:.2f} ms "
          f"({figures['overhead_ratio']}x; goal <= 1.01x); NaN injected at step {NAN_STEP}: caught "
          f"{'at ' + str(min(named)) if named else 'NOT'}; bit flipped at step {BITFLIP_STEP}: rank 1 named "
          f"{'at ' + str(min(pinned)) if pinned else 'NOT'} (fingerprints every {every}); false alarms over "
          f"{healthy} healthy steps: "
          f"{quiet['alarms']}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
