"""An agent whose ranks cannot restore from memory waits for the step on disk, and never waits for ever."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.plugins.ckpt import _diskwait, segment_names
from stead.plugins.ckpt._client import Committed
from stead.plugins.ckpt._node import NodeCheckpoints
from stead.plugins.ckpt.settings import CheckpointSettings

pytestmark = pytest.mark.anyio


class _Master:
    """What the master answers about persisted steps: ``persisted`` is the newest step every rank wrote."""

    def __init__(self, persisted: int) -> None:
        self.persisted = persisted
        self.asked = 0

    async def get_committed(self, **_: object) -> Committed:
        self.asked += 1
        return Committed(persisted_step=self.persisted)


def _node(root: Path, grace_s: float, master: _Master | None = None) -> NodeCheckpoints:
    node = NodeCheckpoints(settings=Settings(), ckpt=CheckpointSettings(persist_grace_s=grace_s),
                           names=segment_names("j", "node-1", 2), node_id="node-1", incarnation=2,
                           master_address="127.0.0.1:1", token="t" * 43, root=root, socket_path=root / "sock")
    node._client = master or _Master(-1)  # type: ignore[assignment]
    return node


async def test_with_nothing_on_disk_yet_the_wait_ends_after_persist_grace(tmp_path: Path) -> None:
    root = tmp_path / "job"
    root.mkdir()
    await _node(root, grace_s=0.2)._until_on_disk(5)  # no step of any rank there: returns, does not raise


async def test_a_missing_checkpoint_directory_is_no_step_on_disk(tmp_path: Path) -> None:
    await _node(tmp_path / "never-made", grace_s=0.2)._until_on_disk(3)


async def test_a_step_every_rank_wrote_to_a_disk_this_node_does_not_share_is_not_waited_for(tmp_path: Path) -> None:
    root = tmp_path / "own-volume"
    root.mkdir()
    master = _Master(persisted=7)  # the master counts step 7 written by every rank, on their own volumes
    with anyio.fail_after(60):  # an hour of persist_grace_s is not waited out
        await _node(root, grace_s=3600, master=master)._until_on_disk(7)
    assert master.asked >= 1


async def test_a_step_no_node_writes_is_not_waited_for_past_the_unwritten_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step to restore was committed but every node that held it stopped before writing it (a job submitted
    again after a cancel that cut the persists short): nothing of it ever appears, so the wait ends long before
    persist_grace_s."""
    root = tmp_path / "job"
    root.mkdir()
    monkeypatch.setattr(_diskwait, "UNWRITTEN_GRACE_S", 0.3)
    master = _Master(persisted=4)  # an older step is all there is
    with anyio.fail_after(60):  # an hour of persist_grace_s is not waited out
        await _node(root, grace_s=3600, master=master)._until_on_disk(7)
