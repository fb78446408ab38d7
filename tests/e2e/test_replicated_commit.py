"""Commit means replicated, on test hosts (network namespaces, tests.support.hosts): steps much faster than a
replica's transfer, a host killed, and its node's replacement resumes from the replicated step or a newer one, read
from a peer host's memory, with no disk read.

Without "commit means replicated" the survivors' slots ran ahead of the copies on their way, no step was in every
rank's reach, and the replacement read disk (here: nothing, each host keeps its checkpoints on a disk of its own).
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import sys
import time
from pathlib import Path
from typing import cast

import pytest

from tests.e2e.test_hosts_jobs import _ended, _events, _stead_run, _steps, _until_step
from tests.support.hosts import test_hosts

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

#: a state of 24 MiB per rank saved every step of ~10 ms: a copy to the other host takes several steps
SCRIPT = '''
import argparse, os, time
import torch, torch.distributed as dist
from stead.ckpt import FlashCheckpointer

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int)
parser.add_argument("--timestamps")
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
ckpt = FlashCheckpointer(size_hint=24 << 20)
state = {"w": torch.zeros(6 << 20), "step": -1}
first = 0
restored = ckpt.load(state)
if restored is not None:
    step, saved = restored
    assert saved["step"] == step and float(saved["w"][0]) == step + 1000 * rank, (step, float(saved["w"][0]))
    first = step + 1
with open(args.timestamps, "a") as log:
    for step in range(first, args.steps):
        time.sleep(0.01)
        state["w"].fill_(step + 1000 * rank)
        state["step"] = step
        ckpt.save(step, state)
        dist.barrier()
        log.write(f"{rank} {restart} {step} {time.time():.6f}\\n")
        log.flush()
ckpt.close()
dist.destroy_process_group()
'''


@pytest.mark.long(35)
async def test_steps_faster_than_a_replica_s_transfer_and_a_host_killed_resume_from_the_replicated_step_or_newer(
        tmp_path: Path) -> None:
    """Each host keeps its checkpoints on a disk of its own (the default ckpt.dir, in each host's own folder): the
    spare that takes the lost host's place can read none of them."""
    token = secrets.token_urlsafe(32)
    timestamps = tmp_path / "steps.log"
    script = tmp_path / "train_big.py"
    script.write_text(SCRIPT)
    async with test_hosts(3) as hosts:
        flags = ["--nnodes", "2:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:29400",
                 "--rdzv-id", "replicated", "--rdzv-conf", "heartbeat=5"]
        args = [str(script), "--steps", "400", "--timestamps", str(timestamps)]
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, *args], token)
        joining = [await _stead_run(hosts[1], tmp_path / "h1", [*flags, *args], token)]
        await _until_step(timestamps, 15, world=2)
        joining.append(await _stead_run(hosts[2], tmp_path / "h2", [*flags, *args], token))  # the spare
        # a step replicated everywhere first (the first copies are the slowest: segments made, buffers mapped; on a
        # loaded machine several seconds), then the steps run on ahead of the copies for a while
        async with asyncio.timeout(120):
            while not any(e["type"] == "ckpt.replicated"  # noqa: ASYNC110 (another process writes the log)
                          for e in await _events(hosts[0], tmp_path / "h0", "replicated")):
                await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)
        killed_at = time.time()
        await hosts.kill(1)
        (rc0, err0), (rc2, err2) = await _ended(serving), await _ended(joining[1])
        events = await _events(hosts[0], tmp_path / "h0", "replicated")
        rc, status, _ = await hosts[0].run([sys.executable, "-m", "stead", "status", "--job", "replicated"],
                                           cwd=tmp_path / "h0")
    assert (rc0, rc2, rc) == (0, 0, 0), (err0[-3000:], err2[-3000:], status)
    of_type: dict[object, list[dict[str, int]]] = collections.defaultdict(list)
    for e in events:
        of_type[e["type"]].append(cast(dict[str, int], e["data"]))
    restored = of_type["ckpt.restored"]
    after = restored[-1]  # the round the spare joined: rank 0 from its own memory, rank 1 from h0's replica
    assert (after["memory_ranks"], after["peer_ranks"], after["disk_ranks"]) == (1, 1, 0), restored
    assert 0 <= after["replicated_step"] <= after["step"] <= after["committed_step"], after
    # the steps outran the copies: most saves were skipped while a copy was on its way, the commits following the
    # replicas' pace (each step replicated everywhere before the next one was copied)
    commits, replicated = len(of_type["checkpoint.committed"]), len(of_type["ckpt.replicated"])
    assert 2 <= replicated <= commits < 400 // 2, (replicated, commits)
    resumed = [int(step) for rank, _, step, at in (line.split() for line in timestamps.read_text().splitlines())
               if rank == "1" and float(at) > killed_at]
    assert resumed and min(resumed) == after["step"] + 1, (after, resumed[:3])
    assert max(_steps(timestamps).values()) == 399
    assert "replicated: step" in status, status
    assert f"restored   last: step {after['step']}: memory 1, peer 1 (" in status, status
    # the killed host's node ended once (its host hung up, or its heartbeats stopped) and came back on the spare
    ended = [e["data"] for e in events if (e["type"] == "node.lost" and not e["data"]["reason"].startswith("retired"))
             or (e["type"] == "node.exited" and "hung up" in e["data"]["reason"])]
    assert len(ended) == 1, ended
    started = [(e["data"]["node_id"], e["data"]["host"]) for e in events if e["type"] == "node.started"]
    assert started[-1] == (ended[0]["node_id"], "h2"), started
