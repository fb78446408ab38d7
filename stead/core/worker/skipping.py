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

Every rank warns and records the skip: a ``step_skipped`` note (its agent forwards it to the master) with the
samples its step held, per dataset read with stead's sampler, so that the sharding ledger records them as skipped,
not consumed. Each rank sends its own part rather than rank 0 gathering them: a collective inside an optimizer hook
could hang a rank whose hook is not installed, or a backend that needs its tensors on a device; a rank's part is
small (a few ranges: a step's samples are contiguous in its stream, see :mod:`stead.plugins.sharding.steps`).

What a step held comes from *sample sources* (:func:`watch_samples`; stead's sampler registers one): each says
which samples the training loop received since its last call. Every optimizer step is a boundary
(:func:`step_ended`, from a post-step hook installed with the first source): what came after the previous step is
the next step's.
A script without a source (its own data loading) has notes that say its samples are unknown (``samples`` null).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from stead.core.events import MAX_SAMPLE_RANGES, MAX_SAMPLE_SETS, StepSamples
from stead.core.worker import notes, progress
from stead.core.worker.numerics_settings import SKIP_STEPS_ENV

__all__ = ["SampleSource", "drop_gradients", "fit_samples", "install_skip_hook", "skip_steps", "skipped",
           "step_ended", "step_samples", "watch_samples"]

#: steps skipped so far in this process (one note and one warning each)
_done: set[int] = set()
#: what a sample source gives: the samples the training loop received since its last call, per dataset
SampleSource = Callable[[], Sequence[StepSamples]]


class _Window:
    """The samples of the optimizer step being taken: what the sources received since the last step ended."""

    def __init__(self) -> None:
        self.sources: list[SampleSource] = []
        self.samples: list[StepSamples] = []
        self.handle: Any = None


_window = _Window()


def watch_samples(source: SampleSource) -> None:
    """Name the samples of each step from ``source`` from now on (once per source; installs the boundary hook)."""
    if source not in _window.sources:
        _window.sources.append(source)
    if _window.handle is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            step_ended()

        _window.handle = register_optimizer_step_post_hook(after_step)


def step_ended() -> None:
    """An optimizer step is over: what the sources receive from now on is the next step's.

    A boundary after each step, not before: the hooks that run before a step (the skip hook, the guard's), in any
    order and any number, all see the same samples, and no step number is needed to tell one step from the next."""
    for source in _window.sources:
        source()  # what the step that ended held, known to it: dropped
    _window.samples = []


def step_samples() -> tuple[StepSamples, ...] | None:
    """The samples of the optimizer step being taken (call it before the step: from a pre-step hook), per dataset;
    None: unknown (no source watched)."""
    if not _window.sources:
        return None
    _window.samples = _merged([*_window.samples, *(part for source in _window.sources for part in source())])
    return tuple(_window.samples)


def _merged(parts: Sequence[StepSamples]) -> list[StepSamples]:
    by_name: dict[str, StepSamples] = {}
    for part in parts:
        if not part.count:
            continue
        known = by_name.get(part.dataset)
        if known is None:
            by_name[part.dataset] = part
            continue
        ranges = list(known.ranges)
        for piece in part.ranges:
            if ranges and ranges[-1][0] == piece[0] and ranges[-1][2] == piece[1]:
                ranges[-1] = (piece[0], ranges[-1][1], piece[2])
            else:
                ranges.append(piece)
        by_name[part.dataset] = StepSamples(dataset=part.dataset, count=known.count + part.count, ranges=tuple(ranges))
    return list(by_name.values())


def fit_samples(samples: Sequence[StepSamples], fits: Callable[[list[Any]], bool]) -> list[Any]:
    """``samples`` as a note writes them (``[[dataset, count, [[part, start, end], ...]], ...]``), within
    :data:`MAX_SAMPLE_SETS` datasets of :data:`MAX_SAMPLE_RANGES` ranges each, and shortened until ``fits`` (the
    note's line is short enough): the last ranges named go first (their samples stay counted), then whole datasets."""
    named = [(s.dataset, s.count, [list(r) for r in s.ranges[:MAX_SAMPLE_RANGES]]) for s in samples[:MAX_SAMPLE_SETS]]
    while named and not fits([list(entry) for entry in named]):
        ranges = max((entry[2] for entry in named), key=len)
        if ranges:
            ranges.pop()
        else:
            named.pop()
    return [list(entry) for entry in named]


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
    """Say once that ``step`` was skipped here: a warning, and a note to the master naming the step's samples."""
    if step in _done:
        return
    _done.add(step)
    samples = step_samples()
    warnings.warn(f"stead.numerics: step {step} skipped on rank {rank} ({cause}): its gradients were dropped "
                  "before the optimizer step, its batch is recorded as skipped", stacklevel=3)
    named = None if samples is None else fit_samples(samples, lambda out: notes.line_bytes(
        "step_skipped", step=step, rank=rank, samples=out) <= notes.MAX_LINE_BYTES)
    notes.write("step_skipped", step=step, rank=rank, samples=named)


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
