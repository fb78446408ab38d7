"""Flash checkpoints for training scripts: ``from stead.ckpt import FlashCheckpointer``.

    ckpt = FlashCheckpointer(size_hint=state)        # under `stead run`: the agent's shared memory
    restored = ckpt.load(state)                       # (step, state) from memory, else disk, else None
    ckpt.save(step, state, persist=step % 100 == 0)   # returns once the copy to memory is done

Without a stead agent (torchrun, python) it is disk-only: ``persist=True`` saves are
written before ``save`` returns and ``load`` reads them; other saves keep nothing.
"""

from __future__ import annotations

from stead.plugins.ckpt.errors import CheckpointError, SharedMemoryTooSmall, StateMismatch, UnsupportedState
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["CheckpointError", "FlashCheckpointer", "SharedMemoryTooSmall", "StateMismatch", "UnsupportedState"]
