"""Shared pieces of the e2e jobs: fault injection in training scripts, and the surviving history.

The surviving training history is that of a job whose rounds restored checkpoints (for exactly-once checks).

Each round's ranks log ``{"restored_step", "restored_round", "world"}`` then one
``[step, epoch, ids]`` line per step to ``logs/<round>-<rank>.jsonl``. The surviving
history is the final round's steps plus, back along the chain of checkpoints each
round restored, the steps up to that checkpoint of the round that wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["FAULT_FUNCTION", "SHARDED_SCRIPT", "surviving_history"]

#: source of the helpers a training script under test (which imports json, os and time) uses:
#: ``open_history(...)`` and ``record_step(...)`` write a round's history (see :func:`surviving_history`);
#: ``fault_due(step, rank, ckpt=None)`` injects the fault ``faults.json`` schedules there, once;
#: ``fault(kind, ckpt=None)`` injects one. The kinds of fault:
#:
#: - ``crash``: the worker exits 17;
#: - ``kill-agent``: SIGKILL to this node's agent (the node is lost, its shared memory with it);
#: - ``hang``: the worker stops itself (SIGSTOP), as a worker stuck in a collective would look;
#: - ``corrupt``: once ``ckpt`` (a :class:`stead.ckpt.Checkpoint`) has persisted its newest step, one byte of
#:   every memory slot of this rank is flipped, then the worker crashes: the restore must see the corruption and
#:   fall back to disk.
FAULT_FUNCTION = """
def open_history(attempt, rank, step, restored_from, world):
    # this round's history file, its first line saying where the round restored from
    log = open(f"logs/{attempt}-{rank}.jsonl", "w")
    log.write(json.dumps({"restored_step": step, "restored_round": restored_from, "world": world}) + "\\n")
    log.flush()
    return log


def record_step(log, step, epoch, ids):
    log.write(json.dumps([step, epoch, ids]) + "\\n")
    log.flush()


def fault_due(step, rank, ckpt=None):
    # inject the fault of faults.json scheduled at (step, rank), the first time a round gets there
    for i, f in enumerate(json.load(open("faults.json"))):
        if f["step"] == step and f["rank"] == rank and not os.path.exists(f"fault-{i}"):
            open(f"fault-{i}", "w").close()
            fault(f["kind"], ckpt)


def fault(kind, ckpt=None):
    import glob, signal
    if kind == "crash":
        os._exit(17)
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if kind == "corrupt":
        from stead.plugins.ckpt import segment_names
        ckpt.wait_persisted()
        time.sleep(0.2)
        names = segment_names(os.environ["STEAD_JOB"], os.environ["STEAD_NODE_ID"], 0,
                              os.environ.get("STEAD_CKPT_SHM_NAMESPACE", ""))
        for path in glob.glob(f"/dev/shm/{names.prefix}i*-r{os.environ['LOCAL_RANK']}-s*-g*"):
            with open(path, "r+b") as f:
                f.seek(8)
                byte = f.read(1)
                f.seek(8)
                f.write(bytes([byte[0] ^ 0xFF]))
        os._exit(17)
    pid = os.getpid()  # kill this node's agent: the node is lost, its shared memory with it
    while pid > 1:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        if b"stead agent" in open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" "):
            os.kill(pid, 9)
            time.sleep(60)
"""


def surviving_history(logs: Path) -> tuple[list[tuple[int, int, int, list[int]]], list[int]]:
    """The (rank, step, epoch, ids) of the final training history, and the world size of each round."""
    rounds: dict[int, dict[str, Any]] = {}
    for path in sorted(logs.glob("*.jsonl")):
        round_, rank = (int(x) for x in path.stem.split("-"))
        header, *lines = path.read_text().splitlines()
        info = rounds.setdefault(round_, {**json.loads(header), "steps": []})
        info["steps"] += [(rank, *json.loads(line)) for line in lines]
    history: list[tuple[int, int, int, list[int]]] = []
    round_, upto = max(rounds), None
    while round_ is not None:
        info = rounds[round_]
        history += [(r, s, e, ids) for r, s, e, ids in info["steps"] if upto is None or s <= upto]
        round_, upto = info["restored_round"], info["restored_step"]
    return history, [rounds[r]["world"] for r in sorted(rounds)]


#: a training script that reads a dataset of ids through ``ShardedSampler`` and an unchanged DataLoader, logs every
#: step's ids (``logs/<round>-<rank>.jsonl``), injects the faults of ``faults.json``, and every EVERY steps writes a
#: checkpoint of its own (rank 0, atomically: step, model, the sampler's cursor, ``ckpt.json`` in its folder), which
#: it restores on start; its arguments: N EPOCHS EVERY
SHARDED_SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
import stead
from stead.data import ShardedSampler
{FAULT}

N, EPOCHS, EVERY = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world, round_ = dist.get_rank(), dist.get_world_size(), int(os.environ["STEAD_ROUND"])
model = torch.nn.Linear(1, 1)
sampler = ShardedSampler("ids", size=N, shard_size=6, seed=11, epochs=EPOCHS, prefetch=2)
step, restored = 0, None
if os.path.exists("ckpt.json"):
    ckpt = json.load(open("ckpt.json"))
    step, restored = ckpt["step"], ckpt["round"]
    with torch.no_grad():
        model.weight.fill_(ckpt["w"])
        model.bias.fill_(ckpt["b"])
    sampler.load_state_dict(ckpt["cursor"])
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
log = open_history(round_, rank, step, restored, world)
loader = DataLoader(list(range(N)), batch_size=4, sampler=sampler)



while sampler.epoch < EPOCHS:
    epoch = sampler.epoch
    batches = iter(loader)
    while True:
        batch = next(batches, None)
        more = torch.tensor([0 if batch is None else 1])
        dist.all_reduce(more)  # ranks get different numbers of batches: step until every rank is done
        if more.item() == 0:
            break
        ids = [] if batch is None else batch.tolist()
        loss = ddp(torch.tensor(ids, dtype=torch.float32).reshape(-1, 1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        record_step(log, step, epoch, ids)
        stead.report_step(step)
        fault_due(step, rank)
        if step % EVERY == 0:
            cursor = sampler.state_dict()  # every rank: it gathers every rank's progress
            if rank == 0:
                body = {"step": step, "round": round_, "w": model.weight.item(), "b": model.bias.item(),
                        "cursor": cursor}
                with open("ckpt.json.tmp", "w") as f:
                    json.dump(body, f)
                os.replace("ckpt.json.tmp", "ckpt.json")
if rank == 0:
    print(f"finished round={round_} world={world} step={step}", flush=True)
dist.destroy_process_group()
""".replace("{FAULT}", FAULT_FUNCTION)
