"""DeepSpeed: the files of ``engine.save_checkpoint`` kept in stead's flash checkpoint, and loaded back by DeepSpeed.

::

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    flash = FlashState(engine)                   # after deepspeed.initialize
    restored = flash.load()                      # Restored(step, client_state) from memory, else disk; or None
    ...
    flash.save(step, client_state={"epoch": epoch}, persist=step % 100 == 0)   # on every rank, the same step

Why a ``CheckpointEngine`` driven by :class:`FlashState`: every file ``engine.save_checkpoint``
writes (the model states with the scheduler, DeepSpeed's step counters and the ``client_state``;
each rank's ZeRO optimizer partition) goes through the engine's pluggable ``CheckpointEngine``, and
``engine.load_checkpoint`` reads them back through it. During :meth:`FlashState.save` a
``CheckpointEngine`` of this module's stands in for DeepSpeed's: it keeps each file's state dict in
memory (no file, no folder) and a :class:`~stead.plugins.ckpt.worker.FlashCheckpointer` copies them
into the agent's shared memory as one step (persisted to disk in the background when asked).
:meth:`FlashState.load` hands that step back to DeepSpeed's own ``load_checkpoint``, so DeepSpeed
itself restores what it saved, at every ZeRO stage, and nothing of its loading is re-implemented here.
The script's own ``engine.save_checkpoint(dir)`` / ``load_checkpoint(dir)`` calls cannot carry a
flash step: ``load_checkpoint`` reads the ``latest`` file and looks for the model files on disk
before it asks any ``CheckpointEngine``, so after a restart (on a new node above all) it would find
no step, or an older one, while the step is in memory. So ``save`` asks for no ``latest`` file and
writes nothing to disk (DeepSpeed's copy of its ``zero_to_fp32.py`` scripts is skipped: they belong
with its own folders), and ``load`` lays the step out as empty files in a temporary folder for those
checks and serves their contents from memory. ``engine.save_checkpoint(dir)`` still writes
DeepSpeed's own folders as before (the portable copies, with ``zero_to_fp32.py``).

A flash checkpoint holds no pickle. The ZeRO optimizer's state holds objects (its loss scaler, a
``ZeroStageEnum``, the fragment addresses of its parameters): each is saved as plain data marked with
its type and rebuilt on load by this module, from a fixed table of DeepSpeed's classes; any other
object in a file (in ``client_state``, say) is refused at save, with its place named. Every rank
keeps the model states file as well as its ZeRO partition (DeepSpeed writes it from data-parallel
rank 0 only), so that a restarted rank restores from its own memory. The random generators
(Python's, NumPy's, torch's) are saved and restored too; DeepSpeed's files do not hold them.

A checkpoint that does not fit the engine (another model, ZeRO stage, precision, data-parallel world
size or scheduler, another layout or an unsupported DeepSpeed) is refused before DeepSpeed loads
any of it, on every rank, naming what differs. Under plain ``torchrun`` the same script runs: only
``persist=True`` saves are kept (on disk) and ``load`` reads them.

Not handled (refused when :class:`FlashState` is built, with what to do): pipeline parallelism, MoE
layers, tensor or model parallelism (an ``mpu``), NVMe offload, ``elastic_checkpoint`` and universal
checkpoints: DeepSpeed reads their files from disk itself, or another rank's files. A restore at
another data-parallel world size is refused as DeepSpeed refuses it. A save is collective (DeepSpeed's
``save_checkpoint`` holds barriers): every rank calls it with the same step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import deepspeed
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import logger as deepspeed_logger
from deepspeed.utils.tensor_fragment import fragment_address

from stead.integrations._common import (
    AFRESH,
    FlashOwner,
    IntegrationError,
    check_header,
    first_few,
    require_version,
    rng_state,
    set_rng_state,
)
from stead.plugins.ckpt.errors import StateMismatch
from stead.plugins.ckpt.worker import FlashCheckpointer

__all__ = ["FORMAT", "FlashState", "Restored"]

#: the DeepSpeed releases this integration is tested with: >=SUPPORTED[0],<SUPPORTED[1]
SUPPORTED = ("0.18", "0.20")
require_version("deepspeed", deepspeed.__version__, at_least=SUPPORTED[0], below=SUPPORTED[1], extra="deepspeed")

#: the layout of the state dict below; a checkpoint of another layout is refused, not guessed at
FORMAT = 1
#: the save folder DeepSpeed is given for a flash save: a name in its file paths, never created
_NOWHERE = "stead-flash"
#: the tag of the folder a flash step is laid out in for load_checkpoint
_TAG = "flash"
#: the key that marks a DeepSpeed object saved as plain data; its value names the object's type
_TYPE = "stead.deepspeed.type"


class Restored(NamedTuple):
    """What :meth:`FlashState.load` restored: the step given to ``save``, and what ``load_checkpoint`` returns as the
    client state (the ``client_state`` saved, with the entries DeepSpeed adds to it)."""

    step: int
    client_state: dict[str, Any]


class FlashState(FlashOwner):
    """``engine.save_checkpoint``'s files, flash-saved and loaded back by DeepSpeed (see the module docstring).

    Build it after ``deepspeed.initialize``, on every rank. ``flash`` lets a test or a script pick
    the checkpointer (its job name, settings); by default one is made as ``stead.ckpt`` makes it.
    """

    def __init__(self, engine: Any, *, flash: FlashCheckpointer | None = None) -> None:
        _refuse_unsupported(engine)
        self.engine = engine
        super().__init__(flash)

    # -- saving -------------------------------------------------------------------------------------

    def save(self, step: int, *, client_state: Mapping[str, Any] | None = None, persist: bool = False) -> bool:
        """Save as ``step`` on every rank (a collective); False when not kept (see FlashCheckpointer.save).

        ``client_state`` is ``save_checkpoint``'s: tensors, numbers, strings, and dicts or lists of those.
        """
        if self._flash.mode == "disk" and not persist:
            return False  # without an agent only persisted saves are kept: spare DeepSpeed its collectives
        header = {**self._header(), "client_state": sorted(map(str, client_state or {}))}
        state = {"format": header, "files": self._files(client_state), "rng": rng_state()}
        return self._flash.save(step, state, persist=persist)

    def _header(self) -> dict[str, Any]:
        engine = self.engine
        precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        return {"integration": "deepspeed", "version": FORMAT, "deepspeed": deepspeed.__version__,
                "zero_stage": int(engine.zero_optimization_stage()), "precision": precision,
                "dp_world_size": int(engine.seq_dp_world_size)}

    def _files(self, client_state: Mapping[str, Any] | None) -> dict[str, Any]:
        """What ``engine.save_checkpoint`` writes on this rank, by file name, as plain data (nothing on disk)."""
        files = _MemoryFiles()
        with self._through(files):
            self.engine.save_checkpoint(_NOWHERE, client_state=dict(client_state or {}), save_latest=False)
        return files.files

    # -- restoring ----------------------------------------------------------------------------------

    def load(self) -> Restored | None:
        """Load the newest committed step into the engine through ``engine.load_checkpoint``; what was restored, or
        None (nothing saved).

        Call it on every rank, after ``deepspeed.initialize`` and before training. A checkpoint
        that does not fit the engine raises StateMismatch naming what differs, before anything
        is loaded.
        """
        expected = self._files(None)  # what this engine saves: the files and shapes a checkpoint must have
        found = self._flash.load(lambda saved: self._check_fits(saved, expected))
        if found is None:
            return None
        step, state = found
        files = {str(name): _rebuilt(content) for name, content in state["files"].items()}
        with tempfile.TemporaryDirectory(prefix="stead-deepspeed-") as folder:
            (Path(folder) / _TAG).mkdir()
            for name in files:  # load_checkpoint looks for the files on disk; their contents come from memory
                (Path(folder) / _TAG / name).touch()
            try:
                with self._through(_MemoryFiles(files)):
                    path, client_state = self.engine.load_checkpoint(folder, tag=_TAG)
            except Exception as exc:
                raise IntegrationError(f"DeepSpeed could not load step {step} of the flash checkpoint, which fits "
                                       f"this engine ({type(exc).__name__}: {exc}); the engine may be partly "
                                       f"loaded: stop the job. {AFRESH}") from exc
        if path is None:
            raise IntegrationError(f"DeepSpeed found no model states in step {step} of the flash checkpoint "
                                   f"(files: {first_few(sorted(files))}). {AFRESH}")
        set_rng_state(state["rng"])
        return Restored(step, dict(client_state or {}))

    def _check_fits(self, saved: Any, expected: Mapping[str, Any]) -> None:
        """Refuse a checkpoint that does not fit (on every rank alike: the flash checkpointer agrees on it); None: the
        step is restored into new tensors, which DeepSpeed copies into its own."""
        header = check_header(saved, integration="deepspeed", package="deepspeed", layout=FORMAT,
                              supported=SUPPORTED)
        version = str(header.get("deepspeed"))
        here = self._header()
        problems = [f"{what} {header.get(key)!r} in the checkpoint, {here[key]!r} here"
                    for key, what in (("zero_stage", "ZeRO stage"), ("precision", "precision"),
                                      ("dp_world_size", "data-parallel world size")) if header.get(key) != here[key]]
        if not problems:
            client_state = header.get("client_state")
            problems = _misfits(saved["files"], expected, client_state if isinstance(client_state, list) else [])
        if problems:
            raise StateMismatch(f"the checkpoint (deepspeed {version}) does not fit this engine: "
                                f"{'; '.join(problems[:8])}{' and more' if len(problems) > 8 else ''}; nothing was "
                                "loaded. Build the engine as the run that saved it did (model, DeepSpeed config, world "
                                f"size), or start the job under a new name to start afresh")

    @contextlib.contextmanager
    def _through(self, files: _MemoryFiles) -> Iterator[None]:
        """DeepSpeed's checkpoint calls go to ``files``, from every rank, quietly, for the duration."""
        engine = self.engine
        before = engine.checkpoint_engine, engine.save_non_zero_checkpoint, deepspeed_logger.level
        engine.checkpoint_engine, engine.save_non_zero_checkpoint = files, True
        engine._copy_recovery_script = _no_recovery_script  # an instance attribute over DeepSpeed's method
        deepspeed_logger.setLevel(logging.WARNING)  # its "Saving model checkpoint: <a path never written>"
        try:
            yield
        finally:
            engine.checkpoint_engine, engine.save_non_zero_checkpoint = before[:2]
            del engine._copy_recovery_script
            deepspeed_logger.setLevel(before[2])


