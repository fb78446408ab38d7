"""What the agent keeps per local rank: its control block, its slots' mappings, its persists."""

from __future__ import annotations

import dataclasses
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

import anyio
import structlog

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt._layout import LayoutDoc, parse_document
from stead.plugins.ckpt._shm import Control, SegmentNames, SlotInfo, map_segment, unlink_quietly
from stead.plugins.ckpt.errors import CheckpointError

__all__ = ["PersistJob", "RankMemory", "close_map"]

log = structlog.get_logger("stead.plugins.ckpt")

_U64 = struct.Struct("<Q")


@dataclasses.dataclass
class PersistJob:
    step: int
    round: int
    reason: str


@dataclasses.dataclass
class RankMemory:
    """What the agent knows of one local rank's worker and memory."""

    local_rank: int
    control: Control
    rank: int = -1
    world: int = 0
    round: int = 0
    passed: int = -1
    maps: dict[int, tuple[int, mmap.mmap]] = dataclasses.field(default_factory=dict)
    #: the step to persist (its slot is pinned), whether it is queued or being written, and the next one
    persist: PersistJob | None = None
    queued: bool = False
    writing: bool = False
    deferred: PersistJob | None = None
    persisted: int = -1
    persist_failed: int = -1
    changed: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    newest_saved: tuple[int, int] = (-1, -1)
    #: step -> seconds its save() took to copy it (held steps only)
    save_s: dict[int, float] = dataclasses.field(default_factory=dict)
    checksumming: dict[tuple[int, int], anyio.Event] = dataclasses.field(default_factory=dict)

    def held(self) -> frozenset[int]:
        return frozenset(s.step for s in self.control.slots() if s.complete and s.round == self.round)

    def slot_holding(self, step: int, round_: int) -> SlotInfo | None:
        return next((s for s in self.control.slots() if s.holds(step, round_)), None)

    def mapping(self, info: SlotInfo, names: SegmentNames) -> mmap.mmap:
        cached = self.maps.get(info.index)
        if cached is not None and cached[0] == info.gen:
            return cached[1]
        if cached is not None:
            close_map(cached[1])
        view = map_segment(names.data(self.local_rank, info.index, info.gen), info.capacity)
        self.maps[info.index] = (info.gen, view)
        return view

    def use_segment(self, names: SegmentNames, index: int, gen: int, capacity: int) -> None:
        """Make slot ``index`` use the new segment ``gen`` (created, ``capacity`` bytes) and free its old one."""
        old = self.control.slot(index)
        with self.control.locked():
            self.control.set_segment(index, gen, capacity)
        cached = self.maps.pop(index, None)
        if cached is not None:
            close_map(cached[1])
        if old.gen:
            unlink_quietly(names.data(self.local_rank, index, old.gen))

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def sums(self, info: SlotInfo, names: SegmentNames) -> tuple[LayoutDoc, list[int]]:
        """The layout and the per-tensor checksums of a slot (blocking: run in a thread)."""
        view = self.mapping(info, names)
        where = f"slot {info.index} of local rank {self.local_rank}"
        doc = parse_document(bytes(view[info.layout_off:info.layout_off + info.layout_len]),
                             expected_sum=info.layout_sum, where=where)
        doc.check_fits(info.capacity, where=where)
        memory = memoryview(view)
        try:
            return doc, [checksum(memory[offset:offset + nbytes]) for offset, nbytes in doc.regions()]
        finally:
            memory.release()

    def write_to_disk(self, info: SlotInfo, names: SegmentNames, root: Path, *,
                      copied: Callable[[], None] | None = None) -> None:
        """Persist the slot's step for this rank (blocking: run in a thread; the slot is pinned).

        With ``copied``, the tensors are first copied out of the slot, the slot is checked unchanged,
        and ``copied()`` is called (it unpins the slot) before the copy is written: the slot is held
        for a memory copy instead of a disk write. Without, the caller checks the slot afterwards.
        """
        import torch

        from stead.plugins.ckpt._codec import TensorMeta, dtype_from_name

        view = self.mapping(info, names)
        doc = parse_document(bytes(view[info.layout_off:info.layout_off + info.layout_len]),
                             expected_sum=info.layout_sum, where=f"slot {info.index}")
        doc.check_fits(info.capacity, where=f"slot {info.index}")
        expected = None
        if info.checks_seq == info.seq:
            expected = [_U64.unpack_from(view, info.checks_off + 8 * i)[0] for i in range(len(doc.tensors))]
        metas = [TensorMeta.from_json(t, where=f"slot {info.index}") for t in doc.tensors]
        tensors = []
        for meta, entry in zip(metas, doc.tensors, strict=True):
            dtype = dtype_from_name(meta.dtype, where=f"slot {info.index}")
            if meta.nbytes == 0:
                tensors.append(torch.empty(meta.shape, dtype=dtype))
            else:
                flat = torch.frombuffer(view, dtype=dtype, count=meta.nbytes // dtype.itemsize,
                                        offset=int(entry["offset"]))
                tensors.append(flat.view(meta.shape))
        if copied is not None:
            tensors = [tensor.clone() for tensor in tensors]
            if self.control.slot(info.index).seq != info.seq:
                raise CheckpointError("the slot changed while it was being copied (it was not pinned)")
            copied()
        _disk.write_rank(root, step=doc.step, round_=doc.round, rank=doc.rank, world=doc.world, tree=doc.tree,
                         metas=[m.to_json() for m in metas], tensors=tensors, expected=expected)

    def close(self) -> None:
        for _, view in self.maps.values():
            close_map(view)
        self.maps.clear()
        self.control.close()


def close_map(view: mmap.mmap) -> None:
    try:
        view.close()
    except BufferError:
        log.debug("ckpt_mapping_in_use")
