"""Nothing in a checkpoint folder is unpickled on restore, at the world size that saved a step or at another.

Anyone who can write the (shared) checkpoint folder could plant a pickle whose loading runs code in every
worker: in ``.metadata`` (which torch.distributed.checkpoint's own reader unpickles) or in a plain value's
record in a data file (which its planner reads with ``torch.load(weights_only=False)``). stead restores from
its hashed JSON manifests and raw tensor bytes only; each planted pickle below is shown to run when torch's own
reader meets it, and not to run when stead restores the step.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt._codec import encode
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import FlashCheckpointer

JOB = "job"
#: the global (sharded) weight of a step: 4 rows, two per rank of the world that saved it
ROWS, COLS = 4, 3


class _Planted:
    """A pickle that creates ``marker`` when it is loaded (the stand-in for any code an attacker would run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (self.marker, "w")


def weight(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 100 * step


def write_step(root: Path, step: int, *, world: int = 2) -> None:
    """``step`` as ``world`` ranks persist it: each its part of a sharded weight (as a DTensor's shard is stored), a
    replicated bias, a tensor inside a tuple (which DCP stores as one pickled value) and plain values."""
    for rank in range(world):
        rows = ROWS // world
        state = {"model": {"w": weight(step)[rank * rows:(rank + 1) * rows].clone(), "b": torch.full((COLS,), 0.5)},
                 "pair": (torch.full((2,), float(step)), "tag"), "epoch": step, "lrs": [0.1, 0.2]}
        encoded = encode(state)
        metas = [m.to_json() for m in encoded.metas]
        metas[0].update(global_shape=[ROWS, COLS], offsets=[rank * rows, 0])  # model.w: a shard
        _disk.write_rank(root, step=step, round_=1, rank=rank, world=world, tree=encoded.tree, metas=metas,
                         tensors=list(encoded.tensors))
    assert _disk.finish_step(root, step, world, keep_last=5)


def restore(settings: CheckpointSettings, *, world: int) -> tuple[int, dict[Any, Any]] | None:
    """Restore as rank 0 of a job of ``world`` ranks, into the tensors that rank holds."""
    rows = ROWS if world == 1 else ROWS // 2
    template = {"model": {"w": torch.zeros(rows, COLS), "b": torch.zeros(COLS)}}
    with FlashCheckpointer(settings=settings, job=JOB, rank=0, world_size=world) as ckpt:
        assert ckpt.mode == "disk"
        return ckpt.load(template)


def assert_step(restored: tuple[int, dict[Any, Any]] | None, step: int, *, world: int) -> None:
    assert restored is not None and restored[0] == step
    state = restored[1]
    expected = weight(step) if world == 1 else weight(step)[:ROWS // 2]
    assert torch.equal(state["model"]["w"], expected)
    assert torch.equal(state["model"]["b"], torch.full((COLS,), 0.5))
    assert torch.equal(state["pair"][0], torch.full((2,), float(step))) and state["pair"][1] == "tag"
    assert state["epoch"] == step and state["lrs"] == [0.1, 0.2]


def record(root: Path, step: int, rank: int, fqn: str) -> tuple[Path, int, int]:
    """(data file, offset, length) of the DCP record of ``fqn`` in ``rank``'s data file."""
    manifest = _disk.read_manifest(root, step, rank)
    [item] = [i for i in manifest.dcp if i["fqn"] == fqn]
    return manifest.dir / manifest.data_file, int(item["offset"]), int(item["length"])


@pytest.fixture
def root(disk_settings: CheckpointSettings) -> Path:
    return Path(disk_settings.dir) / JOB


@pytest.fixture
def planted(tmp_path: Path) -> tuple[bytes, Path]:
    """A pickle to plant, and the file its loading creates."""
    marker = tmp_path / "planted-pickle-ran"
    return pickle.dumps(_Planted(marker)), marker


@pytest.mark.parametrize("world", [1, 2], ids=["resharded", "same-world"])
def test_a_planted_metadata_pickle_is_never_loaded_and_the_step_restores_from_the_manifests(
        disk_settings: CheckpointSettings, root: Path, planted: tuple[bytes, Path], world: int) -> None:
    pickled, marker = planted
    write_step(root, 1)
    (root / "step_1" / ".metadata").write_bytes(pickled)

    assert_step(restore(disk_settings, world=world), 1, world=world)
    assert not marker.exists()

    with contextlib.suppress(Exception):  # what torch's own reader would have done with the folder
        FileSystemReader(str(root / "step_1")).read_metadata()
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("world", [1, 2], ids=["resharded", "same-world"])
def test_a_planted_pickle_in_a_plain_values_record_is_never_loaded_and_the_value_comes_from_the_manifest(
        disk_settings: CheckpointSettings, root: Path, planted: tuple[bytes, Path], world: int) -> None:
    pickled, marker = planted
    write_step(root, 1)
    for rank in range(2):
        data, offset, length = record(root, 1, rank, "epoch")
        assert len(pickled) <= length
        with open(data, "r+b") as handle:
            handle.seek(offset)
            handle.write(pickled.ljust(length, b"\0"))

    assert_step(restore(disk_settings, world=world), 1, world=world)
    assert not marker.exists()

    with pytest.raises(CheckpointException, match="Invalid magic number"):  # torch's own load, after it ran
        dcp.load({"epoch": 0}, checkpoint_id=str(root / "step_1"), no_dist=True)
    assert marker.exists()


def test_a_changed_byte_in_a_shard_is_caught_before_resharding_and_an_older_step_is_restored(
        disk_settings: CheckpointSettings, root: Path) -> None:
    write_step(root, 1)
    write_step(root, 2)
    manifest = _disk.read_manifest(root, 2, 1)
    data, at = manifest.dir / manifest.data_file, int(manifest.tensors[0]["file_offset"])  # rank 1's shard of w
    with open(data, "r+b") as handle:
        handle.seek(at + 5)
        byte = handle.read(1)
        handle.seek(at + 5)
        handle.write(bytes([byte[0] ^ 0x40]))
    with structlog.testing.capture_logs() as logs:
        restored = restore(disk_settings, world=1)
    assert_step(restored, 1, world=1)
    corrupt = [e for e in logs if e["event"] == "ckpt_corrupt"]
    assert corrupt and corrupt[0]["step"] == 2 and "fails its checksum" in corrupt[0]["detail"], logs


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_still_loads_a_persisted_step_with_its_own_reader(root: Path) -> None:
    write_step(root, 3)
    target: dict[str, Any] = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)}, "epoch": 0}
    dcp.load(target, checkpoint_id=str(root / "step_3"), no_dist=True)
    assert torch.equal(target["model"]["w"], weight(3)) and target["epoch"] == 3
