"""Resharding a step from memory: the old ranks' slots of it, read through torch.distributed.checkpoint's planner.

When the job continues at another world size, every old rank's part of a sharded (FSDP2, DTensor) step may still
be in some node's memory: a surviving rank's own slot, or a peer host's replica of a lost rank's slot. Each
:class:`SlotPart` is one such slot, seen through its (checked) layout document, the checksums its agent computed
and a ``fetch(offset, nbytes)`` that returns bytes of the slot: a view of a mapped segment on this node, or a
byte-range read from the node that holds it. DCP plans the reshard over the parts' index
(:func:`._disk.dcp_index`, as for the persisted step) and asks only for the chunks that overlap what this rank
restores, so a rank fetches those tensors of those parts, never whole slots; every tensor fetched is checked
against its checksum before any byte of it is kept (:func:`read_tensor`), and nothing reaches the caller's tensors
before every chunk passed (:class:`._fromdisk.Staged`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt._fromdisk import Staged, stage_parts
from stead.plugins.ckpt._layout import LayoutDoc
from stead.plugins.ckpt._restore import Template
from stead.plugins.ckpt.errors import CheckpointError

__all__ = ["SlotPart", "read_tensor", "slot_part", "stage_from_memory"]

#: (offset, nbytes) -> those bytes of a slot (a view of a mapped segment, or bytes fetched from the node holding it)
Fetch = Callable[[int, int], "memoryview | bytes | bytearray"]


@dataclasses.dataclass(frozen=True)
class SlotPart:
    """One old rank's slot of a step, wherever it lives, as :func:`._disk.dcp_index` and the reshard read it."""

    doc: LayoutDoc
    #: each tensor's checksum, as the slot's agent computed it (or as it arrived, checked, with a replica)
    sums: tuple[int, ...]
    fetch: Fetch
    #: where the slot lives, for messages ("slot 1 of rank 2 on node-1", "the replica held by node-0")
    where: str
    #: the records torch.distributed.checkpoint keeps of the state (as a persisted step's manifest has them)
    dcp: list[dict[str, Any]]

    @property
    def rank(self) -> int:
        return self.doc.rank

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self.doc.tensors

    @property
    def tree(self) -> Any:
        return self.doc.tree

    @property
    def data_file(self) -> str:
        return f"memory_rank_{self.doc.rank}"  # names the part in DCP's index: no file is ever opened

    @property
    def label(self) -> str:
        return self.where

    @property
    def sharded(self) -> bool:
        """Whether the slot holds shards (FSDP2, DTensor)."""
        return any("global_shape" in t for t in self.doc.tensors)


def slot_part(doc: LayoutDoc, sums: Sequence[int], fetch: Fetch, *, where: str) -> SlotPart:
    """The part of the slot ``doc`` describes (``sums``: its tensors' checksums, ``fetch``: its bytes)."""
    import torch

    if len(sums) != len(doc.tensors):
        raise CheckpointError(f"{where}: {len(sums)} checksums for {len(doc.tensors)} tensors; the slot is not "
                              "usable for a reshard (the step is read from disk instead)")
    placeholders = [torch.empty(0) for _ in doc.tensors]  # only their identities matter to the records
    records: list[dict[str, Any]] = []
    seen: set[int] = set()
    for fqn, path, _value, index in _disk.flat_records(doc.tree, placeholders, where=where):
        record: dict[str, Any] = {"fqn": fqn, "path": path, "offset": 0, "length": 0}
        if index is not None and index not in seen:
            seen.add(index)
            record["tensor"] = index
        records.append(record)
    return SlotPart(doc=doc, sums=tuple(sums), fetch=fetch, where=where, dcp=records)


def read_tensor(part: SlotPart, index: int, target: memoryview) -> None:
    """Tensor ``index`` of ``part`` into ``target`` (its exact bytes), checked against its checksum."""
    offset, nbytes = part.doc.regions()[index]
    if len(target) != nbytes:
        raise CheckpointError(f"{part.where}: tensor {index} has {nbytes} bytes, the destination {len(target)}")
    got = part.fetch(offset, nbytes)
    if len(got) != nbytes:
        raise CheckpointError(f"{part.where}: {len(got)} bytes of tensor {index} came back for {nbytes}; the "
                              "slot changed or the holder went away (the step is read from disk instead)")
    target[:] = got
    if checksum(target) != part.sums[index]:
        raise CheckpointError(f"{part.where}: tensor {index} of step {part.doc.step} fails its checksum (corrupt "
                              "in memory or on the way); the step is read from another tier")


def stage_from_memory(parts: Sequence[SlotPart], given: Template, *, rank: int, world: int) -> Staged:
    """The step whose every old rank's slot is in ``parts``, resharded for rank ``rank`` of ``world`` ranks, every
    chunk read and checked, ready to go into the caller's tensors (:meth:`Staged.copy_in`).

    ``parts`` must be one step of one round, one slot per old rank (0..N-1): anything else raises
    :class:`CheckpointError` (the caller reads the step from disk). A state that cannot take the step raises
    :class:`StateMismatch`, as a reshard from disk does.
    """
    if not parts:
        raise CheckpointError("no slot to reshard from; the step is read from disk")
    by_rank = {p.rank: p for p in parts}
    first = parts[0].doc
    saved = first.world
    odd = [p.where for p in parts if (p.doc.step, p.doc.round, p.doc.world) != (first.step, first.round, saved)]
    if odd or len(by_rank) != len(parts) or sorted(by_rank) != list(range(saved)):
        raise CheckpointError(f"the slots of step {first.step} found in memory ({sorted(p.where for p in parts)}) "
                              f"are not one slot of each of its {saved} ranks from one round; the step is read "
                              "from disk")
    own = by_rank.get(rank, by_rank[0])  # this rank's own slot when it had one: its plain values are its own
    ordered = [by_rank[r] for r in range(saved)]
    return stage_parts(ordered, own, given, step=first.step, world=world, where=f"step {first.step} in memory",
                       read=read_tensor)
