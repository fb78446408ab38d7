"""PyTorch Lightning's ``Trainer`` (and ``Fabric``) saving into stead's flash checkpoint and resuming from it.

::

    from stead.integrations.lightning import FlashCheckpoint, ResumableLoader

    flash = FlashCheckpoint(every_n_steps=1, persist_every_n_steps=50)
    trainer = Trainer(..., callbacks=[flash], plugins=[flash.io])
    trainer.fit(model, ckpt_path=flash.resume_path())   # None (a fresh start), or the flash step

Why a callback as well as a ``CheckpointIO``: Lightning hands a checkpoint to its ``CheckpointIO`` on
global rank 0 only, while a flash checkpoint is committed once *every* rank saved the step. So
:class:`FlashCheckpoint` takes the Lightning checkpoint on every rank after each optimizer step it
is told to (``every_n_steps``) and copies it into the agent's shared memory (a memcpy; to disk as
well every ``persist_every_n_steps``). :class:`FlashCheckpointIO` leaves ``ModelCheckpoint``'s files
as they are (written with ``torch.save`` at the path Lightning chose: the durable, portable copies)
and serves :data:`FLASH_PATH` from the flash checkpoint. :meth:`FlashCheckpointIO.resume_path` must
be called on every rank before ``fit``: the ranks agree there (one all-reduce; it starts the
process group Lightning would start) on the newest step every rank can restore, so that all pass
the same ``ckpt_path``. Under plain ``torchrun`` or ``python`` the same script keeps only the
persisted saves (on disk, in stead's folder) and resumes from them.

A flash checkpoint holds no pickle, so the Lightning checkpoint is made codec-safe when saved
(:func:`codec_safe`): mappings become dicts, NumPy values tensors or numbers, paths strings, enums
their values; hyperparameters, which a resumed ``fit`` does not read, keep what is left as its
``repr``; anything else is refused with its place named. ``ModelCheckpoint``'s files keep everything.

Lightning restarts a plain ``DataLoader`` at the start of the epoch; :class:`ResumableLoader` puts the
number of batches trained on in this epoch into the checkpoint and skips them when resuming.

A checkpoint that does not fit (another model, a newer Lightning) is refused before Lightning loads
any of it, naming what differs. The optimizers and schedulers do not exist yet at that point: they
are checked (their parameter groups' sizes, their numbers) once they do, after the model's weights
were loaded and before their states are, and ``fit`` stops with an error naming the difference.
"""

from __future__ import annotations

import enum
import itertools
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import lightning
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from stead.integrations._common import IntegrationError, first_few, release, require_version, rng_state, set_rng_state
from stead.plugins.ckpt.errors import UnsupportedState
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["FLASH_PATH", "FlashCheckpoint", "FlashCheckpointIO", "ResumableLoader", "check_version", "codec_safe"]

#: the ``ckpt_path`` that :class:`FlashCheckpointIO` reads from the flash checkpoint (not a file)
FLASH_PATH = "stead://flash"
#: the checkpoint's key for what stead adds: the layout's version and the Lightning that saved it
_MARK = "stead"
_FORMAT = 1
#: the checkpoint keys a resumed fit does not read back: what the codec refuses there is kept as its repr
_INFORMATIVE = ("hyper_parameters", "datamodule_hyper_parameters")


def check_version(version: str) -> None:
    """Refuse a Lightning outside what this integration was tested with (2.5 up to, not including, 3)."""
    require_version("lightning", version, at_least="2.5", below="3", extra="lightning")


check_version(lightning.__version__)


