"""Worker-side data API: samplers fed by the master's dynamic sharding.

::

    from stead.data import ShardedSampler

    sampler = ShardedSampler("train", size=len(dataset), shard_size=256, seed=0, epochs=3)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    if checkpoint:
        sampler.load_state_dict(checkpoint["sampler"])   # every rank, before iterating
    for epoch in range(sampler.epoch, 3):
        for batch in loader:
            ...
            if step % 100 == 0:
                save({..., "sampler": sampler.state_dict()})   # every rank together

See :mod:`stead.plugins.sharding` for how samples stay exactly-once across failures
and world-size changes. When the job is resized (``stead scale``), keep the global
batch constant with :func:`accumulation_steps`::

    accum = accumulation_steps(global_batch=512, micro_batch=16)   # WORLD_SIZE 8: 4; WORLD_SIZE 16: 2

Importing this module is cheap: the samplers (and torch) load on first use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

__all__ = ["ShardedSampler", "StreamSampler", "accumulation_steps", "batch_size"]

if TYPE_CHECKING:
    from stead.plugins.sharding.sampler import ShardedSampler, StreamSampler


def batch_size(default: int) -> int:
    """The per-worker batch to use: ``default``, scaled down after the job's workers ran out of memory.

    The scaler answers an out-of-memory failure with a smaller batch hint (``STEAD_BATCH_SCALE``, see
    ``scaler.oom_batch_factor``); a script opts in by sizing its batches with this (and keeps its global batch
    with :func:`accumulation_steps`). Never below 1; without stead, ``default``.
    """
    if isinstance(default, bool) or not isinstance(default, int) or default < 1:
        raise ValueError(f"default={default!r} must be a positive whole number")
    try:
        scale = float(os.environ.get("STEAD_BATCH_SCALE", "1"))
    except ValueError:
        scale = 1.0
    if not 0 < scale <= 1:
        scale = 1.0
    return max(1, int(default * scale))


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int | None = None) -> int:
    """Gradient accumulation steps per optimizer step that keep ``global_batch`` constant at this world size.

    ``global_batch = micro_batch * world_size * steps``; ``world_size`` defaults to ``WORLD_SIZE`` (what the
    current round has: call it again after a resize). A global batch the world cannot split evenly raises
    ValueError naming the world sizes that can.
    """
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch), ("world_size", world)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive whole number")
    steps, rest = divmod(global_batch, micro_batch * world)
    if rest or not steps:
        fits = [w for w in range(1, global_batch // micro_batch + 1) if global_batch % (micro_batch * w) == 0]
        raise ValueError(f"a global batch of {global_batch} cannot be split into micro batches of {micro_batch} on "
                         f"{world} ranks; world sizes that can: {fits} (set the job's --nnodes MIN:MAX and "
                         "--nproc-per-node so that every size it may run at is one of them)")
    return steps


def __getattr__(name: str) -> Any:
    if name in ("ShardedSampler", "StreamSampler"):
        from stead.plugins.sharding import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module 'stead.data' has no attribute {name!r}")
