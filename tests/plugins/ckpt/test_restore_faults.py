"""A restore that meets a bad copy on disk: the caller's tensors stay untouched until every byte a rank restores has
passed its checks, and a rank that cannot read a file falls back to an older step with the others (real gloo ranks)
instead of leaving them in a collective."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt.errors import CheckpointError
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import FlashCheckpointer
from stead.testing.steps import free_port

from .test_no_unpickle import COLS, JOB, ROWS, weight, write_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: the tensors of write_step's state (model.w, model.b, pair[0]) in its manifests
W, PAIR = 0, 2


@pytest.fixture
def root(disk_settings: CheckpointSettings) -> Path:
    return Path(disk_settings.dir) / JOB


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
        disk_settings: CheckpointSettings, root: Path, rank: int, tensor: int) -> None:
    write_step(root, 1)  # by two ranks; restored by one: resharded
    flip_byte(root, 1, rank, tensor)
    state = blank()
    with (structlog.testing.capture_logs() as logs,
          FlashCheckpointer(settings=disk_settings, job=JOB, rank=0, world_size=1) as ckpt):
        assert ckpt.load(state) is None  # no older step
    assert any(e["event"] == "ckpt_corrupt" and "fails its checksum" in e["detail"] for e in logs), logs
    touched = [name for name, value in [("model.w", state["model"]["w"]), ("model.b", state["model"]["b"]),
                                        ("pair[0]", state["pair"][0])] if value.count_nonzero()]
    assert touched == [], f"{touched} were overwritten although load() restored nothing"


def test_a_resharded_step_that_fails_while_it_is_copied_in_says_the_state_may_be_partly_overwritten(
        disk_settings: CheckpointSettings, root: Path) -> None:
    write_step(root, 1)
    state = blank()
    state["model"]["b"] = torch.zeros(1).expand(COLS)  # one element seen thrice: torch refuses to copy into it
    with (FlashCheckpointer(settings=disk_settings, job=JOB, rank=0, world_size=1) as ckpt,
          pytest.raises(CheckpointError, match="may be partly overwritten: restart the workers")):
        ckpt.load(state)


LOAD = textwrap.dedent("""
    import builtins, datetime, errno, io, json, os, sys
    import torch, torch.distributed as dist
    from stead.plugins.ckpt.settings import CheckpointSettings
    from stead.plugins.ckpt.worker import FlashCheckpointer

    folder, job, unreadable, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if os.environ["RANK"] == "1":  # this rank's storage fails on one file: the other rank reads it
        real_open = io.open

        def failing_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and os.fspath(file).endswith(unreadable):
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(file))
            return real_open(file, *args, **kwargs)

        builtins.open = io.open = failing_open
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    with FlashCheckpointer(settings=CheckpointSettings(dir=folder), job=job) as ckpt:
        found = ckpt.load({"model": {"w": torch.zeros(rows, 3), "b": torch.zeros(3)}})
    print(json.dumps(None if found is None else [found[0], found[1]["model"]["w"].tolist()]), flush=True)
    dist.destroy_process_group()
    # torch's threads of the process group, still running although the checkpointer is still in scope?
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    print(json.dumps(sorted(name for name in names if name.startswith(("pt_", "gloo")))), flush=True)
""")


@pytest.mark.parametrize(("saved_by", "unreadable"), [
    (2, "step_2/rank_1.json"),  # its own copy, saved at this world size
    (1, "step_2/rank_0.json"),  # another rank's copy (this rank has none of its own)
    (1, "step_2/__0_0.distcp"),  # the data of a step to reshard
], ids=["own-manifest", "another-ranks-manifest", "data-to-reshard"])
def test_a_file_one_rank_cannot_read_sends_every_rank_to_the_older_step_together(
        disk_settings: CheckpointSettings, root: Path, tmp_path: Path, saved_by: int, unreadable: str) -> None:
    write_step(root, 1, world=saved_by)
    write_step(root, 2, world=saved_by)
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    rows = ROWS // 2 if saved_by == 2 else ROWS  # a shard of its own, or the whole weight resharded
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script), disk_settings.dir, JOB, unreadable, str(rows)], cwd=tmp_path,
        env={"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=120)
            outputs.append(output)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert [p.returncode for p in procs] == [0, 0], outputs
    for rank, output in enumerate(outputs):
        *_, restored, left_running = output.strip().splitlines()
        # a group the checkpointer held would outlive destroy_process_group() and be torn down in the
        # interpreter's shutdown, where torch may abort the process (SIGABRT after the script's last line)
        assert json.loads(left_running) == [], (rank, output)
        step, w = json.loads(restored)
        expected = weight(1) if rows == ROWS else weight(1)[rank * rows:(rank + 1) * rows]
        assert step == 1 and torch.equal(torch.tensor(w), expected), (rank, output)
    assert "ckpt_unreadable" in outputs[1] and unreadable in outputs[1], outputs[1]