def codec_safe(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` as a flash checkpoint can hold it (see the module docstring): UnsupportedState names the rest."""
    if not isinstance(checkpoint, Mapping):
        raise UnsupportedState(f"a checkpoint must be a mapping, got {type(checkpoint).__name__}")
    return {str(key): _safe(value, f"[{key!r}]", lenient=key in _INFORMATIVE) for key, value in checkpoint.items()}


def _safe(value: Any, where: str, *, lenient: bool) -> Any:
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                if not lenient:
                    raise UnsupportedState(f"{where} has the key {key!r} ({type(key).__name__}); a flash checkpoint "
                                           "keeps str and int keys only: use str keys")
                key = str(key)
            out[key] = _safe(item, f"{where}[{key!r}]", lenient=lenient)
        return out
    if isinstance(value, (list, tuple)):
        items = [_safe(item, f"{where}[{i}]", lenient=lenient) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, enum.Enum):
        return _safe(value.value, where, lenient=lenient)
    if isinstance(value, (pathlib.PurePath, torch.dtype, torch.device)):
        return str(value)
    if lenient:
        return repr(value)
    raise UnsupportedState(f"the checkpoint's {where} is a {type(value).__module__}.{type(value).__qualname__}, "
                           "which a flash checkpoint cannot hold without pickle; return tensors, numbers, strings "
                           "and dicts or lists of those from the state_dict()/on_save_checkpoint() that put it there")


class FlashCheckpointIO(TorchCheckpointIO):  # type: ignore[misc]  # Lightning's classes are Any to mypy
    """Lightning's ``CheckpointIO``: files with ``torch.save`` as usual; :data:`FLASH_PATH` from the flash checkpoint.

    Give the same instance to ``Trainer(plugins=[...])`` or ``Fabric(plugins=[...])``. ``settings`` and
    ``job`` are :class:`~stead.ckpt.FlashCheckpointer`'s (where persisted steps go without an agent).
    """

    def __init__(self, *, settings: CheckpointSettings | None = None, job: str | None = None) -> None:
        super().__init__()
        self._settings, self._job = settings, job
        self._flash: FlashCheckpointer | None = None
        self._restored: dict[Any, Any] | None = None  # the step resume_path() agreed on, until Lightning loads it
        self._rng: dict[str, Any] | None = None  # its random generators' state, for FlashCheckpoint.on_train_start
        #: the loaded checkpoint's optimizers (their groups' sizes) and scheduler count, for FlashCheckpoint to check
        self.loaded_shape: tuple[list[list[int]], int] | None = None
        #: the module a loaded checkpoint must fit (the Trainer's, bound by FlashCheckpoint.setup)
        self.module: torch.nn.Module | None = None

    @property
    def flash(self) -> FlashCheckpointer:
        """The flash checkpointer underneath (made on first use; :meth:`close` closes it)."""
        if self._flash is None:
            self._flash = FlashCheckpointer(settings=self._settings, job=self._job)
        return self._flash

    def resume_path(self, otherwise: str | None = None) -> str | None:
        """:data:`FLASH_PATH` when every rank can restore a step (memory first, else disk), else ``otherwise``.

        Call it on every rank before ``fit`` (or after ``Fabric.launch``): it is a collective.
        ``otherwise="last"`` falls back to ``ModelCheckpoint(save_last=True)``'s file.
        """
        _start_process_group()
        found = self.flash.load()
        if found is None:
            self._restored = None
            return otherwise
        self._restored = found[1]
        return FLASH_PATH

    def save_flash(self, step: int, checkpoint: Mapping[str, Any], *, persist: bool = False) -> bool:
        """Copy ``checkpoint`` into the flash checkpoint as ``step`` (every rank, same step); False when skipped."""
        state = codec_safe(checkpoint)
        state[_MARK] = {"format": _FORMAT, "lightning": lightning.__version__, "rng": rng_state()}
        return self.flash.save(step, state, persist=persist)

    def save_fabric(self, fabric: Any, step: int, state: Mapping[str, Any], *, persist: bool = False) -> bool:
        """``fabric.save`` for the flash checkpoint: modules and optimizers in ``state`` as their state dicts.

        Fabric's ``save`` reaches a ``CheckpointIO`` on rank 0 only; call this on every rank instead.
        """
        converted = fabric.strategy._convert_stateful_objects_in_state(dict(state), filter={})
        return self.save_flash(step, converted, persist=persist)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if str(path) == FLASH_PATH:
            if self._restored is None:
                raise IntegrationError(f"ckpt_path={FLASH_PATH!r} but no flash step was found for it: pass "
                                       "ckpt_path=flash.resume_path() (None when there is nothing to resume), "
                                       "called on every rank just before fit")
            checkpoint, self._restored = self._restored, None
            mark = checkpoint.pop(_MARK, None)
            if not isinstance(mark, Mapping) or mark.get("format") != _FORMAT:
                raise IntegrationError(f"the flash checkpoint was not saved by stead's Lightning integration (format "
                                       f"{_FORMAT}; its mark: {str(mark)[:200]}): resume it the way it was saved")
            self._rng = dict(mark["rng"])
            if self.module is None:  # Fabric: its generators go on from here (a Trainer's once training starts)
                self.restore_rng()
        else:
            checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if self.module is not None:
            _check_fits(checkpoint, self.module, source=str(path))
        self.loaded_shape = _group_sizes(checkpoint.get("optimizer_states")), len(checkpoint.get("lr_schedulers") or [])
        return checkpoint

    def restore_rng(self) -> None:
        """Give Python's, NumPy's and torch's generators the state they had at the step last loaded from memory."""
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None

    def close(self) -> None:
        """Wait for the persists asked for, then close the flash checkpointer (the agent keeps the memory)."""
        if self._flash is not None:
            self._flash.wait_persisted()
            self._flash.close()
            self._flash = None


class FlashCheckpoint(Callback):  # type: ignore[misc]
    """Save the Lightning checkpoint into the flash checkpoint every ``every_n_steps`` optimizer steps, on every rank.

    Every ``persist_every_n_steps`` steps the save is also written to disk (by the agent, in the
    background; without an agent, before the step goes on): only those survive the whole job, or
    a run under plain ``torchrun``. ``io`` is the ``CheckpointIO`` to pass to ``Trainer(plugins=...)``.
    """

    def __init__(self, *, every_n_steps: int = 1, persist_every_n_steps: int | None = None,
                 io: FlashCheckpointIO | None = None) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("persist_every_n_steps", persist_every_n_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive whole number of optimizer steps")
        self.every_n_steps = every_n_steps
        self.persist_every_n_steps = persist_every_n_steps
        self.io = io if io is not None else FlashCheckpointIO()
        self._last_step = -1

    def resume_path(self, otherwise: str | None = None) -> str | None:
        """See :meth:`FlashCheckpointIO.resume_path`: the ``ckpt_path`` to pass to ``fit``."""
        return self.io.resume_path(otherwise)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        if strategy.checkpoint_io is not self.io:
            raise IntegrationError(
                f"this Trainer saves checkpoints through {type(strategy.checkpoint_io).__name__}, not through this "
                "FlashCheckpoint's: a flash step could not be resumed; pass Trainer(callbacks=[flash], "
                "plugins=[flash.io]) and no other CheckpointIO")
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise IntegrationError(
                f"the {type(strategy).__name__} strategy shards or saves its checkpoints its own way; stead's "
                "Lightning integration supports one device and DDP (strategy='ddp'): use one of those, or "
                "stead.ckpt.Checkpoint in your own loop")
        self.io.module = pl_module
        self._last_step = trainer.global_step  # a resumed step is not saved again

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """The optimizers exist now (not when the checkpoint was loaded): refuse the checkpoint's if they differ,
        before Lightning loads them (it would load the schedulers' states that it can pair, and drop the rest)."""
        loaded, self.io.loaded_shape = self.io.loaded_shape, None
        if loaded is None or trainer.state.fn != "fit":
            return
        groups, schedulers = loaded
        have = [[len(g["params"]) for g in optimizer.param_groups] for optimizer in trainer.optimizers]
        if groups != have or schedulers != len(trainer.lr_scheduler_configs):
            raise IntegrationError(
                f"the checkpoint holds {len(groups)} optimizer(s) with parameter groups of sizes {groups} and "
                f"{schedulers} scheduler(s); configure_optimizers() gave {have} and "
                f"{len(trainer.lr_scheduler_configs)}: the model's weights were loaded, its optimizers not, and fit "
                "stops. Resume with the configure_optimizers() it was saved with, or start afresh (ckpt_path=None)")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # here, not when the checkpoint is loaded: Lightning's setup between the two draws from the generators
        self.io.restore_rng()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = int(trainer.global_step)
        if step == self._last_step or step % self.every_n_steps:
            return  # no optimizer step in this batch (gradient accumulation), or not one to save
        self._last_step = step
        persist = self.persist_every_n_steps is not None and step % self.persist_every_n_steps == 0
        # every rank dumps (Trainer.save_checkpoint does too; only its writing is rank 0's)
        self.io.save_flash(step, trainer._checkpoint_connector.dump_checkpoint(weights_only=False), persist=persist)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.io.module = None
        self.io.close()


class ResumableLoader:
    """A data loader whose position in the epoch travels in Lightning's checkpoint (``state_dict``).

    Build it in ``train_dataloader`` (``ResumableLoader(DataLoader(...), self.trainer)``) with a
    sampler that orders each epoch the same way every time (e.g. ``DistributedSampler`` with a
    seed: Lightning calls its ``set_epoch``). Resuming, the batches already trained on are read
    and dropped (a cost of up to one epoch's reading, none of training).
    """

    def __init__(self, loader: Iterable[Any], trainer: Any) -> None:
        self.loader, self.trainer = loader, trainer
        self._skip = 0

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        iterator = iter(self.loader)
        return itertools.islice(iterator, skip, None) if skip else iterator

    def state_dict(self) -> dict[str, int]:
        # the batches whose training step ran in this epoch: the loader itself runs ahead (Lightning prefetches)
        return {"batches": int(self.trainer.fit_loop.epoch_loop.batch_progress.current.processed)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        batches = int(state.get("batches", 0))
        self._skip = batches if 0 < batches < len(self) else 0  # a finished epoch starts the next one whole


def _start_process_group() -> None:
    """Start the default process group Lightning would start (it then uses it), for the ranks to agree on a step."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group()  # env:// from torchrun's (or stead's) variables; gloo on CPU, NCCL for CUDA too


def _check_fits(checkpoint: Mapping[str, Any], module: torch.nn.Module, *, source: str) -> None:
    """Refuse ``checkpoint`` before Lightning loads any of it when it was saved by a newer Lightning or for another
    model (keys or shapes), naming what differs."""
    saved = checkpoint.get("pytorch-lightning_version")
    if isinstance(saved, str) and release(saved) > release(lightning.__version__):
        raise IntegrationError(f"{source} was saved by Lightning {saved}, newer than this environment's "
                               f"{lightning.__version__}, which cannot read it: install Lightning >={saved}")
    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping):
        raise IntegrationError(f"{source} holds no model state_dict (is it a Lightning checkpoint?): resume from a "
                               "checkpoint saved by Trainer.fit")
    want = module.state_dict()
    strict = bool(getattr(module, "strict_loading", True))
    problems = []
    if strict:
        missing = [k for k in want if k not in state]
        unexpected = [k for k in state if k not in want]
        if missing:
            problems.append(f"missing {first_few(missing)}")
        if unexpected:
            problems.append(f"unexpected {first_few(unexpected)}")
    shapes = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in want.items()
              if k in state and isinstance(state[k], torch.Tensor) and isinstance(v, torch.Tensor)
              and state[k].shape != v.shape]
    if shapes:
        problems.append(f"other shapes ({first_few(shapes)})")
    if problems:
        raise IntegrationError(f"{source} is not a checkpoint of this {type(module).__name__}: "
                               f"{'; '.join(problems)}; nothing was loaded. Resume with the model it was saved "
                               "from, or start afresh (ckpt_path=None)")


def _group_sizes(optimizer_states: Any) -> list[list[int]]:
    return [[len(group["params"]) for group in state["param_groups"]] for state in optimizer_states or []]
