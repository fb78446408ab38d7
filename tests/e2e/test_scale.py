"""Elastic membership end to end: a `stead run --nnodes 1:3` job with real gloo workers grows and shrinks.

The job starts on one node (``--start-nodes 1``). Rank 0 runs ``stead scale --nodes 2`` once it has trained a
little, then ``stead scale --nodes 3``; on three nodes, a rank of node-2 kills its agent, which is not replaced
(``--max-node-relaunches 0``): the job goes on with two. The script keeps its global batch constant with
:func:`stead.data.accumulation_steps`, saves a flash checkpoint (model and sampler cursor) every step, restores
it in each new round, and trains whole epochs until every change happened.

Its loss is linear in the weights, scaled so that DDP's average is a sum: the weights after E epochs are
exactly what a run without any resize or fault gets, ``-lr * E * sum(ids)``, whatever the world sizes and
rollbacks. Every id is consumed exactly once per epoch in the surviving history.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.history import FAULT_FUNCTION, surviving_history

pytestmark = pytest.mark.e2e

N, LR, GLOBAL_BATCH, MICRO = 96, 2.0**-10, 24, 2

TRAIN = """
import json, os, subprocess, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
import stead
from stead.ckpt import FlashCheckpointer
from stead.data import ShardedSampler, accumulation_steps
{FAULT}

N, LR, GLOBAL_BATCH, MICRO, MAX_EPOCHS = 96, 2.0 ** -10, 24, 2, 200
dist.init_process_group("gloo")
rank, world, round_ = dist.get_rank(), dist.get_world_size(), int(os.environ["STEAD_ROUND"])
model = torch.nn.Linear(1, 1).double()
with torch.no_grad():
    model.weight.zero_()
    model.bias.zero_()
sampler = ShardedSampler("ids", size=N, shard_size=4, seed=5, epochs=MAX_EPOCHS, prefetch=1)
ckpt = FlashCheckpointer()
step, restored = 0, None
found = ckpt.load({"model": model.state_dict()})
if found is not None:
    step, state = found
    restored = state["round"]
    sampler.load_state_dict(state["cursor"])
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=LR)
accum = accumulation_steps(GLOBAL_BATCH, MICRO)  # the global batch stays 24 on 2, 4 or 6 ranks
log = open_history(round_, rank, step, restored, world)
loader = DataLoader(list(range(N)), batch_size=MICRO, sampler=sampler)
epochs_here = 0


def once(name):
    if os.path.exists(name):
        return False
    open(name, "w").close()
    return True


def scale(nodes):
    out = open(f"scale-{nodes}.out", "w")
    subprocess.Popen([sys.executable, "-m", "stead", "scale", "--job", os.environ["STEAD_JOB"], "--nodes",
                      str(nodes), "--reason", "e2e"], stdout=out, stderr=subprocess.STDOUT)


while sampler.epoch < MAX_EPOCHS:
    epoch = sampler.epoch
    batches = iter(loader)
    while True:
        ids, more = [], 0
        for _ in range(accum):
            batch = next(batches, None)
            if batch is not None:
                ids += batch.tolist()
                more = 1
        flag = torch.tensor([more])
        dist.all_reduce(flag)  # ranks get different numbers of batches: step until every rank is done
        if flag.item() == 0:
            break
        x = torch.tensor(ids, dtype=torch.float64).reshape(-1, 1)
        loss = ddp(x).sum() * world  # DDP averages over ranks: times world, the step's update is the global sum
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        record_step(log, step, epoch, ids)
        stead.report_step(step)
        ckpt.save(step, {"model": model.state_dict(), "cursor": sampler.state_dict(), "round": round_})
        time.sleep(0.1)
        if rank == 0 and world == 2 and step >= 3 and once("asked-2"):
            scale(2)
        if rank == 0 and world == 4 and found is not None and once("asked-3"):
            scale(3)
        if rank == 4 and world == 6 and found is not None and step >= found[0] + 2 and once("killed"):
            fault("kill-agent")
    epochs_here += 1
    done = torch.tensor([int(os.path.exists("killed") and world == 4 and epochs_here >= 1)])
    dist.all_reduce(done)
    if done.item():
        break
if rank == 0:
    json.dump({"w": model.weight.item(), "b": model.bias.item(), "epochs": sampler.epoch, "world": world,
               "round": round_}, open("final.json", "w"))
