"""Which sample a slot holds: the deterministic, shuffled order of a dataset's epochs.

A dataset of ``size`` samples is cut into shards of ``shard_size`` consecutive
sample ids (the last one shorter when the size is not a multiple; it is always read
last in an epoch). Each epoch reads the full shards in an order shuffled by
``(seed, epoch)`` and the samples of each shard in an order shuffled by
``(seed, epoch, shard)``. Slot ``o`` of an epoch is position ``o`` of that order.

The shuffles are ``argsort`` of a keyed 64-bit mix (splitmix64), not a library RNG,
so the order depends on nothing but the four numbers: a cursor saved by one version
of stead, numpy or Python means the same samples to another.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["SampleOrder", "permutation"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, element-wise: a bijection of the 64-bit integers."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*values: int) -> int:
    key = 0
    for value in values:
        key = int(_mix(np.array([(key * _GOLDEN + value) & _MASK], dtype=np.uint64))[0])
    return key


def permutation(length: int, *key: int) -> npt.NDArray[np.int64]:
    """A permutation of ``range(length)`` that depends only on ``key``."""
    mixed = _mix(np.arange(length, dtype=np.uint64) ^ np.uint64(_key(*key)))
    return np.argsort(mixed, kind="stable").astype(np.int64)  # the mix is a bijection: no ties


class SampleOrder:
    """Maps slots of an epoch to sample ids (caches the shard order of the last epoch asked)."""

    def __init__(self, *, size: int, shard_size: int, seed: int, shuffle: bool) -> None:
        self.size, self.shard_size, self.seed, self.shuffle = size, shard_size, seed, shuffle
        self.full_shards = size // shard_size
        self._epoch: int | None = None
        self._shards: npt.NDArray[np.int64] | None = None

    def _shard_order(self, epoch: int) -> npt.NDArray[np.int64]:
        if self._epoch != epoch or self._shards is None:
            if self.shuffle:
                self._shards = permutation(self.full_shards, self.seed, epoch)
            else:
                self._shards = np.arange(self.full_shards, dtype=np.int64)
            self._epoch = epoch
        return self._shards

    def samples(self, epoch: int, start: int, end: int) -> list[int]:
        """The sample ids of slots ``[start, end)`` of ``epoch``, in reading order."""
        out: list[int] = []
        size, step = self.size, self.shard_size
        while start < end:
            position = start // step
            stop = min(end, (position + 1) * step, size)
            offset = start - position * step
            if position < self.full_shards:
                shard, length = int(self._shard_order(epoch)[position]), step
            else:
                shard, length = self.full_shards, size - self.full_shards * step
            if self.shuffle:
                within = permutation(length, self.seed, epoch, shard)[offset:offset + stop - start]
            else:
                within = np.arange(offset, offset + stop - start, dtype=np.int64)
            out.extend((within + shard * step).tolist())
            start = stop
        return out
