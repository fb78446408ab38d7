"""A warning of the job's stop (Slurm's time limit or a preemption: SIGUSR1 on every node) persists one step that
every rank writes: the step the master names to the round's first warned node, for every warned node after it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _polling import wait_until

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt import plugin as plugin_module
from stead.plugins.ckpt.events import CheckpointPersisted
from stead.plugins.ckpt.plugin import CheckpointPlugin
from stead.plugins.ckpt.settings import CheckpointSettings

from .conftest import Cluster


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_nodes_warned_on_either_side_of_a_commit_persist_the_same_step(cluster: Cluster, tmp_path: Path) -> None:
    for node, rank in (("node-0", 0), ("node-1", 1)):
        cluster.agent(node)
        cluster.round(1, node_id=node, world=2, node_rank=rank)
    root = tmp_path / "ckpt" / cluster.job
    with cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0) as rank0, \
            cluster.worker(node_id="node-1", rank=1, world=2, local_rank=0) as rank1:
        for ckpt in (rank0, rank1):
            assert ckpt.save(1, {"w": torch.full((4,), 1.0)})
        cluster.settle()
        cluster.portal.call(lambda: cluster.agents["node-0"].warned(reason="SIGUSR1"))
        for ckpt in (rank0, rank1):  # step 2 commits between the two nodes' warnings
            assert ckpt.save(2, {"w": torch.full((4,), 2.0)})
        cluster.settle()
        cluster.portal.call(lambda: cluster.agents["node-1"].warned(reason="SIGUSR1"))
        # node-1 alone knowing step 2 as its newest commit would write step 2 and node-0 step 1: neither whole
        wait_until(lambda: _disk.is_complete(root, 1), "step 1 whole on disk")
    cluster.settle()
    assert [e.step for e in cluster.events if isinstance(e, CheckpointPersisted)] == [1]
    assert not _disk.step_dir(root, 2).exists()


def test_the_warning_step_is_the_first_asks_for_the_window_then_the_newest_commit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = CheckpointPlugin(settings=CheckpointSettings())
    now = [100.0]
    monkeypatch.setattr(plugin_module.time, "monotonic", lambda: now[0])

    def commit(step: int) -> None:
        plugin.book = dataclasses.replace(plugin.book, step=step, step_round=1)

    commit(4)
    assert plugin.warning_step(1) == (4, 1)
    commit(5)
    now[0] += plugin_module.WARNING_WINDOW_S - 1
    assert plugin.warning_step(1) == (4, 1)  # another node of the same warning
    assert plugin.warning_step(2) == (5, 1)  # a new round: its own warning
    now[0] += plugin_module.WARNING_WINDOW_S + 1
    commit(9)
    assert plugin.warning_step(2) == (9, 1)  # a later warning (a preemption after the time limit's)
