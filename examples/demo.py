"""`make demo`: a 2-node x 2-worker job that loses a worker mid-run and recovers.

Runs examples/train.py (a small DDP model on gloo, written for torchrun) under
`stead run` with an injected crash of rank 1, then tells what happened from the
job's event log and its recovery trace, and checks that nothing was left behind.
The script flash-checkpoints every step, so the restarted workers resume from
the last step saved before the crash, restored from the agents' shared memory.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stead.core.events import (  # noqa: E402
    JobFailed,
    JobSucceeded,
    RecoveryDecided,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    WorkerFailed,
)
from stead.core.events.log import EventLog  # noqa: E402
from stead.core.store import open_store  # noqa: E402
from stead.core.views.display import goodput_lines  # noqa: E402
from stead.core.views.goodput import ledger  # noqa: E402
from stead.core.views.report import write_report  # noqa: E402
from stead.plugins.ckpt.events import CheckpointRestored  # noqa: E402
from stead.testing import leaks  # noqa: E402


async def _records(store_url: str, job: str) -> list:  # type: ignore[type-arg]
    store = await open_store(store_url)
    try:
        return await EventLog(store, job).read()
    finally:
        await store.close()


def main() -> int:
    from stead.core.logging import configure_logging

    configure_logging(level="warning")
    work = Path(tempfile.mkdtemp(prefix="stead-demo-"))
    job = f"demo-{time.strftime('%H%M%S')}"
    store_url = f"sqlite:///{work / 'demo.db'}"
    log_path = work / "stead.log"
    command = [sys.executable, "-m", "stead", "run", "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "2",
               "--job-name", job, "--store", store_url, "--log-format", "json",
               str(ROOT / "examples" / "train.py"), "--steps", "60", "--crash-at-step", "40", "--step-time", "0.05",
               "--save-every", "1"]
    print("stead demo: 2 nodes x 2 workers train a small DDP model (gloo, CPU); rank 1 will crash at step 40")
    print(f"  running `stead run --nnodes 2 --nproc-per-node 2 --max-restarts 2 examples/train.py ...` "
          f"(log: {log_path})", flush=True)
    before = leaks.snapshot()
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=work, stdout=log, stderr=subprocess.STDOUT)
        tty = sys.stdout.isatty()
        while proc.poll() is None:
            time.sleep(1)
            elapsed = time.monotonic() - started
            if tty:
                print(f"\r  ... {elapsed:4.0f} s", end="", flush=True)
            elif round(elapsed) % 10 == 0:
                print(f"  ... {elapsed:4.0f} s", flush=True)
    if tty:
        print()
    records = asyncio.run(_records(store_url, job))
    t0 = records[0].at
    crash = next((r for r in records if isinstance(r.event, WorkerFailed)), None)
    if crash is not None:  # every line in time order: from the crash on
        e = crash.event
        how = f"exit code {e.exit_code}" if e.exit_code is not None else f"signal {e.signal}"
        print(f"  +{crash.at - t0:5.1f} s  rank {e.rank} on {e.node_id} failed at step {e.step} "
              f"({how}); the agent reported it at once")
        for r in records:
            if r.seq <= crash.seq:
                continue
            ms = (r.at - crash.at) * 1000
            match r.event:
                case RecoveryDecided(action=action, reason=reason):
                    print(f"  {ms:+8.0f} ms  diagnosis: {action.value} ({reason})")
                case RoundStarted(round=n, members=members):
                    print(f"  {ms:+8.0f} ms  round {n} started with {', '.join(members)}; workers forked from a warm "
                          "zygote")
                case RoundCompleted(round=n):
                    print(f"  {ms:+8.0f} ms  round {n}: every node's workers are running")
                case CheckpointRestored(round=n, step=step, memory_ranks=memory, disk_ranks=disk) if n > 1:
                    where = "out of memory" if not disk else f"({memory} ranks from memory, {disk} from disk)"
                    print(f"  {ms:+8.0f} ms  round {n} resumed from step {step} {where}: no completed step lost")
                case StepProgress(round=n, step=step) if n > 1:
                    print(f"  {ms:+8.0f} ms  first training step of round {n} done (step {step}): recovered")
                    break
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "recovery":
            phases = ", ".join(f"{k} {entry[k]:.0f} ms" for k in ("detect", "decide", "restart", "rendezvous",
                                                                   "first_step") if k in entry)
            print(f"  trace 'recovery' ({entry['outcome']}): {phases}; total {entry['total']:.0f} ms")
    end = records[-1].event if records else None
    for r in reversed(records):
        if isinstance(r.event, (JobSucceeded, JobFailed)):
            end = r.event
            break
    outcome = "succeeded" if isinstance(end, JobSucceeded) else f"FAILED: {getattr(end, 'reason', '?')}"
    print(f"  +{records[-1].at - t0:5.1f} s  job {outcome} ({len(records)} events in its log); `stead run` exited "
          f"with {proc.returncode}")
    for line in goodput_lines(ledger(records)):  # the ledger `stead status` shows, from the same log
        print(f"  {line}")
    report = work / f"{job}-report.html"  # what `stead report` writes: the timeline, step rate and goodput
    write_report(job, records, str(report))
    print(f"  report (open it in a browser; no network needed): {report}")
    left = leaks.wait_clean(before, timeout_s=5)
    print("  nothing left behind: no stead process, port or shared-memory segment" if not left
          else f"  LEFT BEHIND: {left}")
    print(f"  see every event: .venv/bin/stead events --store {store_url} --job {job}")
    return 0 if proc.returncode == 0 and not left else 1


if __name__ == "__main__":
    sys.exit(main())
