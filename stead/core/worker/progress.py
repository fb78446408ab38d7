"""The worker's side of step progress: what a training script's ``report_step`` writes to a page its agent reads.

No RPC, no syscall per step; the agent's reader is :mod:`stead.core.agent.progress`.

The agent creates one small file per local rank in a temporary directory it owns and
passes its path in ``STEAD_PROGRESS_FILE``; the worker maps it and ``report_step``
writes the step, the ``time.monotonic()`` clock (system-wide on Linux, so the agent can
compare it with its own) and the pid. A sequence counter around the write (odd while
writing) lets the reader discard a torn read. Without the variable (a script run by
plain python or torchrun) ``report_step`` does nothing.

Record layout, little endian, at offset 0: ``seq u64 | step i64 | time f64 | pid i64 |
phase 24 bytes | backward f64`` (step -1: none yet; phase: the long phase the worker declared
with :func:`phase`, UTF-8, zero-padded, empty when none; backward: seconds the worker has
spent inside ``torch.autograd.backward`` so far, see :func:`install_backward_clock`).

A worker started by the agent's bootstrap also answers a stack-dump signal
(:data:`STACKS_SIGNAL`): faulthandler writes every thread's Python stack to
``<path>.stacks.<pid>``, from C, so even a worker stuck in a collective answers.

On its first report a worker also writes, next to the file (``<path>.modules``), the
installed top-level packages it has imported; the agent has its zygote import them
too, so the next restart does not pay for them either.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["FILE_BYTES", "LAST_STEP_ENV", "PROGRESS_ENV", "RECORD_BODY", "RECORD_SEQ", "STACKS_SIGNAL", "StepProgress",
           "imported_packages", "install_backward_clock", "install_step_hook", "install_stack_dumps", "paused", "phase",
           "report_step", "resume_steps_at", "stacks_path"]

PROGRESS_ENV = "STEAD_PROGRESS_FILE"
#: the last step this node's workers reported before the round began (-1: none), for a script that resumes from
#: its own checkpoint without saying where (see :func:`install_step_hook`)
LAST_STEP_ENV = "STEAD_LAST_STEP"

#: the record's layout (see above): the sequence counter, then the body
RECORD_SEQ = struct.Struct("<Q")
RECORD_BODY = struct.Struct("<qdq24sd")
#: the signal that makes a bootstrapped worker dump its stacks (a real-time one: no script uses it for itself)
STACKS_SIGNAL = signal.SIGRTMIN + 4
FILE_BYTES = 64


class StepProgress(NamedTuple):
    """The last step a worker reported, when (``time.monotonic()`` seconds) and by which pid."""

    step: int
    time: float
    pid: int
    #: the long phase the worker is in; "" when none
    phase: str = ""
    #: seconds spent inside backward() so far (where DDP waits for the other ranks' gradients)
    backward_s: float = 0.0


# -- worker side ----------------------------------------------------------------------------


class _Writer:
    def __init__(self, view: mmap.mmap) -> None:
        self.view = view
        self.seq = RECORD_SEQ.unpack_from(view, 0)[0] & ~1  # carry on after a previous incarnation
        self.step = -1
        self.phases: list[bytes] = []
        self.pid = os.getpid()
        self.lock = threading.Lock()


class _BackwardClock:
    """Seconds this worker spent inside backward() (see :func:`install_backward_clock`)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.depth = 0  # backward() called from inside backward() (a hook, a double backward) counts once


_backward = _BackwardClock()


_writer: _Writer | None = None
_unusable: str | None = None  # a configured path that could not be mapped: not retried on every step


def _open_writer() -> _Writer | None:
    global _writer, _unusable
    path = os.environ.get(PROGRESS_ENV)
    if not path or path == _unusable:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            _writer = _Writer(mmap.mmap(fd, FILE_BYTES))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        _unusable = path  # progress is best effort: the agent removed the file or never made it
    return _writer


def _forget_after_fork() -> None:
    global _writer, _unusable
    _writer, _unusable = None, None


os.register_at_fork(after_in_child=_forget_after_fork)


