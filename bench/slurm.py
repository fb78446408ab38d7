"""`srun torchrun` against `stead run` in a batch script (the Slurm platform) on a real Slurm cluster of test hosts.

The cluster is ``tests.support.slurm``: Debian's Slurm 22.05, a controller and 4 compute hosts made of network
namespaces (each its own address, link, /dev/shm and /tmp), sharing this bench's temporary folder as the job's
working directory, as cluster nodes share a filesystem. One gloo worker per node, the same script under both
launchers (examples/train.py, which writes a wall-clock line ``rank restart step time`` after every step and one
when it crashes). torchrun runs as Slurm users run it, one task per node of an ``srun -N3`` step; stead as its
README says, ``stead run`` with no multi-node flag in an ``sbatch --no-kill`` script of 3 nodes (4 for the spare),
which starts a step of its own on every node (the Slurm platform):

* **startup**: from starting ``srun`` (torchrun), or from the batch script's start (stead: Slurm's own delay in
  starting a batch job is not stead's), to every rank's first step. torchrun: ``--nnodes 3 --rdzv-backend c10d
  --rdzv-endpoint <first node>:29500``; stead: no multi-node flag (``stead run`` reads the allocation);
* **worker crash**: rank 1 exits at step ``CRASH_STEP`` (``--max-restarts 3`` under both): from the crash to the
  first step of the new round on every rank (goal: stead <= 0.5 s and >= 8x faster);
* **host loss**: a compute host running a worker is killed (every process, its link and memory; Slurm is not
  told). stead: ``-N4 --nnodes 3``, the 4th node a warm spare (the host is killed a few seconds after the job
  steps, once the spare has had time to warm): kill -> every rank of the new round stepped
  (``host_loss_stead_s``; goal <= 2 s plus Slurm's detection, printed on its own). torchrun: what becomes of the
  step (``host_loss_torchrun``, Slurm's state word for the job). ``slurm_detect_s``: kill -> Slurm shows the node
  down or not responding (``SlurmdTimeout`` 5 s on this cluster), and what then becomes of stead's Slurm job is
  reported as ``stead_step_after_detect``: stead's job recovers before Slurm sees the loss, and Slurm then ends
  only the lost node's step (the job was submitted ``--no-kill``), so the job trains on.

Last line: one JSON object with the figures. ``--quick`` is the same (one run of each is all there is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.hosts import RUN_TIMEOUT_S, Failed, _lines, _round_stepped, _until  # noqa: E402
from tests.support.hosts import DEFAULT_SHARED, IFNAME, Host  # noqa: E402
from tests.support.slurm import ENDED, SlurmCluster, slurm_cluster  # noqa: E402

CRASH_STEP = 20
STEPS = 60
#: how long a new round may take after a worker crash before the launcher counts as not recovering
CRASH_WAIT_S = 60.0
STEP_TIME_S = 0.05
#: how long the job steps before a host is killed, so that stead's spare agent has its zygote ready
SPARE_WARM_S = 5.0
#: the host-loss runs' steps: long enough to outlast Slurm's detection of the lost node (~30 s here)
LONG_STEPS = 2000
#: how long a host-loss run is given after Slurm saw the node gone, before it is ended here (still running: "RUNNING")
AFTER_DETECT_S = 15.0


class _BatchJob:
    """An sbatch job seen as a process (``returncode`` once Slurm says it ended: 0 for COMPLETED), its state polled
    in the background."""

    def __init__(self, cluster: SlurmCluster, job_id: int) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.returncode: int | None = None
        self.state = "PENDING"
        self._watch = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while self.state not in ENDED:
            await asyncio.sleep(0.3)
            self.state = await self.cluster.job_state(self.job_id)
        self.returncode = 0 if self.state == "COMPLETED" else 1

    async def wait(self) -> int:
        await asyncio.shield(self._watch)  # (a caller's timeout cancels its wait, not the polling)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        subprocess.run([self.cluster.tools["scancel"], str(self.job_id)], env=self.cluster.client_env(),
                       capture_output=True, check=False)


def _crashed(stamps: Path) -> float | None:
    return next((when for _, _, step, when in _lines(stamps) if step == "crash"), None)


class Bench:
    def __init__(self, cluster: SlurmCluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.runs = 0
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("STEAD_", "TORCHELASTIC_", "PET_"))}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env.get('PATH', os.defpath)}"
        self.env["STEAD_JOB_TOKEN"] = secrets.token_urlsafe(32)

    def torchrun(self, nodes: int, *script: str) -> list[str]:
        names = ",".join(n.name for n in self.cluster.nodes[:nodes])
        head = self.cluster.nodes[0].address
        return ["-N", str(nodes), "-w", names, "--ntasks-per-node", "1", sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:29500",
                "--rdzv-id", f"t{self.runs}", "--max-restarts", "3", *script]

    async def launch(self, launcher: str, nodes: int, *extra: str,
                     steps: int = STEPS) -> tuple[Any, Path, float]:
        """The run started: (its srun process, or its batch job; the ranks' step stamps; when it started)."""
        self.runs += 1
        folder = self.workdir / f"{launcher}-{self.runs}"
        folder.mkdir()
        shutil.copy(ROOT / "examples" / "train.py", folder / "train.py")
        stamps = folder / "steps.log"
        script = ("train.py", "--steps", str(steps), "--step-time", str(STEP_TIME_S), "--timestamps", str(stamps),
                  *extra)
        if launcher == "torchrun":
            log = (folder / "srun.log").open("wb")
            started = time.time()
            proc = await self.cluster.spawn_srun(self.torchrun(nodes, *script),
                                                 env={**self.env, "GLOO_SOCKET_IFNAME": IFNAME}, cwd=folder,
                                                 stdout=log, stderr=subprocess.STDOUT)
            log.close()
            return proc, stamps, started
        names = ",".join(n.name for n in self.cluster.nodes[:nodes])
        flags = "--nnodes 3 " if nodes > 3 else ""
        (folder / "job.sbatch").write_text(
            f"#!/bin/bash\n#SBATCH --no-kill\ndate +%s.%N > started\nexec {sys.executable} -m stead run {flags}"
            f"--nproc-per-node 1 --max-restarts 3 {' '.join(script)} > srun.log 2>&1\n")
        job = _BatchJob(self.cluster, await self.cluster.sbatch(folder / "job.sbatch", f"--nodes={nodes}",
                                                                f"--nodelist={names}", env=self.env, cwd=folder))
        await _until(lambda: (folder / "started").exists() and (folder / "started").read_text().strip(),
                     "the batch script's start", [cast(asyncio.subprocess.Process, job)])
        return job, stamps, float((folder / "started").read_text())

    async def ended(self, proc: Any, timeout_s: float = RUN_TIMEOUT_S) -> int:
        try:
            return int(await asyncio.wait_for(proc.wait(), timeout_s))
        except TimeoutError:
            proc.kill()
            return int(await proc.wait())

    async def startup_and_crash(self, launcher: str) -> tuple[float, float | str]:
        """Launch -> every rank's first step; crash -> the new round stepping (or why it did not)."""
        proc, stamps, started = await self.launch(launcher, 3, "--crash-at-step", str(CRASH_STEP), "--crash-rank", "1")
        first = float(await _until(lambda: _round_stepped(stamps, started, 3), "every rank's first step", [proc]))  # type: ignore[arg-type]
        try:
            crash = float(await _until(lambda: _crashed(stamps), "the crash", [proc]))  # type: ignore[arg-type]
            again = float(await _until(lambda: _round_stepped(stamps, crash, 3), "the new round's first step", [proc],  # type: ignore[arg-type]
                                       timeout_s=CRASH_WAIT_S))
        except Failed as exc:
            await self.ended(proc)
            tail = (stamps.parent / "srun.log").read_text(errors="replace").strip().splitlines()[-3:]
            return first - started, f"{exc}: {' | '.join(tail)}"
        await self.ended(proc)
        return first - started, again - crash

    async def host_loss(self, launcher: str) -> dict[str, object]:
        nodes = 4 if launcher == "stead" else 3
        proc, stamps, started = await self.launch(launcher, nodes, steps=LONG_STEPS)
        await _until(lambda: _round_stepped(stamps, started, 3), "every rank's first step", [proc])
        await asyncio.sleep(SPARE_WARM_S)
        victim = self.cluster.nodes[1] if launcher == "torchrun" else self._member_host(stamps.parent)
        killed = time.time()
        await self.cluster.hosts.kill(victim.index)
        figures: dict[str, object] = {}
        detect = asyncio.create_task(self._detected(victim.name, killed))
        if launcher == "stead":
            try:
                stepped = await _until(lambda: _round_stepped(stamps, killed, 3), "a new round stepping", [proc])
                figures["host_loss_stead_s"] = round(float(stepped) - killed, 3)  # type: ignore[arg-type]
            except Failed as exc:
                figures["host_loss_stead_s"], figures["host_loss_stead_note"] = None, str(exc)
        figures["slurm_detect_s"] = await detect
        try:  # Slurm's verdict on the step
            code: int | None = await asyncio.wait_for(proc.wait(), AFTER_DETECT_S)
        except TimeoutError:
            code = None  # still running: the step outlived the node's loss
        state = await self._job_state()
        if code is None:
            await self.ended(proc, timeout_s=0.1)
            if launcher == "stead":
                await self.cluster.wait_job(proc.job_id, timeout_s=60)
        if launcher == "stead":
            figures["stead_step_after_detect"] = (f"ended ({proc.state})" if code is not None
                                                  else f"training {AFTER_DETECT_S:g} s after, job state {state}")
        else:
            figures["host_loss_torchrun"] = state
            figures["host_loss_torchrun_exit"] = code
        await self.cluster.restart_node(self.cluster.nodes.index(victim))
        return figures

    def _member_host(self, folder: Path) -> Host:
        """A host of stead's round that is not the master's (the first node's) nor the spare."""
        [store] = (folder / ".stead").glob("slurm-*.db")
        out = subprocess.run([sys.executable, "-m", "stead", "events", "--job", store.stem, "--json"], cwd=folder,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        events = [json.loads(line) for line in out.splitlines() if line]
        hosts = {e["data"]["node_id"]: e["data"]["host"] for e in events if e["type"] == "node.started"}
        [*_, members] = [e["data"]["members"] for e in events if e["type"] == "round.started"]
        names = {hosts[m] for m in members} - {self.cluster.nodes[0].name}
        return next(n for n in self.cluster.nodes if n.name in names)

    async def _detected(self, name: str, killed: float) -> float | None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            state = await self.cluster.node_state(name)
            if "down" in state or "*" in state or "fail" in state:
                return round(time.time() - killed, 2)
            await asyncio.sleep(0.2)
        return None

    async def _job_state(self) -> str:
        """The newest job's state once it has settled (COMPLETING is on the way to its end), 10 s at most."""
        state = "unknown"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            out = await self.cluster.scontrol("show", "job", "--oneliner")
            jobs = [line for line in out.splitlines() if "JobId=" in line]
            if jobs:
                last = max(jobs, key=lambda line: int(line.split("JobId=")[1].split()[0]))
                state = last.split("JobState=")[1].split()[0]
                if state != "COMPLETING":
                    return state
            await asyncio.sleep(0.2)
        return state


def _ratio(slow: float | None, fast: float | None) -> float | None:
    return round(slow / fast, 2) if slow and fast else None


async def _measure(workdir: Path) -> dict[str, object]:
    shared: Sequence[Path | str] = (*DEFAULT_SHARED, workdir)
    async with slurm_cluster(4, workdir=workdir, shared=shared) as cluster:
        bench = Bench(cluster, workdir)
        figures: dict[str, object] = {"bench": "slurm", "nodes": 4, "used": 3, "step_time_s": STEP_TIME_S}
        crashes: dict[str, float] = {}
        for launcher in ("torchrun", "stead"):
            try:
                startup, crash = await bench.startup_and_crash(launcher)
                figures[f"startup_{launcher}_s"] = round(startup, 3)
                if isinstance(crash, str):
                    figures[f"worker_crash_{launcher}_s"], figures[f"worker_crash_{launcher}_note"] = None, crash
                else:
                    crashes[launcher] = crash
                    figures[f"worker_crash_{launcher}_s"] = round(crash, 3)
            except Failed as exc:
                figures[f"startup_{launcher}_s"] = figures[f"worker_crash_{launcher}_s"] = None
                figures[f"{launcher}_note"] = str(exc)
            print(f"{launcher}: launch -> first step {figures[f'startup_{launcher}_s']} s; crash -> new round "
                  f"stepping {figures[f'worker_crash_{launcher}_s']} s", flush=True)
        crash_t, crash_s = crashes.get("torchrun"), crashes.get("stead")
        ratio = _ratio(crash_t, crash_s)
        figures["worker_crash_ratio"] = ratio
        torchrun_loss = await bench.host_loss("torchrun")
        print(f"torchrun: a host killed: the job {torchrun_loss.get('host_loss_torchrun')} (srun exit "
              f"{torchrun_loss.get('host_loss_torchrun_exit')}); Slurm saw the node gone after "
              f"{torchrun_loss.get('slurm_detect_s')} s", flush=True)
        stead_loss = await bench.host_loss("stead")
        print(f"stead: a host killed: the spare's round stepping {stead_loss.get('host_loss_stead_s')} s after the "
              f"kill; Slurm saw the node gone after {stead_loss.get('slurm_detect_s')} s; then "
              f"{stead_loss.get('stead_step_after_detect')}", flush=True)
        figures["host_loss_torchrun"] = torchrun_loss.get("host_loss_torchrun")
        figures["host_loss_stead_s"] = stead_loss.get("host_loss_stead_s")
        figures["slurm_detect_s"] = stead_loss.get("slurm_detect_s") or torchrun_loss.get("slurm_detect_s")
        figures["stead_step_after_detect"] = stead_loss.get("stead_step_after_detect")
        figures["worker_crash_goal_met"] = crash_s is not None and crash_s <= 0.5 and (ratio or 0) >= 8
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same runs (one of each is all there is)")
    parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stead-bench-slurm-") as tmp:
        figures = asyncio.run(_measure(Path(tmp)))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
