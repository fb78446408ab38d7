"""Where each tensor of a state dict sits in a slot, and the slot's JSON layout document.

A slot's data segment holds the tensors (each 64-byte aligned) from offset 0, then
one XXH3-64 checksum per tensor (filled in by the agent), then the layout document:
JSON with the step, the writer's rank and world size, the tree of the state dict
and every tensor's dtype, shape, size and offset. The document's checksum is in the
control block, so a reader never trusts a torn document.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt.errors import CheckpointError

__all__ = ["LayoutDoc", "SlotLayout", "parse_document", "plan"]

ALIGN = 64
FORMAT = 2  # 2: XXH3-64 checksums (1: sums of words)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Offsets of a list of tensors in a slot (computed once per state-dict structure)."""

    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    data_bytes: int
    checks_off: int
    layout_off: int
    #: the tensors' part of the layout document, pre-encoded
    tensors_json: str

    @property
    def n_tensors(self) -> int:
        return len(self.offsets)

    def document(self, *, tree: Any, step: int, round_: int, rank: int, world: int) -> bytes:
        head = json.dumps({"format": FORMAT, "step": step, "round": round_, "rank": rank, "world": world},
                          separators=(",", ":"))
        body = json.dumps(tree, separators=(",", ":"))
        return f'{head[:-1]},"tensors":{self.tensors_json},"tree":{body}}}'.encode()

    def needed(self, document: bytes) -> int:
        return self.layout_off + len(document)


def plan(metas: list[dict[str, Any]]) -> SlotLayout:
    """Lay out tensors described by ``metas`` (each a TensorMeta.to_json() with 'nbytes')."""
    offsets: list[int] = []
    sizes: list[int] = []
    entries = []
    cursor = 0
    for meta in metas:
        cursor = _aligned(cursor)
        offsets.append(cursor)
        sizes.append(int(meta["nbytes"]))
        entries.append({**meta, "offset": cursor})
        cursor += int(meta["nbytes"])
    checks_off = _aligned(cursor)
    return SlotLayout(offsets=tuple(offsets), nbytes=tuple(sizes), data_bytes=cursor, checks_off=checks_off,
                      layout_off=checks_off + 8 * len(offsets),
                      tensors_json=json.dumps(entries, separators=(",", ":")))


@dataclasses.dataclass(frozen=True)
class LayoutDoc:
    step: int
    round: int
    rank: int
    world: int
    tensors: list[dict[str, Any]]
    tree: Any

    def regions(self) -> list[tuple[int, int]]:
        return [(int(t["offset"]), int(t["nbytes"])) for t in self.tensors]

    def check_fits(self, capacity: int, *, where: str) -> None:
        """Refuse a document whose tensors would lie outside a segment of ``capacity`` bytes."""
        if any(offset + nbytes > capacity for offset, nbytes in self.regions()):
            raise CheckpointError(f"{where}: the layout places tensors beyond the segment's {capacity} bytes")


def parse_document(raw: bytes, *, expected_sum: int | None, where: str) -> LayoutDoc:
    """Parse and check a layout document read back from a slot (or a disk manifest's layout)."""
    if expected_sum is not None and checksum(raw) != expected_sum:
        raise CheckpointError(f"{where}: the layout document fails its checksum (torn or corrupt)")
    try:
        obj = json.loads(raw)
        if obj.get("format") != FORMAT:
            raise CheckpointError(f"{where}: layout format {obj.get('format')!r} is not {FORMAT}; "
                                  "read it with the stead version that wrote it")
        tensors = obj["tensors"]
        if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
            raise TypeError("tensors is not a list of objects")
        for t in tensors:
            if int(t["offset"]) < 0 or int(t["nbytes"]) < 0:
                raise ValueError("negative offset or size")
        return LayoutDoc(step=int(obj["step"]), round=int(obj["round"]), rank=int(obj["rank"]),
                         world=int(obj["world"]), tensors=tensors, tree=obj["tree"])
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{where}: malformed layout document ({exc!r})") from exc