def imported_packages() -> list[str]:
    """Top-level packages this process imported from site-packages (third-party libraries, not user code), and the
    submodules it imported of those that import their submodules only when first used (Hugging Face's
    ``_LazyModule``: ``import transformers`` alone leaves out the ``Trainer`` and the models, most of its cost)."""
    import sys
    import types

    installed = {name: module for name, module in list(sys.modules.items())
                 if not name.startswith("_") and _installed(getattr(module, "__file__", None) or "")}
    lazy = {name for name, module in installed.items() if "." not in name and type(module) is not types.ModuleType}
    return sorted(name for name in installed if "." not in name or name.partition(".")[0] in lazy)


def _installed(path: str) -> bool:
    return "site-packages" in path or "dist-packages" in path


def _write_modules(path: str) -> None:
    try:
        tmp = f"{path}.modules.{os.getpid()}"
        Path(tmp).write_text("\n".join(imported_packages()))
        os.replace(tmp, f"{path}.modules")
    except OSError:
        pass  # a hint for the agent, never worth failing a training step


class _AutoStep:
    """Automatic step detection's state (see :func:`install_step_hook`)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # optimizer id -> steps taken since ``base``
        self.count = 0  # the busiest optimizer's steps since ``base``
        self.base = 0  # the step the count starts at
        self.explicit = False  # the script reports steps itself
        self.paused = 0
        self.hooked = False  # the automatic detection's hooks are installed (in a stead worker)


_auto = _AutoStep()


def report_step(step: int) -> None:
    """Tell the agent this worker finished ``step``; a no-op outside a stead agent.

    A script that calls it takes over from the automatic step detection for good.
    """
    _auto.explicit = True
    _write(step)


def install_step_hook() -> Any:
    """Count optimizer steps as training steps, for a script that never calls :func:`report_step`.

    Installed in every worker by the agent's bootstrap (``STEAD_AUTO_STEP=0`` turns it
    off): a global post-hook on ``torch.optim.Optimizer.step`` reports step ``base + n``
    after the n-th step of the busiest optimizer. A step taken while :func:`paused` (a
    checkpoint building a fresh optimizer's state) is not counted. Returns the hook's
    handle (``.remove()`` takes it off), or None when torch is not imported in this
    process (nothing to hook: the script does not train with torch).

    ``base`` is 0, or where a stead checkpoint restored the script (:func:`resume_steps_at`),
    or where the script resumed from a checkpoint of its own: an optimizer whose state is not
    empty before its first step in this process was loaded (a fresh one has none until it
    steps). Its state's ``step`` (Adam, AdamW, RMSprop, Adagrad, ...) says how many steps it
    had taken; without one (SGD with momentum) the steps go on from the last one this node
    reported before the restart (:data:`LAST_STEP_ENV`): an older checkpoint's steps done
    again are then not seen (the ledger says so). Counted from 0 instead, a restarted script
    that checkpoints itself would look as if it had lost everything it trained.
    """
    import sys

    optimizer = sys.modules.get("torch.optim.optimizer")
    if optimizer is None:
        return None

    def before_step(opt: object, args: object, kwargs: object) -> None:
        auto = _auto
        if not (auto.explicit or auto.paused or auto.counts or auto.base):  # the first step: did the script resume?
            auto.base = _resumed_at(opt)

    def on_step(opt: object, args: object, kwargs: object) -> None:
        auto = _auto
        if auto.explicit or auto.paused:
            return
        auto.counts[id(opt)] = taken = auto.counts.get(id(opt), 0) + 1
        if taken > auto.count:
            auto.count = taken
            _write(auto.base + taken - 1)

    _auto.hooked = True
    return _Hooks(optimizer.register_optimizer_step_pre_hook(before_step),
                  optimizer.register_optimizer_step_post_hook(on_step))


def training_step() -> int | None:
    """The step being trained (the next one reported), or None where steps are not tracked (no stead agent)."""
    if _auto.explicit:
        return _writer.step + 1 if _writer is not None else None
    return _auto.base + _auto.count if _auto.hooked else None


class _Hooks:
    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _resumed_at(opt: object) -> int:
    """The step a script resumed at, judged from ``opt`` before its first step in this process: 0 for a fresh
    optimizer (its state is empty until it steps)."""
    state = getattr(opt, "state", None)
    if not isinstance(state, Mapping) or not any(isinstance(e, Mapping) and e for e in state.values()):
        return 0
    steps: list[int] = []
    for entry in state.values():
        value = entry.get("step") if isinstance(entry, Mapping) else None
        if value is not None:
            with contextlib.suppress(TypeError, ValueError, RuntimeError):
                steps.append(int(value.item() if hasattr(value, "item") else value))
    if steps:
        return max(steps)  # steps taken so far: the next one's index
    try:  # loaded, but it does not count its steps (SGD with momentum): go on from this node's last step
        last = int(os.environ.get(LAST_STEP_ENV, "-1"))
    except ValueError:
        last = -1
    return last + 1 if last >= 0 else 0


def install_backward_clock() -> bool:
    """Time what ``torch.autograd.backward`` takes, for the straggler detector (the agent's bootstrap).

    With DDP a rank's step takes as long as the slowest rank's: the others wait for its
    gradients inside backward(), where DDP's all-reduces run. The time a rank spends outside
    backward() (data, forward, optimizer, its own code) is its own pace; the agent compares
    it across nodes. ``Tensor.backward`` calls ``torch.autograd.backward``, so wrapping that
    one function covers both. False when torch is not imported (nothing to time).
    """
    import sys

    autograd: Any = sys.modules.get("torch.autograd")
    if autograd is None or getattr(autograd.backward, "_stead_clock", False):
        return autograd is not None
    inner = autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        clock = _backward
        if clock.depth:
            return inner(*args, **kwargs)
        clock.depth += 1
        started = time.monotonic()
        try:
            return inner(*args, **kwargs)
        finally:
            clock.total += time.monotonic() - started
            clock.depth -= 1

    backward._stead_clock = True  # type: ignore[attr-defined]
    backward.__wrapped__ = inner  # type: ignore[attr-defined]
    backward.__doc__ = inner.__doc__
    autograd.backward = backward
    return True


def stacks_path(progress_path: str | Path, pid: int) -> Path:
    """Where the worker ``pid`` with this progress file writes its stacks when signalled."""
    return Path(f"{progress_path}.stacks.{pid}")


_stacks_file: Any = None


def install_stack_dumps() -> bool:
    """Make :data:`STACKS_SIGNAL` dump every thread's stack to :func:`stacks_path` (the agent's bootstrap).

    The file's existence tells the agent the worker answers the signal (whose default
    action would kill it). False when there is no progress file (not under an agent).
    """
    global _stacks_file
    import faulthandler

    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return False
    try:
        _stacks_file = open(stacks_path(path, os.getpid()), "w")  # noqa: SIM115 (kept open for the handler)
    except OSError:
        return False
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True, chain=False)
    return True


def resume_steps_at(step: int) -> None:
    """The next automatically detected step is ``step`` (a restored checkpoint's step + 1)."""
    _auto.counts.clear()
    _auto.count, _auto.base = 0, step


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Optimizer steps taken inside are not training steps (e.g. one that only builds an optimizer's state)."""
    _auto.paused += 1
    try:
        yield
    finally:
        _auto.paused -= 1


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Declare a long phase without training steps (evaluation, a checkpoint written to disk).

    Inside it the hang detector allows the phase's own (long) time instead of expecting
    the next step within a few step times::

        with stead.phase("eval"):
            evaluate(model)

    A no-op outside a stead agent. Phases nest; the innermost one's name is reported.
    """
    label = name.encode()[:24]
    writer = _writer or _open_writer()
    if writer is None:
        yield
        return
    with writer.lock:
        writer.phases.append(label)
    _write(writer.step)
    try:
        yield
    finally:
        with writer.lock:
            writer.phases.pop()
        _write(writer.step)


def _write(step: int) -> None:
    writer = _writer
    if writer is None:
        writer = _open_writer()
        if writer is None:
            return
        _write_modules(os.environ[PROGRESS_ENV])
    with writer.lock:
        seq = writer.seq + 1
        writer.step = step
        RECORD_SEQ.pack_into(writer.view, 0, seq)
        RECORD_BODY.pack_into(writer.view, 8, step, time.monotonic(), writer.pid,
                        writer.phases[-1] if writer.phases else b"", _backward.total)
        writer.seq = seq + 1
        RECORD_SEQ.pack_into(writer.view, 0, seq + 1)
