"""Checkpoint: everything a training script must get back after a failure, saved and restored as one.

::

    ckpt = Checkpoint(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    start = ckpt.restore()                       # the step restored, or None: start from scratch
    for step in range(0 if start is None else start + 1, steps):
        ...
        ckpt.save(step, persist=step % 100 == 0)

What it takes care of, so that a script cannot get it wrong:

* the optimizer's state (momentum, Adam's moments and step counts) comes back even
  though a fresh optimizer has none yet: the state dicts come from
  ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``/``set_state_dict``),
  which builds the optimizer's state before loading into it, for plain modules, DDP
  and FSDP2 (sharded state is restored into its shards);
* the sampler's cursor travels in the same checkpoint and is given back to the
  sampler before it iterates (its ``state_dict()`` is taken at save time only);
* the scheduler and any ``extra`` values (JSON-like values and tensors) come back too;
* a checkpoint that does not fit (another model, shape, optimizer or sharding) is
  refused before anything is loaded, with the mismatched keys named.

Underneath it is a :class:`~stead.plugins.ckpt.worker.FlashCheckpointer`: under
``stead run`` a save is a copy into the agent's shared memory; under plain
``torchrun`` or ``python`` only ``persist=True`` saves are kept (on disk).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch

from stead.core.worker.progress import paused as _building_state
from stead.plugins.ckpt.errors import CheckpointError, StateMismatch
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["Checkpoint", "Stateful"]


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)`` (a scheduler, a sampler)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class Checkpoint:
    """Model(s), optimizer(s), scheduler, sampler and extras, saved and restored together (see the module doc)."""

    def __init__(self, *, model: torch.nn.Module | Sequence[torch.nn.Module],
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
                 scheduler: Stateful | None = None, sampler: Stateful | None = None,
                 extra: Mapping[str, Any] | None = None, copy_mode: Literal["sync", "overlap"] = "sync",
                 settings: CheckpointSettings | None = None, flash: FlashCheckpointer | None = None) -> None:
        self.models = [model] if isinstance(model, torch.nn.Module) else list(model)
        if not self.models:
            raise CheckpointError("Checkpoint needs at least one model: pass model=...")
        if optimizer is None:
            self.optimizers: list[torch.optim.Optimizer] = []
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizers = [optimizer]
        else:
            self.optimizers = list(optimizer)
        self.scheduler = scheduler
        self.sampler = sampler
        #: the extras of the restored step (after restore()); save() stores what this holds then
        self.extra: dict[str, Any] = dict(extra or {})
        self._flash = flash if flash is not None else FlashCheckpointer(copy_mode=copy_mode, settings=settings)

    @property
    def flash(self) -> FlashCheckpointer:
        """The flash checkpointer underneath (for wait_persisted and the mode)."""
        return self._flash

    # -- saving -------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a save stores: ``model``, ``optim`` (None before the first optimizer step), ``scheduler``,
        ``sampler`` (its cursor: a collective on every rank), ``extra``."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        started = self.optimizers and all(opt.state for opt in self.optimizers)
        model: Any = self.models[0] if len(self.models) == 1 else self.models
        if started:
            model_state, optim_state = get_state_dict(model, self.optimizers)
        else:  # building a fresh optimizer's state would take a step: before the first real one, none is saved
            model_state, optim_state = get_model_state_dict(model), None
        return {
            "model": model_state,
            "optim": optim_state,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "extra": self.extra,
        }

    def save(self, step: int, *, persist: bool = False) -> bool:
        """Save everything as ``step`` (on every rank, at the same step); False when skipped (see FlashCheckpointer)."""
        return self._flash.save(step, self.state(), persist=persist)

    def wait_persisted(self, timeout: float | None = None) -> int | None:
        return self._flash.wait_persisted(timeout)

    # -- restoring ----------------------------------------------------------------------------------

    def restore(self) -> int | None:
        """Restore the newest committed step into the model, optimizer, scheduler, sampler and ``extra``.

        Call it on every rank, after ``init_process_group`` and before the sampler iterates.
        Returns the step restored, or None (nothing saved yet: start from scratch; nothing
        is changed). A checkpoint that does not fit raises StateMismatch, nothing loaded.
        """
        from torch.distributed.checkpoint.state_dict import set_state_dict

        found = self._flash.load(self._template, strict=True)
        if found is None:
            return None
        step, state = found
        model: Any = self.models[0] if len(self.models) == 1 else self.models
        optim_state = state.get("optim")
        with _building_state():
            if optim_state is not None and self.optimizers:
                set_state_dict(model, self.optimizers, model_state_dict=state["model"], optim_state_dict=optim_state)
            else:
                from torch.distributed.checkpoint.state_dict import set_model_state_dict

                set_model_state_dict(model, state["model"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.sampler is not None and state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])
        self.extra = dict(state.get("extra") or {})
        return step

    def _template(self, saved: Any) -> Mapping[str, Any]:
        """The current state to restore into, shaped like the checkpoint ``saved`` (its structure)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not isinstance(saved, Mapping) or "model" not in saved:
            raise StateMismatch("the checkpoint was not saved by stead.ckpt.Checkpoint (it has no 'model'): load "
                                "it with FlashCheckpointer.load(), or save it with Checkpoint.save()")
        model: Any = self.models[0] if len(self.models) == 1 else self.models
        if saved.get("optim") is not None and not self.optimizers:
            raise StateMismatch("the checkpoint holds optimizer state but this Checkpoint has no optimizer: pass "
                                "optimizer=... as when it was saved")
        with _building_state():
            if saved.get("optim") is not None:
                model_state, optim_state = get_state_dict(model, self.optimizers)  # builds the state if empty
                return {"model": model_state, "optim": optim_state}
            return {"model": get_model_state_dict(model)}

    def close(self) -> None:
        self._flash.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
