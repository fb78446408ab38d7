"""After a node is replaced, the two ranks of a job (one per node, gloo) agree on the step and each restores it
from the best copy it has: its memory, its own copy on disk, or the other rank's copy of a replicated state."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stead.core.config import Settings
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import FlashCheckpointer
from stead.testing.steps import free_port

from .conftest import Cluster
from .test_flash import _wait_checksummed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NODES = ("node-0", "node-1")

LOAD = textwrap.dedent("""
    import json, os, torch.distributed as dist
    from stead.ckpt import FlashCheckpointer

    dist.init_process_group("gloo")
    with FlashCheckpointer() as ckpt:
        found = ckpt.load()
    print(json.dumps(None if found is None else [found[0], found[1]["w"].tolist()]), flush=True)
    dist.destroy_process_group()
    # torch's threads of the process group, still running although the checkpointer is still in scope?
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    print(json.dumps(sorted(name for name in names if name.startswith(("pt_", "gloo")))), flush=True)
""")


def _round(cluster: Cluster, round_: int) -> None:
    for rank, node in enumerate(NODES):
        cluster.round(round_, node_id=node, world=2, node_rank=rank, restart_count=round_ - 1)


def _start(cluster: Cluster) -> tuple[FlashCheckpointer, FlashCheckpointer]:
    """Round 1 on two nodes, one rank each: the ranks' checkpointers."""
    for node in NODES:
        cluster.agent(node)
    _round(cluster, 1)
    return tuple(cluster.worker(node_id=node, rank=rank, world=2, local_rank=0)  # type: ignore[return-value]
                 for rank, node in enumerate(NODES))


def _save(ranks: tuple[FlashCheckpointer, ...], step: int, value: float, *, differ: bool = False,
          persist: bool = False) -> None:
    for rank, ckpt in enumerate(ranks):
        assert ckpt.save(step, {"w": torch.full((16,), value + (rank if differ else 0))}, persist=persist)


def _replace_node_1(cluster: Cluster) -> list[Any]:
    """node-1 relaunched (nothing in memory), round 2 on both nodes: what each rank's load() gives."""
    cluster.agent("node-1", incarnation=2)
    _round(cluster, 2)
    script = cluster.tmp / "load.py"
    script.write_text(LOAD)
    port = free_port()
    procs = []
    for rank, node in enumerate(NODES):
        env = {**cluster.agents[node].worker_env(round=2, local_rank=0), "RANK": str(rank), "LOCAL_RANK": "0",
               "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "STEAD_ROUND": "2",
               "STEAD_JOB": cluster.job, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=cluster.tmp,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    found = []
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output[-3000:]
        *_, restored, left_running = output.strip().splitlines()
        assert json.loads(left_running) == [], f"the process group outlived destroy_process_group():\n{output}"
        found.append(json.loads(restored))
    return found


def _on_disk(cluster: Cluster, step: int) -> list[str]:
    return sorted(p.name for p in (Path(cluster.settings.dir) / cluster.job / f"step_{step}").glob("rank_*.json"))


@pytest.fixture
def quiet(tmp_path: Path, settings: CheckpointSettings) -> Iterator[Cluster]:
    """A cluster whose agents write nothing to disk when a worker fails or a round restarts (only on a stop)."""
    calm = dataclasses.replace(settings, persist_on_failure=False)
    with Cluster(tmp_path, calm, job="ckpt-test", stead_settings=Settings(retry_deadline_s=5.0)) as running:
        yield running


def test_a_replaced_node_restores_its_own_copy_from_disk_while_its_peer_restores_from_memory(quiet: Cluster) -> None:
    ranks = _start(quiet)
    _save(ranks, 1, 10.0, differ=True)  # a state that differs between the ranks: each must restore its own
    _save(ranks, 2, 20.0, differ=True)
    quiet.settle()
    for ckpt in ranks:
        ckpt.close()
    quiet.stop_agent("node-1")  # its pod deleted: the agent writes rank 1's copy of step 2 as it stops
    assert _on_disk(quiet, 2) == ["rank_1.json"]  # rank 0's copy is only in node-0's memory
    assert _replace_node_1(quiet) == [[2, [20.0] * 16], [2, [21.0] * 16]]


def test_when_the_agents_wrote_different_steps_both_ranks_restore_the_newest_each_holds(cluster: Cluster) -> None:
    rank0, rank1 = _start(cluster)
    _save((rank0, rank1), 1, 1.0)
    cluster.settle()
    _wait_checksummed(rank0)
    assert rank1.save(2, {"w": torch.full((16,), 2.0)})
    rank1.close()
    cluster.stop_agent("node-1")  # it knows step 1 as the newest commit: it writes step 1
    assert rank0.save(2, {"w": torch.full((16,), 2.0)})  # now every rank holds step 2: committed
    cluster.settle()
    rank0.close()
    cluster.failure("node-0")  # node-0's worker fails: its agent writes step 2
    cluster.settle()
    assert (_on_disk(cluster, 1), _on_disk(cluster, 2)) == (["rank_1.json"], ["rank_0.json"])
    # step 2: rank 1 has only rank 0's copy, and nothing shows the state replicated; step 1: rank 0 has it in
    # memory, rank 1 on disk
    assert _replace_node_1(cluster) == [[1, [1.0] * 16], [1, [1.0] * 16]]


@pytest.mark.parametrize("replicated", [True, False])
def test_a_node_lost_without_writing_restores_its_peers_copy_only_of_a_replicated_state(
        cluster: Cluster, replicated: bool) -> None:
    ranks = _start(cluster)
    _save(ranks, 1, 1.0, differ=not replicated, persist=True)
    assert all(ckpt.wait_persisted(timeout=30) == 1 for ckpt in ranks)  # step 1: both ranks' copies on disk
    _save(ranks, 2, 2.0, differ=not replicated)
    _save(ranks, 3, 3.0, differ=not replicated)
    cluster.settle()
    for ckpt in ranks:
        ckpt.close()
    cluster.kill_agent("node-1")  # OOM-killed: nothing written
    cluster.failure("node-0")  # the job's workers fail: node-0's agent writes rank 0's copy of step 3
    found = _replace_node_1(cluster)
    assert _on_disk(cluster, 3) == ["rank_0.json"]
    if replicated:  # step 1's copies agreed: rank 1 takes rank 0's copy of step 3
        assert found == [[3, [3.0] * 16], [3, [3.0] * 16]]
    else:  # they differed: rank 0's copy is never rank 1's, both go back to step 1, each to its own
        assert found == [[1, [1.0] * 16], [1, [2.0] * 16]]
