"""The chaos job: a deterministic `stead run` job driven through a seeded fault schedule.

The job (2 nodes x 2 gloo workers, CPU) trains a float64 linear model on a dataset
of ids read through ``ShardedSampler`` (exactly-once, leased by the master) and saves
model, optimizer and sampler cursor with flash checkpoints (persisted to disk) every
few steps. The update is built to be exact and order-free: integer-valued features,
dyadic initial weights, a power-of-two learning rate and world size, plain SGD. So
the final weights are a function of *which* samples were trained on, each how many
times, and nothing else: whatever the shard leasing order, a fault-free run ends on
the same bits (:func:`expected_weights` computes them). Any sample trained twice or
never, and any restore that brings back other weights than the ones saved with its
cursor, changes them.

Faults are of two sorts. The workers inject theirs at a (step, rank) the first time
they reach it (``faults.json``): ``crash``, ``kill-agent``, ``hang`` (SIGSTOP), and
``corrupt`` (flips a byte of every memory slot of the rank, then crashes). The driver
injects the others when rank 0 has logged a step: ``kill-master`` (SIGKILL to the pid
``stead status --json`` reports; `stead run` starts another) and ``etcd-outage``
(the etcd server is stopped for ``outage_s``, then started again on its data).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stead.testing.etcd import EtcdServer
from tests.support.history import FAULT_FUNCTION

__all__ = ["DRIVER_KINDS", "HOST_KINDS", "WORKER_KINDS", "ChaosResult", "Fault", "expected_weights", "run_chaos",
           "run_chaos_on_hosts", "schedule"]

NODES, NPROC = 2, 2
WORLD = NODES * NPROC
BATCH, SHARD, EVERY = 4, 8, 3
EPOCHS = 2
LR_EXP = -12

WORKER_KINDS = ("crash", "kill-agent", "hang", "corrupt")
DRIVER_KINDS = ("kill-master", "etcd-outage")

SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from stead.ckpt import Checkpoint
from stead.data import ShardedSampler
{FAULT}

N, EPOCHS, EVERY, BATCH, SHARD, LR_EXP = (int(a) for a in sys.argv[1:7])
torch.manual_seed(0)
dist.init_process_group("gloo")
rank, world, round_ = dist.get_rank(), dist.get_world_size(), int(os.environ["STEAD_ROUND"])
model = torch.nn.Linear(4, 1, dtype=torch.float64)
with torch.no_grad():  # dyadic weights with few bits: every sum below is exact
    model.weight.copy_(torch.randint(-8, 8, (1, 4), generator=torch.Generator().manual_seed(0)) / 16)
    model.bias.fill_(0.25)
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=2.0 ** LR_EXP)
sampler = ShardedSampler("ids", size=N, shard_size=SHARD, seed=7, epochs=EPOCHS, prefetch=2)
ckpt = Checkpoint(model=ddp, optimizer=opt, sampler=sampler, extra={"round": round_})
restored = ckpt.restore()
step, restored_round = (0, None) if restored is None else (restored, ckpt.extra["round"])
log = open_history(round_, rank, step, restored_round, world)
loader = DataLoader(list(range(N)), batch_size=BATCH, sampler=sampler)


def features(ids):
    rows = [[i % 7, i % 5 - 2, (i * i) % 11, 1] for i in ids]
    return torch.tensor(rows, dtype=torch.float64)



while sampler.epoch < EPOCHS:
    epoch = sampler.epoch
    for batch in loader:
        ids = batch.tolist()
        loss = ddp(features(ids)).sum()  # linear in the weights: the gradient is a sum of integer rows
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        record_step(log, step, epoch, ids)
        time.sleep(float(os.environ.get("CHAOS_STEP_S", "0.02")))
        fault_due(step, rank, ckpt)
        if step % EVERY == 0:
            ckpt.extra = {"round": round_}
            ckpt.save(step, persist=True)
ckpt.wait_persisted()
if rank == 0:
    weights = [float(x) for x in torch.cat([p.detach().reshape(-1) for p in model.parameters()])]
    with open("weights.json.tmp", "w") as f:
        json.dump([x.hex() for x in weights], f)
    os.replace("weights.json.tmp", "weights.json")
dist.destroy_process_group()
""".replace("{FAULT}", FAULT_FUNCTION)


