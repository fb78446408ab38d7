"""A restore that meets a bad copy on disk: the caller's tensors stay untouched until every byte a rank restores has
passed its checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt.errors import CheckpointError
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import FlashCheckpointer

from .test_no_unpickle import COLS, JOB, ROWS, write_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: the tensors of write_step's state (model.w, model.b, pair[0]) in its manifests
W, PAIR = 0, 2


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CheckpointSettings:
    for name in ("STEAD_CKPT_PATH", "STEAD_CKPT_SOCKET", "STEAD_CKPT_STEP"):
        monkeypatch.delenv(name, raising=False)
    return CheckpointSettings(dir=str(tmp_path / "ckpt"))


@pytest.fixture
def root(settings: CheckpointSettings) -> Path:
    return Path(settings.dir) / JOB


def blank() -> dict[str, Any]:
    """The state a resized job of one rank restores into: the whole weight, the bias, the tensor in the tuple."""
    return {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)}, "pair": (torch.zeros(2), "tag")}


def flip_byte(root: Path, step: int, rank: int, tensor: int) -> None:
    """Change one byte of ``tensor`` in ``rank``'s data file of ``step`` (its checksum no longer matches)."""
    manifest = _disk.read_manifest(root, step, rank)
    at = int(manifest.tensors[tensor]["file_offset"]) + 5
    with open(manifest.dir / manifest.data_file, "r+b") as handle:
        handle.seek(at)
        byte = handle.read(1)
        handle.seek(at)
        handle.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize(("rank", "tensor"), [(1, W), (0, PAIR)],
                         ids=["a-later-shard-of-a-resharded-tensor", "a-tensor-inside-a-tuple"])
def test_a_resharded_step_with_a_corrupt_chunk_leaves_every_tensor_passed_to_load_untouched(
        settings: CheckpointSettings, root: Path, rank: int, tensor: int) -> None:
    write_step(root, 1)  # by two ranks; restored by one: resharded
    flip_byte(root, 1, rank, tensor)
    state = blank()
    with (structlog.testing.capture_logs() as logs,
          FlashCheckpointer(settings=settings, job=JOB, rank=0, world_size=1) as ckpt):
        assert ckpt.load(state) is None  # no older step
    assert any(e["event"] == "ckpt_corrupt" and "fails its checksum" in e["detail"] for e in logs), logs
    touched = [name for name, value in [("model.w", state["model"]["w"]), ("model.b", state["model"]["b"]),
                                        ("pair[0]", state["pair"][0])] if value.count_nonzero()]
    assert touched == [], f"{touched} were overwritten although load() restored nothing"


def test_a_resharded_step_that_fails_while_it_is_copied_in_says_the_state_may_be_partly_overwritten(
        settings: CheckpointSettings, root: Path) -> None:
    write_step(root, 1)
    state = blank()
    state["model"]["b"] = torch.zeros(1).expand(COLS)  # one element seen thrice: torch refuses to copy into it
    with (FlashCheckpointer(settings=settings, job=JOB, rank=0, world_size=1) as ckpt,
          pytest.raises(CheckpointError, match="may be partly overwritten: restart the workers")):
        ckpt.load(state)
