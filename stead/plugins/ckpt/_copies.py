"""Whether two ranks' copies of a checkpoint are the same state, and whether a job's state is replicated.

A rank that lost its own copy of a step (its node was replaced, its memory went with it, its
agent never wrote its part) may restore another rank's copy only when the state is replicated
(DDP: every rank holds the same tree and tensors). Copies are compared by their
:func:`fingerprint` (the tree with its plain values, each tensor's layout and XXH3 checksum),
which a copy in shared memory and one on disk share when they hold the same state.

A state is taken as replicated when at least two ranks' copies of the step agree and none
differs, or, where only one rank's copy of the step survives, when :func:`replicated_before`
finds an earlier step of the same :func:`layout` whose copies from two or more ranks all
agreed: a state that was the same on every rank keeps being so (DDP). A state that differs
between ranks (per-rank values, hand-made shards) shows it in every step saved, so it is never
taken from another rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt.errors import CheckpointError

__all__ = ["FINGERPRINT_BITS", "fingerprint", "layout", "manifest_fingerprint", "replicated_before"]

#: fingerprints are cut to this many bits, so that ranks can compare them with an int64 all-reduce
FINGERPRINT_BITS = 61
#: how many ranks' copies of an earlier step are compared to learn whether the state is replicated
_HISTORY_COPIES = 3

_LAYOUT_KEYS = ("dtype", "shape", "global_shape", "offsets")


def _tensor_layouts(tensors: Sequence[dict[str, Any]]) -> list[list[Any]]:
    return [[t.get(key) for key in _LAYOUT_KEYS] for t in tensors]


def _digest(obj: Any) -> int:
    return checksum(json.dumps(obj, separators=(",", ":")).encode()) & ((1 << FINGERPRINT_BITS) - 1)


def fingerprint(tree: Any, tensors: Sequence[dict[str, Any]], sums: Sequence[int]) -> int:
    """What two copies of the same state share: the tree (plain values included) and each tensor's layout and
    checksum."""
    return _digest([tree, _tensor_layouts(tensors), list(sums)])


def _shape_only(node: Any) -> Any:
    """``node`` (a codec tree) with its plain values replaced by their types: a learning rate or a step count
    changes from step to step, the structure does not."""
    if isinstance(node, dict):
        if set(node) == {"v"}:
            return {"v": type(node["v"]).__name__}
        return {key: _shape_only(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_shape_only(item) for item in node]
    return node


def layout(tree: Any, tensors: Sequence[dict[str, Any]]) -> int:
    """The structure of a state (its tree without values, its tensors' dtypes and shapes), the same at every step."""
    return _digest([_shape_only(tree), _tensor_layouts(tensors)])


def manifest_fingerprint(manifest: _disk.Manifest) -> int:
    return fingerprint(manifest.tree, manifest.tensors, [int(t["checksum"]) for t in manifest.tensors])


def replicated_before(root: Path, step: int, shape: int) -> bool:
    """Whether an earlier step than ``step`` with the structure ``shape`` shows the job's state replicated: the
    newest such step that two or more ranks wrote has their copies all the same."""
    for earlier in _disk.candidates(root, -1, any_rank=True):
        if earlier >= step:
            continue
        copies = []
        for rank in _disk.written_ranks(root, earlier)[:_HISTORY_COPIES]:
            try:
                copies.append(_disk.read_manifest(root, earlier, rank))
            except (OSError, CheckpointError):
                continue  # gone or damaged: it shows nothing either way
        alike = [c for c in copies if layout(c.tree, c.tensors) == shape]
        if len(alike) >= 2:
            return len({manifest_fingerprint(c) for c in alike}) == 1
    return False
