"""Hugging Face Accelerate: ``Accelerator.save_state``'s whole state through stead's flash checkpoint.

::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    flash = FlashState(accelerator)              # after prepare() and register_for_checkpointing()
    step = flash.load()                          # the step restored (memory, else disk), or None
    ...
    flash.save(step, persist=step % 100 == 0)    # returns once the copy to memory is done

A plain ``Accelerator()`` script needs nothing from stead: ``stead run`` sets the same
environment as torchrun, so Accelerate finds its ranks and process group as usual (on a
machine without GPUs, under torchrun as under stead, Accelerate starts its gloo group only
with ``Accelerator(cpu=True)`` or ``ACCELERATE_USE_CPU=1``, which ``accelerate launch --cpu`` sets).

Why a wrapper and not ``save_state``'s hooks: ``register_save_state_pre_hook`` can only
edit the model weights before Accelerate writes every file itself (``torch.save``, on
the training thread); nothing in ``save_state`` can make it a memory copy. So
:class:`FlashState` takes what ``save_state`` would write (models, optimizers,
schedulers, grad scaler, the random generators, each prepared dataloader's epoch and
``StatefulDataLoader`` state, registered custom objects, ``accelerator.step`` and the
checkpoint-folder counter) as one state dict for a
:class:`~stead.plugins.ckpt.worker.FlashCheckpointer`, which persists it in the agent,
in the background, and restores the newest committed step from memory, else from disk.
Under plain ``torchrun`` the same script works: ``persist=True`` saves are written to
disk and the other saves keep nothing. ``accelerator.save_state(dir)`` still works as
before for a folder of Accelerate's own.

Not handled: DeepSpeed, Megatron-LM and XLA (their engines write their own
checkpoints: :class:`FlashState` refuses them). The position inside an epoch is the
script's step: resume with ``accelerator.skip_first_batches`` as Accelerate's examples
do; a shuffled dataloader gives the same order again only with
``DataLoaderConfiguration(use_seedable_sampler=True)`` (its order then depends on the
epoch alone, which :class:`FlashState` restores).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import accelerate
import torch
from accelerate.utils import DistributedType

from stead.core.worker.progress import paused as _building_state
from stead.integrations._common import (
    FlashOwner,
    IntegrationError,
    check_header,
    require_version,
    rng_state,
    set_rng_state,
)
from stead.plugins.ckpt.errors import StateMismatch
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["FORMAT", "FlashState"]

#: the Accelerate releases this integration is tested with: >=SUPPORTED[0],<SUPPORTED[1]
SUPPORTED = ("1.10", "2")
require_version("accelerate", accelerate.__version__, at_least=SUPPORTED[0], below=SUPPORTED[1], extra="accelerate")

#: the layout of the state dict below; a checkpoint of another layout is refused, not guessed at
FORMAT = 1
_UNSUPPORTED = {DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA}


class FlashState(FlashOwner):
    """Everything ``accelerator.save_state()`` saves, flash-saved and restored as one (see the module doc).

    Build it after ``accelerator.prepare(...)`` and ``register_for_checkpointing(...)``: it
    saves the objects the accelerator holds then. ``flash`` lets a test or a script pick the
    checkpointer (its job name, settings); by default one is made as ``stead.ckpt`` makes it.
    """

    def __init__(self, accelerator: Any, *, flash: FlashCheckpointer | None = None) -> None:
        if accelerator.distributed_type in _UNSUPPORTED:
            raise IntegrationError(
                f"FlashState cannot save an Accelerator running {accelerator.distributed_type}: its engine writes "
                "its own checkpoints; use accelerator.save_state(dir) and load_state(dir) for it")
        self.accelerator = accelerator
        super().__init__(flash)

    # -- saving -------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a save stores (every value one the flash checkpoint holds: tensors, numbers, strings)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        acc = self.accelerator
        model, optimizers = self._model(), self._optimizers()
        if model is None:
            model_state: dict[str, Any] = {}
            optim_state: Any = None
        elif optimizers and all(opt.state for opt in optimizers):
            model_state, optim_state = get_state_dict(model, optimizers)
        else:  # a fresh optimizer has no state to save; building one would take a step
            model_state, optim_state = get_model_state_dict(model), None
        return {
            "format": {"integration": "accelerate", "version": FORMAT, "accelerate": accelerate.__version__},
            "model": model_state,
            "optim": optim_state,
            "schedulers": [scheduler.state_dict() for scheduler in acc._schedulers],
            "dataloaders": [_loader_state(loader) for loader in acc._dataloaders],
            "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
            "custom": [obj.state_dict() for obj in acc._custom_objects],
            "rng": rng_state(),
            "counters": {"step": int(acc.step), "save_iteration": int(acc.project_configuration.iteration)},
        }

    def save(self, step: int, *, persist: bool = False) -> bool:
        """Save as ``step`` on every rank; False when skipped (see FlashCheckpointer.save)."""
        return self._flash.save(step, self.state(), persist=persist)

    # -- restoring ----------------------------------------------------------------------------------

    def load(self) -> int | None:
        """Restore the newest committed step into everything :meth:`state` saves; the step, or None (nothing saved).

        Call it on every rank, after ``prepare`` and before iterating a dataloader. A
        checkpoint that does not fit (another model, optimizer, set of schedulers,
        dataloaders or custom objects, another layout or an unsupported Accelerate)
        raises StateMismatch naming what differs, before anything is loaded.
        """
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        model, optimizers = self._model(), self._optimizers()
        fresh = [opt for opt in optimizers if not opt.state]
        try:
            found = self._flash.load(self._template, strict=True)
        except StateMismatch:
            for opt in fresh:  # the template built their state (zeros) to compare shapes: leave them as they were
                opt.state.clear()
            raise
        if found is None:
            return None
        step, state = found
        acc = self.accelerator
        with _building_state():
            if model is not None and state["optim"] is not None:
                set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
            elif model is not None:
                set_model_state_dict(model, state["model"])
        for scheduler, saved in zip(acc._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        for loader, saved in zip(acc._dataloaders, state["dataloaders"], strict=True):
            _load_loader(loader, saved)
        if acc.scaler is not None and state["scaler"] is not None:
            acc.scaler.load_state_dict(state["scaler"])
        for obj, saved in zip(acc._custom_objects, state["custom"], strict=True):
            obj.load_state_dict(saved)
        set_rng_state(state["rng"])
        acc.step = int(state["counters"]["step"])
        acc.project_configuration.iteration = int(state["counters"]["save_iteration"])
        return step

    def _template(self, saved: Any) -> Mapping[str, Any]:
        """The tensors to restore into, after refusing a checkpoint that does not fit (on every rank alike)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        self._check_fits(saved)
        model, optimizers = self._model(), self._optimizers()
        if model is None:
            return {"model": {}}
        with _building_state():
            if saved["optim"] is not None:
                model_state, optim_state = get_state_dict(model, optimizers)  # builds a fresh optimizer's state
                return {"model": model_state, "optim": optim_state}
            return {"model": get_model_state_dict(model)}

    def _check_fits(self, saved: Any) -> None:
        header = check_header(saved, integration="accelerate", package="accelerate", layout=FORMAT,
                              supported=SUPPORTED)
        version = str(header.get("accelerate"))
        acc = self.accelerator
        counts = {"schedulers": len(acc._schedulers), "dataloaders": len(acc._dataloaders),
                  "custom": len(acc._custom_objects)}
        problems = [f"{len(saved[key])} {key} in the checkpoint, {have} prepared here"
                    for key, have in counts.items() if len(saved[key]) != have]
        if saved["optim"] is not None and not self._optimizers():
            problems.append("optimizer state in the checkpoint, no optimizer prepared here")
        if self._model() is None and saved["model"]:
            problems.append("a model in the checkpoint, none prepared here")
        if problems:
            raise StateMismatch(f"the checkpoint (accelerate {version}) does not fit this Accelerator: "
                                f"{'; '.join(problems)}; nothing was loaded. Prepare and register the same objects "
                                "as the run that saved it, or start the job under a new name to start afresh")

    def _model(self) -> torch.nn.Module | None:
        models: list[torch.nn.Module] = list(self.accelerator._models)
        if not models:
            return None
        return models[0] if len(models) == 1 else torch.nn.ModuleList(models)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers under Accelerate's wrappers (building their state must not go through the wrapper's
        gradient-accumulation and scaler logic)."""
        return [getattr(opt, "optimizer", opt) for opt in self.accelerator._optimizers]


def _loader_state(loader: Any) -> dict[str, Any]:
    """A prepared dataloader's epoch (its sampler's seed depends on it) and, for a ``StatefulDataLoader``, its state."""
    state: dict[str, Any] = {"epoch": int(getattr(loader, "iteration", 0))}
    if getattr(loader, "use_stateful_dataloader", False):
        state["state"] = loader.state_dict()
    return state


def _load_loader(loader: Any, saved: Mapping[str, Any]) -> None:
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(int(saved["epoch"]))
    if "state" in saved and getattr(loader, "use_stateful_dataloader", False):
        loader.load_state_dict(saved["state"])
