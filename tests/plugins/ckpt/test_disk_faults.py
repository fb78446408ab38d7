"""Disk faults around persisted checkpoints: a step that cannot be completed, a step that is corrupt on disk."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stead.plugins.ckpt import _disk

from .conftest import Cluster


def test_a_step_that_cannot_be_completed_on_disk_is_reported_failed_and_later_steps_are_still_persisted(
        cluster: Cluster, tmp_path: Path) -> None:
    root = tmp_path / "ckpt" / cluster.job
    (root / "step_1" / _disk.METADATA).mkdir(parents=True)  # writing .metadata fails there, as on a full disk
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        assert ckpt.save(1, {"w": torch.full((8,), 1.0)}, persist=True)
        assert ckpt.wait_persisted(timeout=30) is None  # answered: step 1 failed
        assert ckpt.save(2, {"w": torch.full((8,), 2.0)}, persist=True)
        assert ckpt.wait_persisted(timeout=30) == 2  # the agent still persists
    assert _disk.read_tracker(root) == 2 and not _disk.is_complete(root, 1)
    cluster.stop_agent()  # and stops


def test_a_corrupt_step_on_disk_leaves_the_state_passed_to_load_untouched(cluster: Cluster, tmp_path: Path) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        assert ckpt.save(1, {"a": torch.full((64,), 1.0), "b": torch.full((64,), 2.0)}, persist=True)
        assert ckpt.wait_persisted(timeout=30) == 1
    cluster.kill_agent()  # the memory is lost: the step is restored from disk
    root = tmp_path / "ckpt" / cluster.job
    data = root / "step_1" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[json.loads((root / "step_1" / "rank_0.json").read_bytes())["tensors"][1]["file_offset"]] ^= 0x01
    data.write_bytes(bytes(raw))
    cluster.agent(incarnation=2)
    cluster.round(2)
    state = {"a": torch.zeros(64), "b": torch.zeros(64)}
    with cluster.worker(round_=2) as ckpt:
        assert ckpt.load(state) is None  # no older step
    assert torch.equal(state["a"], torch.zeros(64)) and torch.equal(state["b"], torch.zeros(64))
