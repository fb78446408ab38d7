"""Hugging Face ``Trainer`` with stead's flash checkpoint: a save every step in the time of a memory copy, a resume from
memory after a crash.

::

    from stead.integrations.transformers import FlashCheckpoint

    flash = FlashCheckpoint()                       # a flash save every step; persisted on the Trainer's save_steps
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[flash])
    trainer.train(resume_from_checkpoint=flash.resume(trainer))    # None on a fresh start

Why a callback and a resume folder, not a ``Trainer`` subclass: a callback's events (``on_step_end``
with the model, optimizer and scheduler) are the Trainer's public extension point, so a script keeps
its own Trainer (or subclass: TRL's, its own), and a save is the flash checkpoint's memory copy
instead of the Trainer's ``save_model`` and ``torch.save`` of the optimizer. A resume has to give back
more than tensors: the ``TrainerState``, the position in the epoch (the Trainer skips the batches
already trained), each rank's random generators and the callbacks' state. The Trainer does all that
itself for a ``resume_from_checkpoint`` folder, through code paths no subclass needs to reach into;
``resume`` writes the newest flash step (from memory under ``stead run``, else from stead's disk copy)
as such a folder in shared memory (``/dev/shm``): the weights (safetensors: a copy, no pickling), the
generators and the ``TrainerState``; the Trainer loads it, and the folder is removed at the first
step. The optimizer's, scheduler's and scaler's states, most of the bytes, go from memory straight
into the Trainer's objects when training begins (``on_train_begin``), never through a file.

What each save holds: the model's ``state_dict`` (the unwrapped model), the optimizer's and the
scheduler's (and the gradient scaler's) ``state_dict``, the random generators and the ``TrainerState``
(with the callbacks' exported state), plus the transformers version and ``output_dir``, which a
resume checks. Under plain ``torchrun`` the same script runs: only the saves persisted on the
Trainer's ``save_steps`` are kept (on disk), and ``resume`` serves the newest of them.

Supported: a single process or DDP (the state is whole on every rank). FSDP and DeepSpeed keep their
state sharded in their own formats: ``resume`` refuses them rather than writing a folder they cannot read.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import TrainerCallback

from stead.integrations._common import IntegrationError, first_few, python_rng_words, require_version, rng_state
from stead.plugins.ckpt.errors import StateMismatch
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["FlashCheckpoint"]

require_version("transformers", transformers.__version__, at_least="5.0", below="6", extra="transformers")

# the names in the Trainer's checkpoint folder (transformers' constants, stable since 4.x)
_SAFE_WEIGHTS, _STATE = "model.safetensors", "trainer_state.json"
_FORMAT = "stead.transformers/1"


class FlashCheckpoint(TrainerCallback):  # type: ignore[misc]
    """A ``TrainerCallback``: a flash save of the Trainer's whole state every ``every`` optimizer steps, persisted
    to disk on the steps the Trainer saves its own checkpoint (``save_steps``) and at the end of training."""

    def __init__(self, every: int = 1, *, flash: FlashCheckpointer | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: give a whole number of optimizer steps >= 1 (1: every step)")
        self.every = every
        self.flash = flash if flash is not None else FlashCheckpointer()
        self._trainer: Any = None
        self._folder: Path | None = None
        self._due = self._persist = False  # the last step is to be saved (and persisted) at the next one's start
        self._restore: dict[str, Any] | None = None  # what resume() found, for on_train_begin
        self._history: Any = None  # the TrainerState.log_history whose entries _history_json holds, serialized
        self._history_json: list[str] = []

    # -- saving -------------------------------------------------------------------------------------------------
    #
    # A step is saved at the next step's (or epoch's) start, not at its own end: by then the Trainer has logged,
    # evaluated and saved it, so the TrainerState holds what the Trainer's own checkpoint of that step holds, and
    # the generators are where the next step starts from (after its batch was fetched: where the Trainer puts them
    # back when it resumes mid-epoch; before the fetch at an epoch's start, as it does there).

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every == 0 or control.should_save:
            self._due = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._due = self._persist = True  # the Trainer saved its own checkpoint of this step: persist ours too

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The optimizer, scheduler and scaler exist now: their states come from the step ``resume`` found."""
        _refuse_sharded(args)
        restore, self._restore = self._restore, None
        if restore is None:
            return
        kwargs["optimizer"].load_state_dict(restore["optimizer"])
        if restore["scheduler"] is not None and kwargs.get("lr_scheduler") is not None:
            kwargs["lr_scheduler"].load_state_dict(restore["scheduler"])
        scaler = getattr(getattr(self._trainer, "accelerator", None), "scaler", None)
        if restore["scaler"] is not None and scaler is not None:
            scaler.load_state_dict(restore["scaler"])

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_due(args, state, control, kwargs)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_folder()  # the Trainer read everything (weights, optimizer, generators) before its first step
        self._save_due(args, state, control, kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_folder()
        self._persist = True
        self._save_due(args, state, control, kwargs)
        self.flash.wait_persisted()  # the last save reaches the disk before train() returns

    def _save_due(self, args: Any, state: Any, control: Any, kwargs: Mapping[str, Any]) -> None:
        keeps = self._persist or self.flash.mode == "agent"  # without an agent only persisted saves are kept
        if self._due and keeps and state.global_step > 0:
            self.flash.save(state.global_step - 1, self._state(args, state, control, kwargs), persist=self._persist)
        self._due = self._persist = False

    def _state(self, args: Any, state: Any, control: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        model, optimizer, scheduler = kwargs["model"], kwargs["optimizer"], kwargs["lr_scheduler"]
        scaler = getattr(getattr(self._trainer, "accelerator", None), "scaler", None)
        return {
            "format": _FORMAT,
            "transformers": transformers.__version__,
            "output_dir": str(args.output_dir),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng_state(),
            "trainer_state": self._state_json(self._exported(state, control)),
        }

    def _state_json(self, state: Any) -> str:
        """``state`` as the Trainer's ``trainer_state.json``. Its ``log_history`` only grows (an entry per log): each
        entry is serialized once and kept, so a save every step does not copy the whole history every step."""
        history = state.log_history
        if history is not self._history or len(history) < len(self._history_json):  # a new run, a resumed state
            self._history, self._history_json = history, []
        self._history_json.extend(json.dumps(entry, sort_keys=True) for entry in history[len(self._history_json):])
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "log_history"}
        head = json.dumps(fields, sort_keys=True)
        return f'{head[:-1]}, "log_history": [{", ".join(self._history_json)}]}}'

    def _exported(self, state: Any, control: Any) -> Any:
        """``state`` with the callbacks' exported state, as the Trainer's own save records it."""
        from transformers.trainer_callback import ExportableState

        if self._trainer is None:
            return state
        for callback in [*self._trainer.callback_handler.callbacks, control]:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name] = [callback.state()]
                else:
                    state.stateful_callbacks[name] = callback.state()
        return state

    # -- resuming -----------------------------------------------------------------------------------------------

    def resume(self, trainer: Any) -> str | None:
        """The folder to pass as ``trainer.train(resume_from_checkpoint=...)``: the newest flash step written in the
        Trainer's checkpoint format, or None when nothing was saved (a fresh start).

        Call it on every rank before ``train()``. A checkpoint of another model (keys, shapes), of another
        transformers version or of a Trainer saving to another ``output_dir`` is refused before anything is
        written or loaded, with what does not fit."""
        self._trainer = trainer
        _refuse_sharded(trainer.args)
        found = self.flash.load()
        if found is None:
            return None
        step, saved = found
        self._check(saved, trainer, step)
        self._folder = _write_folder(saved, trainer.args, step)
        self._restore = {key: saved[key] for key in ("optimizer", "scheduler", "scaler")}
        atexit.register(self._remove_folder)
        return str(self._folder)

    def _remove_folder(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder.parent, ignore_errors=True)
            self._folder = None

    @staticmethod
    def _check(saved: Any, trainer: Any, step: int) -> None:
        if not isinstance(saved, Mapping) or saved.get("format") != _FORMAT:
            raise StateMismatch(f"the flash checkpoint of step {step} was not saved by stead.integrations."
                                "transformers.FlashCheckpoint: start this job under a new --job-name, or remove "
                                "the callback")
        if saved["transformers"] != transformers.__version__:
            raise IntegrationError(f"the flash checkpoint of step {step} was saved with transformers "
                                   f"{saved['transformers']}, this is {transformers.__version__}: resume with the "
                                   "same version, or start afresh under a new --job-name")
        if saved["output_dir"] != str(trainer.args.output_dir):
            raise IntegrationError(f"the flash checkpoint of step {step} belongs to a Trainer saving to "
                                   f"{saved['output_dir']!r}, this one saves to {str(trainer.args.output_dir)!r}: "
                                   "give the same output_dir, or start afresh under a new --job-name")
        want = {k: (tuple(v.shape), v.dtype) for k, v in trainer.model.state_dict().items()}
        have = {k: (tuple(v.shape), v.dtype) for k, v in saved["model"].items()}
        if want != have:
            raise StateMismatch(f"the flash checkpoint of step {step} is of another model ({_difference(have, want)}); "
                                "nothing was loaded. Build the same model, or start afresh under a new --job-name")


