"""FSDP2 (DTensor) state: each of two gloo ranks saves only its shard, restores it, DCP reads the files, and a
resized job (one rank, then three) gets the shards resharded."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from .conftest import Cluster

SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from stead.ckpt import FlashCheckpointer

    phase, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0 if phase == "save" else 1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))  # 5 rows: uneven shards
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = FlashCheckpointer()
    if phase == "save":
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "epoch": 4}
        assert ckpt.save(1, state)
        assert ckpt.save(2, state, persist=True)
        assert ckpt.wait_persisted(60) == 2
        full = {k: v.full_tensor() for k, v in model_sd.items()}
        if dist.get_rank() == 0:
            torch.save(full, out)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        step, state = ckpt.load({"model": model_sd, "optim": optim_sd})
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full = {k: v.full_tensor() for k, v in get_state_dict(model, opt)[0].items()}
        expected = torch.load(out, weights_only=True)
        assert step == 2 and state["epoch"] == 4, (step, state.get("epoch"))
        assert all(torch.equal(full[k], expected[k]) for k in expected), "restored weights differ"
        print("restored", step, flush=True)
    ckpt.close()
    dist.destroy_process_group()
    # fully_shard keeps the process group alive past destroy_process_group() (torch holds it, not this script):
    # its threads would be torn down in the interpreter's shutdown, where torch may abort the process. Exit as
    # a worker forked by stead does, without that shutdown.
    sys.stdout.flush()
    os._exit(0)
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_ranks(cluster: Cluster, script: Path, phase: str, out: Path, round_: int, world: int = 2) -> list[str]:
    ext = cluster.agents["node-0"]
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**ext.worker_env(round=round_, local_rank=rank), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "STEAD_ROUND": str(round_), "STEAD_JOB": cluster.job, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
        procs.append(subprocess.Popen([sys.executable, str(script), phase, str(out)], env=env, cwd=script.parent,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output[-3000:]
        outputs.append(output)
    return outputs


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_shards_are_saved_per_rank_restored_in_place_and_readable_by_dcp(cluster: Cluster,
                                                                               tmp_path: Path) -> None:
    script = tmp_path / "fsdp_worker.py"
    script.write_text(SCRIPT)
    out = tmp_path / "expected.pt"
    cluster.agent(nproc=2)
    cluster.round(1, world=2, nproc=2)
    _run_ranks(cluster, script, "save", out, 1)
    cluster.failure()
    cluster.round(2, restart_count=1, world=2, nproc=2)
    outputs = _run_ranks(cluster, script, "restore", out, 2)
    assert all("restored 2" in o for o in outputs)
    assert all("tier=memory" in o for o in outputs), outputs
    expected = torch.load(out, weights_only=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "epoch": 0}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt" / cluster.job / "step_2"), no_dist=True)
    assert all(torch.equal(target["model"][k], expected[k]) for k in expected)
    assert target["epoch"] == 4
    cluster.round(3, world=1, nproc=1)  # the job shrank to one rank: the two shards are resharded into one
    [resharded] = _run_ranks(cluster, script, "restore", out, 3, world=1)
    assert "restored 2" in resharded and "ckpt_resharding" in resharded, resharded
    cluster.round(4, world=3, nproc=3)  # grown to three: rank 1's rows 2-3 come from both saved shards (0-2, 3-4)
    grown = _run_ranks(cluster, script, "restore", out, 4, world=3)
    assert all("restored 2" in o and "ckpt_resharding" in o for o in grown), grown