@dataclasses.dataclass(frozen=True)
class Fault:
    step: int
    kind: str
    rank: int = 0


@dataclasses.dataclass
class ChaosResult:
    returncode: int
    stderr: str
    weights: list[float] | None
    fired: list[Fault]
    cwd: Path


def steps_per_rank(n: int) -> int:
    return EPOCHS * n // (WORLD * BATCH)


def schedule(seed: int, count: int, n: int, *, kinds: tuple[str, ...] = WORKER_KINDS + DRIVER_KINDS,
             outages: int = 1) -> list[Fault]:
    """``count`` faults at distinct steps, spread over the job, drawn from ``kinds`` with ``seed``.

    At most ``outages`` of them are etcd outages; a worker fault names a random rank.
    """
    rng = random.Random(seed)
    last = steps_per_rank(n) - EVERY
    gap = max(EVERY + 1, last // (count + 1))
    faults = []
    for i in range(count):
        pool = [k for k in kinds if k != "etcd-outage" or sum(f.kind == k for f in faults) < outages]
        faults.append(Fault(step=min(last, (i + 1) * gap + rng.randrange(0, max(1, gap // 2))),
                            kind=rng.choice(pool), rank=rng.randrange(WORLD)))
    return faults


def expected_weights(n: int) -> list[float]:
    """The weights a fault-free run ends with: every id trained on once per epoch, in any order."""
    import torch

    weight = torch.randint(-8, 8, (1, 4), generator=torch.Generator().manual_seed(0)).to(torch.float64) / 16
    bias = torch.tensor([0.25], dtype=torch.float64)
    rows = torch.tensor([[i % 7, i % 5 - 2, (i * i) % 11, 1] for i in range(n)], dtype=torch.float64)
    lr = 2.0 ** LR_EXP
    # DDP averages the ranks' gradients: each sample contributes lr * row / WORLD, once per epoch
    weight = weight - EPOCHS * lr * rows[:, :4].sum(0, keepdim=True) / WORLD
    bias = bias - EPOCHS * lr * torch.tensor([float(n)], dtype=torch.float64) / WORLD
    return [float(x) for x in torch.cat([weight.reshape(-1), bias])]


def _rank0_step(logs: Path) -> int:
    best = 0
    for path in logs.glob("*-0.jsonl"):
        lines = path.read_text().splitlines()
        if len(lines) > 1:
            try:
                best = max(best, json.loads(lines[-1])[0])
            except (ValueError, IndexError):  # a line being written
                continue
    return best


def _master_pid(cwd: Path, job: str, store: str) -> int | None:
    out = subprocess.run([sys.executable, "-m", "stead", "status", "--job", job, "--store", store, "--json"],
                         cwd=cwd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return None
    pid = json.loads(out.stdout).get("master_pid")
    return int(pid) if pid else None


def run_chaos(cwd: Path, n: int, faults: list[Fault], *, store: str, etcd: EtcdServer | None = None,
              outage_s: float = 20.0, timeout_s: float = 600.0, flags: tuple[str, ...] = ()) -> ChaosResult:
    """Run the chaos job in ``cwd`` under ``faults``; the driver's faults are injected from here."""
    (cwd / "train.py").write_text(SCRIPT)
    (cwd / "logs").mkdir()
    worker_faults = [dataclasses.asdict(f) for f in faults if f.kind in WORKER_KINDS]
    (cwd / "faults.json").write_text(json.dumps(worker_faults))
    driver = [f for f in faults if f.kind in DRIVER_KINDS]
    fired: list[Fault] = []
    command = [sys.executable, "-m", "stead", "run", "--job-name", "chaos", "--store", store, "--log-format", "json",
               "--nnodes", str(NODES), "--nproc-per-node", str(NPROC), "--max-restarts", "1000",
               "--max-node-relaunches", "1000",
               "--set", "diagnosis.hang_floor_s=3", "--set", "diagnosis.stacks_wait_s=1",
               "--set", f"master_max_restarts={1 + sum(f.kind == 'kill-master' for f in faults)}", *flags,
               "train.py", str(n), str(EPOCHS), str(EVERY), str(BATCH), str(SHARD), str(LR_EXP)]
    deadline = time.monotonic() + timeout_s
    outage_ends: float | None = None
    killed: set[int] = set()
    with (cwd / "stderr.log").open("wb") as err:
        run = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        while run.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the chaos job did not end within {timeout_s:g} s; fired {fired}; its log "
                                     f"ends:\n{_tail(cwd)}")
            if outage_ends is not None and time.monotonic() >= outage_ends:
                assert etcd is not None
                etcd.start()
                outage_ends = None
            step = _rank0_step(cwd / "logs")
            for fault in [f for f in driver if f.step <= step and f not in fired]:
                if fault.kind == "kill-master":
                    pid = _master_pid(cwd, "chaos", store)
                    if pid is None or pid in killed:
                        continue  # the store is away, or the next master has not announced itself yet
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    killed.add(pid)
                elif outage_ends is None:
                    assert etcd is not None, "an etcd outage needs the job on etcd"
                    etcd.stop()
                    outage_ends = time.monotonic() + outage_s
                else:
                    continue
                fired.append(fault)
            time.sleep(0.1)
    finally:
        if outage_ends is not None and etcd is not None:
            etcd.start()
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=120)
    fired += [f for f in faults if f.kind in WORKER_KINDS
              and (cwd / f"fault-{worker_faults.index(dataclasses.asdict(f))}").exists()]
    weights_path = cwd / "weights.json"
    weights = [float.fromhex(x) for x in json.loads(weights_path.read_text())] if weights_path.exists() else None
    return ChaosResult(run.returncode, (cwd / "stderr.log").read_text(errors="replace"), weights, fired, cwd)


def _tail(cwd: Path) -> str:
    return "\n".join((cwd / "stderr.log").read_text(errors="replace").splitlines()[-40:])


def bits(values: list[float]) -> list[str]:
    """The IEEE-754 bits of each value, for a bit-for-bit comparison that a reader can see."""
    return [struct.pack(">d", v).hex() for v in values]


def as_json(result: ChaosResult, **extra: Any) -> str:
    return json.dumps({"returncode": result.returncode, "faults": len(result.fired),
                       "kinds": sorted({f.kind for f in result.fired}), **extra})


#: the faults the driver injects on the test hosts (tests.support.hosts): a node's host killed (every process, its
#: memory; it comes back empty and runs the command again: the job's spare), or cut off for PARTITION_S (past the
#: heartbeat timeout: its node is lost; it heals and its `stead run` is the spare)
HOST_KINDS = ("kill-host", "partition")
HOSTS_HEARTBEAT_S = 3.0
HOSTS_STEP_S = 0.25
PARTITION_S = 2 * HOSTS_HEARTBEAT_S


async def run_chaos_on_hosts(hosts: Any, cwd: Path, n: int, faults: list[Fault], *, token: str,
                             timeout_s: float = 600.0) -> ChaosResult:
    """The chaos job over three test hosts, every host in the shared folder ``cwd``: ``--nnodes 2:2`` with c10d at
    h0 (the master's host, never a host fault's target), its two nodes on two hosts and the third host the spare
    that takes a lost node's place, so that the world (and so the weights) stays the same. Worker faults as in
    :func:`run_chaos`; host faults (:data:`HOST_KINDS`) hit a host that runs a node, other than h0."""
    import asyncio

    (cwd / "train.py").write_text(SCRIPT)
    (cwd / "logs").mkdir()
    worker_faults = [dataclasses.asdict(f) for f in faults if f.kind in WORKER_KINDS]
    (cwd / "faults.json").write_text(json.dumps(worker_faults))
    driver = [f for f in faults if f.kind in HOST_KINDS]
    # slower steps than on one host: a host fault (found from the job's log, then done) lands while the job runs
    env = {**os.environ, "STEAD_JOB_TOKEN": token, "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1",
           "CHAOS_STEP_S": str(HOSTS_STEP_S)}
    command = [sys.executable, "-m", "stead", "run", "--job-name", "chaos", "--log-format", "json",
               "--nnodes", f"{NODES}:{NODES}", "--nproc-per-node", str(NPROC), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{hosts[0].address}:29400", "--rdzv-conf", f"heartbeat={HOSTS_HEARTBEAT_S:g}",
               "--max-restarts", "1000", "--max-node-relaunches", "1000",
               "--set", "diagnosis.hang_floor_s=3", "--set", "diagnosis.stacks_wait_s=1",
               "train.py", str(n), str(EPOCHS), str(EVERY), str(BATCH), str(SHARD), str(LR_EXP)]

    async def start(i: int) -> Any:
        with (cwd / f"stderr-h{i}-{time.monotonic_ns()}.log").open("wb") as err:
            return await hosts[i].spawn(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err)

    runs = {i: await start(i) for i in range(3)}
    fired: list[Fault] = []
    deadline = time.monotonic() + timeout_s
    try:
        while runs[0].returncode is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the chaos job did not end within {timeout_s:g} s; fired {fired}; its log "
                                     f"ends:\n{_tail_hosts(cwd)}")
            step = _rank0_step(cwd / "logs")
            due = [f for f in driver if f not in fired and f.step <= step + 2]
            victim = _node_host(cwd, skip=0) if due else None  # (read ahead: reading the log takes a while)
            for fault in [f for f in due if f.step <= _rank0_step(cwd / "logs")]:
                if victim is None:
                    continue  # the node's host is not known yet
                if fault.kind == "kill-host":
                    await hosts.kill(victim)
                    await runs[victim].wait()
                    await hosts.restart(victim)
                else:
                    await hosts.partition(victim)
                    await asyncio.sleep(PARTITION_S)
                    await hosts.heal(victim)
                if runs[victim].returncode is not None:  # (killed, or gave its node up): the spare again
                    runs[victim] = await start(victim)
                fired.append(fault)
                break
            await asyncio.sleep(0.1)
        for run in runs.values():  # every host is told the job's end; a host cut off past it is stopped
            try:
                async with asyncio.timeout(30):
                    await run.wait()
            except TimeoutError:
                run.kill()
                await run.wait()
    finally:
        for run in runs.values():
            if run.returncode is None:
                run.kill()
                await run.wait()
    fired += [f for f in faults if f.kind in WORKER_KINDS
              and (cwd / f"fault-{worker_faults.index(dataclasses.asdict(f))}").exists()]
    weights_path = cwd / "weights.json"
    weights = [float.fromhex(x) for x in json.loads(weights_path.read_text())] if weights_path.exists() else None
    return ChaosResult(runs[0].returncode or 0, _tail_hosts(cwd, lines=400), weights, fired, cwd)


def _node_host(cwd: Path, *, skip: int) -> int | None:
    """The index of a host that runs a node of the job now, other than ``skip`` (from the job's log)."""
    out = subprocess.run([sys.executable, "-m", "stead", "events", "--job", "chaos", "--json"], cwd=cwd,
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return None
    where: dict[tuple[str, int], str] = {}
    for line in out.stdout.splitlines():
        event = json.loads(line)
        key = (event["data"].get("node_id"), event["data"].get("incarnation"))
        if event["type"] == "node.started":
            where[key] = event["data"]["host"]
        elif event["type"] in ("node.exited", "node.lost"):  # (an old incarnation's end may come after the new start)
            where.pop(key, None)
    running = sorted(int(host[1:]) for host in where.values() if host.startswith("h") and host[1:].isdigit())
    return next((i for i in running if i != skip), None)


def _tail_hosts(cwd: Path, lines: int = 40) -> str:
    return "\n".join(f"{log.name}: {line}" for log in sorted(cwd.glob("stderr-h*.log"))
                     for line in log.read_text(errors="replace").splitlines()[-lines:])