class _MemoryFiles(CheckpointEngine):  # type: ignore[misc]  # DeepSpeed's classes are Any to mypy
    """DeepSpeed's ``CheckpointEngine`` over a dict: each file's state dict kept (save) or served (load) by file name,
    nothing on disk; every rank a writer of the model states."""

    def __init__(self, files: dict[str, Any] | None = None) -> None:
        super().__init__(None)
        self.name = "stead.integrations.deepspeed"
        self.files: dict[str, Any] = {} if files is None else files

    def create(self, info: Any) -> None:
        self.files.clear()

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """No folders: nothing of a flash save goes to disk."""

    def save(self, state_dict: Any, path: str) -> None:
        self.files[os.path.basename(path)] = _plain(state_dict)

    def load(self, path: str, map_location: Any = None) -> Any:
        name = os.path.basename(path)
        if name not in self.files:
            raise IntegrationError(f"DeepSpeed asked for {name}, which the flash checkpoint's step does not hold "
                                   f"(it holds {first_few(sorted(self.files))})")
        return self.files[name]

    def commit(self, info: Any) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return True


def _no_recovery_script(save_path: str) -> None:
    """Stands in for ``DeepSpeedEngine._copy_recovery_script`` during a flash save (it copies files into the folder)."""


def _refuse_unsupported(engine: Any) -> None:
    if not isinstance(engine, DeepSpeedEngine):
        raise IntegrationError(f"FlashState takes the engine that deepspeed.initialize returns, got "
                               f"{type(engine).__module__}.{type(engine).__qualname__}")
    uses = []
    if isinstance(engine, PipelineEngine):
        uses.append("pipeline parallelism")
    if engine.has_moe_layers:
        uses.append("mixture-of-experts layers")
    if engine.mp_world_size > 1:
        uses.append(f"model parallelism ({engine.mp_world_size} model-parallel ranks)")
    if engine.zero_nvme_offload_optimizer() or getattr(engine.zero_offload_param(), "device", None) == "nvme":
        uses.append("NVMe offload")
    if engine.zero_elastic_checkpoint():
        uses.append("zero_optimization.elastic_checkpoint (each rank reads every rank's partition)")
    if engine.load_universal_checkpoint():
        uses.append("checkpoint.load_universal")
    if uses:
        raise IntegrationError(f"FlashState cannot keep this DeepSpeed engine's checkpoints: it uses "
                               f"{', '.join(uses)}, whose files DeepSpeed reads from disk itself. Use "
                               "engine.save_checkpoint(dir) and engine.load_checkpoint(dir) for it, or train without "
                               "those")


