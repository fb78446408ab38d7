"""How the ranks of a job agree while they restore: MIN all-reduces of a few int64 at a time on a gloo group.

Every rank calls the same methods in the same order (each is a collective). Without a process group, or in a
world of one rank, each rank decides alone (a warning says so once when the world has several ranks).

A checkpointer usually outlives the script's ``destroy_process_group()``, so it never holds a process group
strongly: a group kept alive past it keeps gloo's threads and rank 0's TCPStore server running into the
interpreter's shutdown, where torch may abort the process (SIGABRT, "terminate called without an active
exception") after the script's last line. Nor does it let torch hold one for it: see ``_bind_no_group``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import structlog
import torch

__all__ = ["Group"]

log = structlog.get_logger("stead.ckpt")


def _bind_no_group() -> None:
    """Import ``torch.distributed.nn`` while no process group exists.

    Its functions take ``group=group.WORLD`` as default arguments, evaluated once, when it is first imported;
    torch.distributed.checkpoint imports it, and load() imports that on demand, usually after the script's
    ``init_process_group``. The defaults would then hold the default group for good. Imported here, with the
    script's ``from stead.ckpt import ...`` (before its ``init_process_group``), they hold None.
    """
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        import torch.distributed.nn  # noqa: F401


_bind_no_group()


class Group:
    """The ranks of this job, as far as a restore needs them to agree."""

    def __init__(self, *, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._cpu_group: weakref.ref[Any] | None = None  # the gloo group made beside a non-gloo default group
        self._made_for: weakref.ref[Any] | None = None  # ... and that default group
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
        tensor = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._cpu())
        return [int(v) for v in tensor.tolist()]

    def _cpu(self) -> Any:
        """The group to reduce on: the default one when it is gloo, else a gloo group made for it (once per
        default group: a script that destroys and creates its process group again gets a new one)."""
        import torch.distributed as dist

        if dist.get_backend() == "gloo":
            return None
        world = dist.group.WORLD
        group = self._cpu_group() if self._cpu_group is not None else None
        if group is None or self._made_for is None or self._made_for() is not world:
            group = dist.new_group(backend="gloo")  # torch keeps it registered until destroy_process_group()
            self._cpu_group, self._made_for = weakref.ref(group), weakref.ref(world)
        return group

    def span(self, values: Sequence[int]) -> list[tuple[int, int]]:
        """(minimum, maximum) of each of ``values`` over every rank (one all-reduce)."""
        reduced = self.min([*values, *(-v for v in values)])
        n = len(values)
        return [(reduced[i], -reduced[n + i]) for i in range(n)]

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        return self.min([1 if flag else 0])[0] == 1
