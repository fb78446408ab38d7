"""Checkpoints for training scripts: ``from stead.ckpt import Checkpoint``.

    ckpt = Checkpoint(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    start = ckpt.restore()                            # the step restored (memory, else disk), or None
    ...
    ckpt.save(step, persist=step % 100 == 0)          # returns once the copy to memory is done

:class:`Checkpoint` saves and restores everything together (optimizer state included,
even into a fresh optimizer; the sampler's cursor in the right order);
:class:`FlashCheckpointer` is the layer underneath, for a state dict of your own.
Without a stead agent (torchrun, python) only ``persist=True`` saves are kept: they
are written before ``save`` returns, and ``restore``/``load`` read them.
"""

from __future__ import annotations

from stead.plugins.ckpt.errors import CheckpointError, SharedMemoryTooSmall, StateMismatch, UnsupportedState
from stead.plugins.ckpt.state import Checkpoint, Stateful
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["Checkpoint", "CheckpointError", "FlashCheckpointer", "SharedMemoryTooSmall", "StateMismatch", "Stateful",
           "UnsupportedState"]
