"""Checksums that catch real corruption: reordered words, offsetting changes, a changed tree value."""

from __future__ import annotations

import json
import stat
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stead.plugins.ckpt import _disk, checksum, sum64
from stead.plugins.ckpt._checksum import with_digest, without_digest
from stead.plugins.ckpt._codec import encode
from stead.plugins.ckpt.errors import CheckpointError

WORDS = st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=64)


def pack(words: list[int]) -> bytes:
    return struct.pack(f"<{len(words)}Q", *words)


@given(WORDS, st.data())
def test_swapping_two_different_words_changes_the_checksum(words: list[int], data: st.DataObject) -> None:
    i, j = data.draw(st.integers(0, len(words) - 1)), data.draw(st.integers(0, len(words) - 1))
    swapped = list(words)
    swapped[i], swapped[j] = words[j], words[i]
    if swapped != words:
        assert checksum(pack(swapped)) != checksum(pack(words))
        assert sum64(pack(swapped)) == sum64(pack(words))  # what the old checksum missed


@given(WORDS, st.data())
def test_adding_one_to_a_word_and_taking_one_from_another_changes_the_checksum(
        words: list[int], data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(words) - 2))
    changed = list(words)
    changed[i] = (changed[i] + 1) % 2**64
    changed[i + 1] = (changed[i + 1] - 1) % 2**64
    assert checksum(pack(changed)) != checksum(pack(words))


def test_a_sealed_document_is_json_and_unseals_only_unchanged() -> None:
    document = json.dumps({"tree": {"d": [["digest", {"v": ',"digest":"0000000000000000"}'}]]}, "lr": 0.1},
                          separators=(",", ":")).encode()
    sealed = with_digest(document)
    assert json.loads(sealed)["lr"] == 0.1
    assert without_digest(sealed) == document
    assert without_digest(sealed.replace(b"0.1", b"0.2")) is None
    assert without_digest(document) is None
    assert without_digest(sealed[:-3]) is None


def persisted(root: Path) -> _disk.Manifest:
    state = {"w": torch.arange(64, dtype=torch.float64), "lr": 0.1, "name": "run-a"}
    encoded = encode(state)
    _disk.write_rank(root, step=3, round_=1, rank=0, world=1, tree=encoded.tree,
                     metas=[m.to_json() for m in encoded.metas], tensors=list(encoded.tensors))
    return _disk.read_manifest(root, 3, 0)


def restore_tensor(manifest: _disk.Manifest) -> torch.Tensor:
    target = torch.empty(64, dtype=torch.float64)
    with _disk.open_data(manifest) as handle:
        _disk.read_tensor_into(manifest, handle, 0, _disk.tensor_bytes(target))
    return target


def edit_words(manifest: _disk.Manifest, edit: str) -> None:
    data = manifest.dir / manifest.data_file
    raw = bytearray(data.read_bytes())
    at = int(manifest.tensors[0]["file_offset"])
    a, b = struct.unpack_from("<qq", raw, at + 8)
    a, b = (b, a) if edit == "swap" else (a + 1, b - 1)
    struct.pack_into("<qq", raw, at + 8, a, b)
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("edit", ["swap", "plus-minus"])
def test_a_persisted_tensor_with_words_swapped_or_offset_is_refused(tmp_path: Path, edit: str) -> None:
    manifest = persisted(tmp_path)
    assert torch.equal(restore_tensor(manifest), torch.arange(64, dtype=torch.float64))
    edit_words(manifest, edit)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        restore_tensor(manifest)


def test_a_changed_value_in_the_manifest_tree_is_refused(tmp_path: Path) -> None:
    persisted(tmp_path)
    path = tmp_path / "step_3" / "rank_0.json"
    path.write_bytes(path.read_bytes().replace(b'{"v":0.1}', b'{"v":0.2}'))
    with pytest.raises(CheckpointError, match="fails its digest"):
        _disk.read_manifest(tmp_path, 3, 0)


def test_a_format_1_manifest_from_an_older_stead_still_restores(tmp_path: Path) -> None:
    manifest = persisted(tmp_path)
    path = tmp_path / "step_3" / "rank_0.json"
    old = json.loads(path.read_bytes())
    del old["digest"]
    old["format"] = 1
    tensor = (manifest.dir / manifest.data_file).read_bytes()
    at, nbytes = int(old["tensors"][0]["file_offset"]), int(old["tensors"][0]["nbytes"])
    old["tensors"][0]["checksum"] = sum64(tensor[at:at + nbytes])
    path.write_bytes(json.dumps(old).encode())
    legacy = _disk.read_manifest(tmp_path, 3, 0)
    assert torch.equal(restore_tensor(legacy), torch.arange(64, dtype=torch.float64))


def test_checkpoint_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    persisted(tmp_path)
    assert _disk.finish_step(tmp_path, 3, 1, keep_last=2)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) >= 4  # data, manifest, .metadata, tracker (and the lock)
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o600"}


def test_a_step_whose_manifest_fails_its_digest_is_not_completed(tmp_path: Path) -> None:
    persisted(tmp_path)
    path = tmp_path / "step_3" / "rank_0.json"
    path.write_bytes(path.read_bytes().replace(b'{"v":0.1}', b'{"v":0.2}'))
    assert not _disk.finish_step(tmp_path, 3, 1, keep_last=2)
    assert not _disk.is_complete(tmp_path, 3) and _disk.read_tracker(tmp_path) is None