def _refuse_sharded(args: Any) -> None:
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise IntegrationError("stead's flash checkpoint for the Trainer holds whole state (one process or DDP); "
                               "with FSDP or DeepSpeed, leave FlashCheckpoint out and resume from the Trainer's own "
                               "checkpoints")


def _difference(saved: Mapping[str, Any], model: Mapping[str, Any]) -> str:
    """What differs between two ``{name: (shape, dtype)}``, the first few of each kind."""
    parts = []
    if missing := sorted(model.keys() - saved.keys()):
        parts.append(f"not in the checkpoint: {first_few(missing, 4)}")
    if unexpected := sorted(saved.keys() - model.keys()):
        parts.append(f"not in this model: {first_few(unexpected, 4)}")
    if differ := sorted(k for k in model.keys() & saved.keys() if model[k] != saved[k]):
        shapes = [f"{k} {list(saved[k][0])} {saved[k][1]} (this model: {list(model[k][0])} {model[k][1]})"
                  for k in differ]
        parts.append(f"saved as {first_few(shapes, 4)}")
    return "; ".join(parts)


def _write_folder(saved: Mapping[str, Any], args: Any, step: int) -> Path:
    """What the Trainer reads of ``saved`` before training (the weights, the generators, the ``TrainerState``) as
    its ``checkpoint-N`` folder, in shared memory when the machine has it. The weights are a safetensors file (a
    copy, no pickling); the optimizer's, scheduler's and scaler's states are not written: the Trainer loads none
    without an ``optimizer.pt``, and :meth:`FlashCheckpoint.on_train_begin` loads them from memory."""
    from safetensors.torch import save_file

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    folder = Path(tempfile.mkdtemp(prefix="stead-hf-resume-", dir=base)) / f"checkpoint-{step + 1}"
    try:
        folder.mkdir()
        save_file(dict(saved["model"]), str(folder / _SAFE_WEIGHTS), metadata={"format": "pt"})
        torch.save(_trainer_rng(saved["rng"], args),
                   folder / (f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"))
        (folder / _STATE).write_text(saved["trainer_state"])
    except BaseException:
        shutil.rmtree(folder.parent, ignore_errors=True)
        raise
    return folder


def _trainer_rng(rng: Mapping[str, Any], args: Any) -> dict[str, Any]:
    """stead's generator states in the Trainer's ``rng_state.pth`` layout (NumPy's as a NumPy tuple)."""
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    out: dict[str, Any] = {
        "python": (int(rng["python"][0]), python_rng_words(rng["python"][1]), rng["python"][2]),
        "numpy": (str(kind), keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)),
        "cpu": rng["cpu"],
    }
    if "cuda" in rng:
        with contextlib.suppress(IndexError):
            out["cuda"] = list(rng["cuda"]) if args.world_size > 1 else rng["cuda"][torch.cuda.current_device()]
    return out