ckpt.close()
dist.destroy_process_group()
""".replace("{FAULT}", FAULT_FUNCTION)


@pytest.mark.long(30)
def test_a_job_grows_with_stead_scale_shrinks_on_a_lost_node_and_keeps_its_weights_and_samples_exact(
        run_job: Any, tmp_path: Path) -> None:
    (tmp_path / "faults.json").write_text("[]")
    (tmp_path / "logs").mkdir()
    job = run_job(TRAIN, job="grow", flags=("--nnodes", "1:3", "--start-nodes", "1", "--nproc-per-node", "2",
                                            "--max-node-relaunches", "0", "--rdzv-conf", "last_call_timeout=0.5",
                                            "--set", "resize_wait_s=5"))
    assert job.returncode == 0, job.stderr[-6000:]
    for asked in (2, 3):
        said = (tmp_path / f"scale-{asked}.out").read_text()
        assert f"job 'grow': target {asked} nodes (was {asked - 1})" in said, said
    final = json.loads((tmp_path / "final.json").read_text())
    epochs = final["epochs"]
    assert final["world"] == 4 and epochs >= 2
    assert final["w"] == -LR * epochs * sum(range(N)) and final["b"] == -LR * epochs * N  # exact: a fault-free run's

    history, worlds = surviving_history(tmp_path / "logs")
    assert worlds[0] == 2 and 4 in worlds and 6 in worlds and worlds[-1] == 4
    steps = [(r, s) for r, s, _, _ in history]
    assert len(steps) == len(set(steps))
    for epoch in range(epochs):
        ids = collections.Counter(i for _, _, e, batch in history if e == epoch for i in batch)
        assert ids == collections.Counter(range(N)), f"epoch {epoch}: {sorted(ids.items())[:20]}"

    decided = job.records("grow", "membership.decided")
    assert [d["target"] for d in decided] == [2, 3]
    rounds = job.records("grow", "round.started")
    assert [len(r["members"]) for r in rounds][:3] == [1, 2, 3] and len(rounds[-1]["members"]) == 2
    assert all(r["restart_count"] == 0 for r in rounds)  # resizes and the shrink spend no restart
    gone = [*job.records("grow", "node.lost"), *job.records("grow", "node.exited")]
    assert gone[0]["node_id"] == "node-2"  # killed mid-run (its agent's exit, or its silence), and not replaced
    assert not [r for r in job.records("grow", "node.requested") if r["incarnation"] > 1]


OOM_TRAIN = """
import os, sys
import torch, torch.distributed as dist
from stead.data import batch_size

dist.init_process_group("gloo")
rank = dist.get_rank()
batch = batch_size(32)
if rank == 1 and batch > 8:  # what fits in this worker's memory: 8 samples
    raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch * 64} MiB for a batch of {batch}")
dist.all_reduce(torch.ones(1))
if rank == 0:
    print(f"trained with batch {batch}", flush=True)
dist.destroy_process_group()
"""


def test_an_out_of_memory_worker_restarts_with_half_the_batch_until_it_fits(run_job: Any) -> None:
    job = run_job(OOM_TRAIN, job="oom", flags=("--nproc-per-node", "2", "--max-restarts", "3"))
    assert job.returncode == 0, job.stderr[-6000:]
    assert "trained with batch 8" in job.stdout
    answered = job.records("oom", "scaler.oom")
    assert [(a["ooms"], a["batch_scale"]) for a in answered] == [(1, 0.5), (2, 0.25)]
    decided = job.records("oom", "recovery.decided")
    assert [d["failure_class"] for d in decided] == ["oom", "oom"] and all(d["action"] == "restart" for d in decided)


EMBEDDED = """
import asyncio, sys
import stead.embed as embed
from stead.core.errors import InvalidRequest

async def main(train, workdir):
    spec = embed.JobSpec(entrypoint=(train, "--steps", "100000", "--step-time", "0.02"), nnodes="1:2",
                         job_name="embedded-scale", store_url=f"sqlite:///{workdir}/state.db",
                         extra_args=("--start-nodes", "1"))
    async with embed.run(spec, token_file=f"{workdir}/token") as job:
        await job.wait(embed.JobPhase.RUNNING, timeout_s=120)
        try:
            await job.scale(3)
        except InvalidRequest as exc:
            print("refused:", exc)
        got = await job.scale(2, reason="more data")
        print(f"scaled: target {got.target} (was {got.previous})")
        grown = await job.wait(lambda s: s.rdzv.active and len(s.rdzv.members) == 2, timeout_s=120)
        print(f"grown: round {grown.rdzv.round} with {','.join(grown.rdzv.members)}")
        final = await job.stop()
        print("ended:", final.phase.value)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.extended("a running job grown: the stead scale test above (the ScalerService RPC the embedding API "
                      "calls); a request outside MIN:MAX refused: tests/cli/test_commands.py; the embedding API "
                      "running a job: tests/e2e/test_run.py's README embedding example")
def test_the_embedding_api_scales_a_running_job(tmp_path: Path) -> None:
    (tmp_path / "embedded.py").write_text(EMBEDDED)
    train = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    out = subprocess.run([sys.executable, "embedded.py", str(train), str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "refused: ScalerService.Scale: --nodes 3 is outside the job's MIN:MAX 1:2" in out.stdout, out.stdout
    assert "scaled: target 2 (was 1)" in out.stdout
    assert "grown: round 2 with node-0,node-1" in out.stdout and "ended: stopped" in out.stdout