# -- DeepSpeed's objects as plain data, and back ----------------------------------------------------------------------

_SCALERS: dict[str, Any] = {"LossScaler": LossScaler, "DynamicLossScaler": DynamicLossScaler}


def _plain(value: Any) -> Any:
    """``value`` with the DeepSpeed objects the flash checkpoint cannot hold made plain data (see :func:`_rebuilt`);
    anything else it cannot hold is left for its encoder to refuse, naming the place."""
    if isinstance(value, ZeroStageEnum):
        return {_TYPE: "ZeroStageEnum", "value": int(value)}
    if type(value) in _SCALERS.values():
        return {_TYPE: type(value).__name__, "state": _plain(vars(value))}
    if isinstance(value, fragment_address):
        return {_TYPE: "fragment_address", "numel": int(value.numel), "start": int(value.start)}
    if isinstance(value, torch.dtype):
        return {_TYPE: "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):  # torch.Size too: DeepSpeed reads the shapes it saved only in zero_to_fp32.py
        return tuple(_plain(item) for item in value)
    return value


def _rebuilt(value: Any) -> Any:
    """What :func:`_plain` made plain, as DeepSpeed's objects again (only the types in its table: nothing else runs)."""
    if isinstance(value, Mapping):
        kind = value.get(_TYPE)
        if kind is None:
            return {key: _rebuilt(item) for key, item in value.items()}
        rebuild = _REBUILD.get(str(kind))
        if rebuild is None:
            raise IntegrationError(f"the flash checkpoint holds a DeepSpeed object of type {kind!r}, which this stead "
                                   f"does not rebuild. {AFRESH}")
        return rebuild(value)
    if isinstance(value, list):
        return [_rebuilt(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_rebuilt(item) for item in value)
    return value


def _scaler(saved: Mapping[str, Any]) -> Any:
    scaler = _SCALERS[str(saved[_TYPE])]
    rebuilt = scaler.__new__(scaler)
    rebuilt.__dict__.update(_rebuilt(saved["state"]))
    return rebuilt


def _dtype(saved: Mapping[str, Any]) -> torch.dtype:
    dtype = getattr(torch, str(saved["name"]), None)
    if not isinstance(dtype, torch.dtype):
        raise IntegrationError(f"the flash checkpoint names the dtype {saved['name']!r}, which this torch lacks")
    return dtype


_REBUILD: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "ZeroStageEnum": lambda saved: ZeroStageEnum(int(saved["value"])),
    "LossScaler": _scaler,
    "DynamicLossScaler": _scaler,
    "fragment_address": lambda saved: fragment_address(numel=int(saved["numel"]), start=int(saved["start"])),
    "dtype": _dtype,
}


# -- does a checkpoint fit ------------------------------------------------------------------------------------------


def _misfits(saved: Mapping[str, Any], expected: Mapping[str, Any], client_state: list[str]) -> list[str]:
    """How the checkpoint's files (tensors as their metadata) differ from what this engine saves (``expected``); the
    ``client_state`` keys saved with the model states are the script's, not compared."""
    names, have = sorted(map(str, saved)), sorted(expected)
    if names != have:
        return [f"the files {first_few(names)} in the checkpoint, {first_few(have)} here"]
    problems = []
    for name in names:
        skip = _fresh_optimizer_states(expected[name]) | {(key,) for key in client_state}
        mine, theirs = _tensors(expected[name], skip), _tensors(saved[name], skip)
        where = f"{name}: "
        problems += [f"{where}{_describe(p)} is in the checkpoint but not here" for p in theirs if p not in mine]
        problems += [f"{where}{_describe(p)} is here but not in the checkpoint" for p in mine if p not in theirs]
        problems += [f"{where}{_describe(path)} is {theirs[path]} in the checkpoint and {mine[path]} here"
                     for path in mine if path in theirs and mine[path] != theirs[path]]
        if isinstance(expected[name], Mapping) and "lr_scheduler" in expected[name]:
            here, there = expected[name]["lr_scheduler"] is not None, saved[name].get("lr_scheduler") is not None
            if here != there:
                problems.append(f"{where}{'a' if there else 'no'} learning-rate scheduler's state in the checkpoint, "
                                f"{'a' if here else 'no'} scheduler here")
    return problems


def _fresh_optimizer_states(tree: Any, path: tuple[object, ...] = ()) -> set[tuple[object, ...]]:
    """Where ``tree`` holds an optimizer's ``state`` that is still empty (no step yet): a checkpoint's is not compared
    there, tensor by tensor (its parameters' shapes are, in the weights and ZeRO's partitions)."""
    if isinstance(tree, Mapping):
        found = {(*path, "state")} if isinstance(tree.get("state"), Mapping) and not tree["state"] else set()
        for key, value in tree.items():
            found |= _fresh_optimizer_states(value, (*path, key))
        return found
    if isinstance(tree, (list, tuple)):
        return {p for i, value in enumerate(tree) for p in _fresh_optimizer_states(value, (*path, i))}
    return set()


def _tensors(tree: Any, skip: set[tuple[object, ...]], path: tuple[object, ...] = ()) -> dict[tuple[object, ...], str]:
    """Each tensor's place in ``tree`` and its ``dtype[shape]``; the tensors of a checkpoint's skeleton are its
    metadata (a dtype name and a shape)."""
    if path in skip:
        return {}
    if isinstance(tree, Mapping):
        return {p: kind for key, value in tree.items() for p, kind in _tensors(value, skip, (*path, key)).items()}
    if isinstance(tree, (list, tuple)):
        return {p: kind for i, value in enumerate(tree) for p, kind in _tensors(value, skip, (*path, i)).items()}
    if isinstance(tree, torch.Tensor):
        return {path: f"{str(tree.dtype).removeprefix('torch.')}{list(tree.shape)}"}
    if hasattr(tree, "dtype") and hasattr(tree, "shape"):
        return {path: f"{tree.dtype}{list(tree.shape)}"}
    return {}


def _describe(path: tuple[object, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path)
