"""Each node's own pace per step, for the master's straggler detector.

With DDP every rank's step takes as long as the slowest rank's step: the fast
ranks wait for its gradients inside backward(). So the wall time of a step says
nothing about who is slow; the time a rank spends *outside* backward() does
(data loading, forward, optimizer, the script's own code). The workers' bootstrap
clocks backward() (:func:`~stead.core.worker.progress.install_backward_clock`);
here the agent turns consecutive progress reads into "own seconds per step" per
local rank, and the node's figure is its slowest rank's median over recent steps.
Time in a declared phase (evaluation, a checkpoint) is not a step's and is skipped.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping

from stead.core.worker.progress import StepProgress

__all__ = ["StepPace"]

#: recent samples kept per rank: the median over them rides out a slow step now and then
WINDOW = 16
#: samples every rank needs before the node reports a figure
MIN_SAMPLES = 3


class StepPace:
    def __init__(self, *, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self._window = window
        self._min_samples = min_samples
        self._last: dict[int, StepProgress] = {}
        self._samples: dict[int, collections.deque[float]] = {}

    def observe(self, progress: Mapping[int, StepProgress]) -> None:
        """Take one read of the progress files (local rank -> last report)."""
        for rank, now in progress.items():
            before = self._last.get(rank)
            self._last[rank] = now
            if (before is None or before.pid != now.pid or now.step <= before.step or before.phase or now.phase
                    or now.time <= before.time):
                continue  # a new worker, no new step, or a phase: nothing to measure
            own = (now.time - before.time) - (now.backward_s - before.backward_s)
            samples = self._samples.setdefault(rank, collections.deque(maxlen=self._window))
            samples.append(max(0.0, own) / (now.step - before.step))

    def compute_s(self, ranks: int) -> float | None:
        """The slowest of ``ranks`` local ranks' median own seconds per step; None until each has enough samples."""
        medians = [statistics.median(s) for s in self._samples.values() if len(s) >= self._min_samples]
        if len(medians) < ranks or not medians:
            return None
        return max(medians)

    def reset(self) -> None:
        """Forget everything (a new round's workers)."""
        self._last.clear()
        self._samples.clear()
