"""An agent whose ranks cannot restore from memory waits for the step on disk, and never waits for ever."""

from __future__ import annotations

from pathlib import Path

import pytest

from stead.core.config import Settings
from stead.plugins.ckpt import segment_names
from stead.plugins.ckpt._node import NodeCheckpoints
from stead.plugins.ckpt.settings import CheckpointSettings

pytestmark = pytest.mark.anyio


def _node(root: Path, grace_s: float) -> NodeCheckpoints:
    return NodeCheckpoints(settings=Settings(), ckpt=CheckpointSettings(persist_grace_s=grace_s),
                           names=segment_names("j", "node-1", 2), node_id="node-1", incarnation=2,
                           master_address="127.0.0.1:1", token="t" * 43, root=root, socket_path=root / "sock")


async def test_with_nothing_on_disk_yet_the_wait_ends_after_persist_grace(tmp_path: Path) -> None:
    root = tmp_path / "job"
    root.mkdir()
    await _node(root, grace_s=0.2)._until_on_disk(5)  # no step of any rank there: returns, does not raise


async def test_a_missing_checkpoint_directory_is_no_step_on_disk(tmp_path: Path) -> None:
    await _node(tmp_path / "never-made", grace_s=0.2)._until_on_disk(3)
