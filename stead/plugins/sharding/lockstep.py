"""Lockstep: every rank of a synchronous job reads the same number of samples in each epoch.

DDP and FSDP take one batch on every rank at every step; a rank that runs out of
samples first leaves the others waiting in an all-reduce, or ends the epoch (or
the job) while they still step. So a lockstep dataset does not lease on demand:
each round splits each epoch's slots (of the round's start set, in order) into
``world_size`` equal blocks: rank ``r`` reads positions ``[r*q, (r+1)*q)`` of the
epoch's slots, with ``q = T // world_size``. The last ``T % world_size`` slots
(fewer than ``world_size``, other ones each epoch since the order is reshuffled)
are left out of the epoch, like ``DistributedSampler(drop_last=True)``: padding
instead would read some samples twice. Nothing is read twice; a sample left out
is not counted as read, so a checkpoint's cursor keeps it until its epoch ends.

The split is a pure function of the start set and the world size: the master's
ledger and a worker without a master (plain ``torchrun``) compute the same blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

from stead.plugins.sharding.intervals import SlotMap, SlotSet

__all__ = ["Blocks", "left_out", "split"]

#: rank -> epoch -> the rank's slots of that epoch
Blocks = dict[int, dict[int, SlotSet]]


def _slice(ranges: list[tuple[int, int]], begin: int, end: int) -> SlotSet:
    """Positions ``[begin, end)`` of the concatenated ``ranges``, as slots."""
    out = SlotSet()
    position = 0
    for start, stop in ranges:
        length = stop - start
        lo, hi = max(begin, position), min(end, position + length)
        if lo < hi:
            out.add(start + lo - position, start + hi - position)
        position += length
        if position >= end:
            break
    return out


def split(start: SlotMap, world_size: int, epochs: Iterable[int]) -> Blocks:
    """Each rank's equal block of each epoch in ``start`` (see the module docstring)."""
    blocks: Blocks = {rank: {} for rank in range(world_size)}
    for epoch in epochs:
        ranges = list(start.part(epoch).ranges())
        share = sum(e - s for s, e in ranges) // world_size
        for rank in range(world_size):
            blocks[rank][epoch] = _slice(ranges, rank * share, (rank + 1) * share)
    return blocks


def left_out(start: SlotMap, blocks: Blocks) -> SlotMap:
    """The slots of ``start`` no rank reads (each epoch's tail of fewer than world_size)."""
    read = SlotMap()
    for per_epoch in blocks.values():
        for epoch, slots in per_epoch.items():
            for s, e in slots.ranges():
                read.add(epoch, s, e)
    return start.difference(read)
