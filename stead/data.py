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

See :mod:`stead.plugins.sharding` for how samples stay exactly-once across failures.
Importing this module is cheap: the samplers (and torch) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ShardedSampler", "StreamSampler"]

if TYPE_CHECKING:
    from stead.plugins.sharding.sampler import ShardedSampler, StreamSampler


def __getattr__(name: str) -> Any:
    if name in __all__:
        from stead.plugins.sharding import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module 'stead.data' has no attribute {name!r}")
