"""How the ranks of a job agree while they restore: MIN all-reduces of a few int64 at a time on a gloo group.

Every rank calls the same methods in the same order (each is a collective). Without a process group, or in a
world of one rank, each rank decides alone (a warning says so once when the world has several ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch

__all__ = ["Group"]

log = structlog.get_logger("stead.ckpt")


class Group:
    """The ranks of this job, as far as a restore needs them to agree."""

    def __init__(self, *, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._cpu_group: Any = None
        self._warned = False

    def min(self, values: Sequence[int]) -> list[int]:
        """The minimum of each of ``values`` over every rank (one all-reduce)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            if self.world > 1 and not self._warned:
                self._warned = True
                log.warning("ckpt_load_without_process_group", rank=self.rank,
                            effect="ranks cannot agree on the step to restore; call load() after "
                                   "init_process_group")
            return list(values)
        if self._cpu_group is None:
            self._cpu_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        tensor = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return [int(v) for v in tensor.tolist()]

    def span(self, values: Sequence[int]) -> list[tuple[int, int]]:
        """(minimum, maximum) of each of ``values`` over every rank (one all-reduce)."""
        reduced = self.min([*values, *(-v for v in values)])
        n = len(values)
        return [(reduced[i], -reduced[n + i]) for i in range(n)]

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return self.min([1 if flag else 0])[0] == 1
