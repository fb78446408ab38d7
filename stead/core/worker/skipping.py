"""Skipping a step on every rank: the steps whose batch caused a numerical fault, dropped after the rollback.

The master decides which steps a job skips (``numerics.on_nan=skip``, ``numerics.loss_spike=skip``: the step of a
NaN gradient or a loss spike, known from the failure) and every agent gives them to its round's workers in
:data:`SKIP_STEPS_ENV`, so that every rank skips the same steps: the decision is the master's, never a rank's own.
At a step to skip an optimizer pre-step hook sets the ``.grad`` of every parameter the optimizer steps to None:
torch's optimizers pass over a parameter without a gradient (``if p.grad is not None`` in SGD, Adam, AdamW,
RMSprop, Adagrad, ...: no update, no momentum, no weight decay, no per-parameter step count), as AMP's
GradScaler skips a step whose gradients overflowed. The step number still advances and the batch counts as
consumed (and skipped). Under DDP the step's all-reduce has run already (every rank took part); nothing of it is
applied. A learning-rate scheduler the script steps still steps.

Global rank 0 records the skip (a ``step_skipped`` note the agent forwards to the master); every rank warns.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

from stead.core.worker import notes, progress
from stead.core.worker.numerics_settings import SKIP_STEPS_ENV

__all__ = ["drop_gradients", "install_skip_hook", "skip_steps", "skipped"]

#: steps skipped so far in this process (one note and one warning each)
_done: set[int] = set()


def skip_steps() -> frozenset[int]:
    """The steps this round skips (:data:`SKIP_STEPS_ENV`); ValueError saying what is wrong with a bad value."""
    return _parse(os.environ.get(SKIP_STEPS_ENV, ""))


@functools.lru_cache(maxsize=4)
def _parse(text: str) -> frozenset[int]:
    try:
        steps = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{SKIP_STEPS_ENV}={text[:200]!r} is not a comma-separated list of step numbers; the agent "
                         "sets it from the master's decisions: unset it unless a test asks for skipped steps") from None
    if any(step < 0 for step in steps):
        raise ValueError(f"{SKIP_STEPS_ENV}={text[:200]!r} holds a negative step; steps count from 0")
    return steps


def drop_gradients(optimizer: Any) -> None:
    """Every parameter ``optimizer`` steps loses its gradient: the step applies nothing to it."""
    for group in getattr(optimizer, "param_groups", ()):
        for param in group.get("params", ()):
            param.grad = None


def skipped(step: int, *, rank: int, cause: str = "the master's decision") -> None:
    """Say once that ``step`` was skipped here (a warning; a note to the master from global rank 0)."""
    if step in _done:
        return
    _done.add(step)
    warnings.warn(f"stead.numerics: step {step} skipped on rank {rank} ({cause}): its gradients were dropped "
                  "before the optimizer step, its batch counts as consumed", stacklevel=3)
    if rank == 0:
        notes.write("step_skipped", step=step, rank=rank)


class _StepCounter:
    def __init__(self) -> None:
        self.taken = 0
        self.handle: Any = None


_counter = _StepCounter()


def install_skip_hook() -> None:
    """Install (once) the optimizer pre-step hook that skips :func:`skip_steps` for a script without
    ``stead.numerics.guard`` (the guard skips them itself, before its own checks)."""
    if _counter.handle is not None:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        tracked = progress.training_step()
        step = _counter.taken if tracked is None else tracked
        _counter.taken += 1
        if step in skip_steps():
            drop_gradients(optimizer)
            skipped(step, rank=int(os.environ.get("RANK", "0")))

    _counter.handle = register_optimizer_step_pre_hook(before_step)
