"""A loss spike caught in the step it happens: ``stead.report_loss(loss)``, off unless ``numerics.loss_spike`` asks.

A script reports its loss each step (a tensor or a number; reported several times before one optimizer step, as
with gradient accumulation, the step's loss is their mean). At the step's optimizer pre-step hook the loss is
read (one device-to-host copy: the guard pays the same one; free where the loop calls ``loss.item()`` anyway) and
compared with the recent ones: a spike is a loss above the median of the last ``loss_spike_window`` losses by more
than ``loss_spike_threshold`` robust standard deviations (1.4826 x their median absolute deviation, at least 1% of
the median so that a run of near-equal losses does not make every wiggle a spike), judged once
``loss_spike_warmup`` losses were seen. A non-finite loss is always one. Each rank judges its own loss: no
collective, nothing shared.

``record``: the spike becomes a ``loss_spike`` note (:mod:`.notes`) the master records as an event, with a warning.
``skip``: the rank raises :class:`LossSpikeError` before the optimizer applies the step; the diagnosis rolls the job
back to the last committed checkpoint and every rank skips the step's batch (:mod:`.skipping`), as for a NaN
gradient with ``numerics.on_nan=skip``. Without a stead agent (plain python or torchrun) nothing can roll back:
a spike is a warning, whatever the mode.

The detector's memory is the process's: after a rollback the restarted workers warm up again.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import socket
import statistics
import warnings
from typing import Any

from stead.core.config import load_settings
from stead.core.worker import notes, progress
from stead.core.worker.numerics_settings import NAMESPACE, NumericsSettings
from stead.core.worker.skipping import install_skip_hook, skip_steps

__all__ = ["LossSpikeError", "Spike", "SpikeDetector", "report_loss"]

#: a median absolute deviation is taken as at least this share of the median's size (see the module doc)
_RELATIVE_FLOOR = 0.01
#: the robust scale of a median absolute deviation: a normal distribution's standard deviation is 1.4826 MADs
_MAD_TO_SIGMA = 1.4826


class LossSpikeError(RuntimeError):
    """This rank's loss spiked with ``numerics.loss_spike=skip``: the step is not applied; stead rolls back and
    skips its batch."""


@dataclasses.dataclass(frozen=True)
class Spike:
    loss: float
    #: the median of the window it was judged against (nan when there was none yet)
    median: float
    #: how many robust standard deviations above the median (inf for a non-finite loss)
    score: float


class SpikeDetector:
    """A robust z-score over a rolling window of recent losses (module doc). Pure: no IO, no clock."""

    def __init__(self, *, window: int, warmup: int, threshold: float) -> None:
        if not 1 <= warmup <= window:
            raise ValueError(f"warmup={warmup} must be between 1 and window={window}")
        self.threshold = threshold
        self.warmup = warmup
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, loss: float, *, keep_spike: bool = True) -> Spike | None:
        """Judge ``loss`` and add it to the window (a spike only with ``keep_spike``; never a non-finite one)."""
        median = statistics.median(self.recent) if self.recent else math.nan
        if not math.isfinite(loss):
            return Spike(loss, median, math.inf)
        spike = None
        if len(self.recent) >= self.warmup:
            deviation = statistics.median(abs(v - median) for v in self.recent)
            scale = max(_MAD_TO_SIGMA * deviation, _RELATIVE_FLOOR * abs(median), 1e-12)
            score = (loss - median) / scale
            if score > self.threshold:
                spike = Spike(loss, median, score)
        if spike is None or keep_spike:
            self.recent.append(loss)
        return spike


class _Reporter:
    """The process's loss reports (one per process: report_loss is a module function)."""

    def __init__(self) -> None:
        self.settings: NumericsSettings | None = None
        self.detector: SpikeDetector | None = None
        self.pending: Any = None  # the step's reported losses, summed (a tensor stays on its device until the step)
        self.count = 0
        self.taken = 0  # optimizer steps seen: the step number where stead does not track them
        self.handle: Any = None

    def configure(self) -> NumericsSettings:
        if self.settings is None:
            self.settings = settings = load_settings(NumericsSettings, NAMESPACE)
            if settings.loss_spike != "off":
                self.detector = SpikeDetector(window=settings.loss_spike_window, warmup=settings.loss_spike_warmup,
                                              threshold=settings.loss_spike_threshold)
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                self.handle = register_optimizer_step_pre_hook(self.before_step)
                install_skip_hook()
        return self.settings

    def add(self, loss: Any) -> None:
        value = loss.detach() if hasattr(loss, "detach") else float(loss)
        self.pending = value if self.pending is None else self.pending + value
        self.count += 1

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        tracked = progress.training_step()
        step = self.taken if tracked is None else tracked
        self.taken += 1
        pending, count, self.pending, self.count = self.pending, self.count, None, 0
        if pending is None or self.detector is None or self.settings is None or step in skip_steps():
            return  # nothing reported since the last step (a second optimizer), or a step skipped anyway
        loss = float(pending) / count
        mode = self.settings.loss_spike
        under_stead = bool(os.environ.get(progress.PROGRESS_ENV))
        skipping = mode == "skip" and under_stead
        spike = self.detector.observe(loss, keep_spike=not skipping)
        if spike is None:
            return
        rank, host = int(os.environ.get("RANK", "0")), socket.gethostname()
        what = (f"loss spike on rank {rank} (host {host}) at step {step}: loss {spike.loss:.6g}, "
                f"{spike.score:.1f} robust standard deviations above the median {spike.median:.6g} of the last "
                f"{len(self.detector.recent)} losses (numerics.loss_spike_threshold="
                f"{self.settings.loss_spike_threshold:g})")
        notes.write("loss_spike", step=step, rank=rank, loss=spike.loss, median=spike.median, score=spike.score,
                    action="skip" if skipping else "record")
        if skipping:
            raise LossSpikeError(f"{what}; the step was not applied. stead restores the last committed checkpoint "
                                 "and skips this step's batch on every rank (numerics.loss_spike=record only "
                                 "records spikes; raise numerics.loss_spike_threshold if this was no spike)")
        if mode == "skip":
            what += "; not skipped: without a stead agent nothing rolls back (numerics.loss_spike=skip)"
        warnings.warn(f"stead.numerics: {what}", stacklevel=3)


_reporter = _Reporter()


def report_loss(loss: Any) -> None:
    """Report this step's loss (a tensor or a number) to the loss-spike detector (module doc); call it before
    ``optimizer.step()``. A no-op while ``numerics.loss_spike`` is off (the default)."""
    if _reporter.configure().loss_spike == "off":
        return
    _reporter.add(loss)
