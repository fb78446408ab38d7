"""Hang detection from the job's own pace, and the odd rank out named from its stack.

Pure code (no IO, no clock): the plugin feeds it the job's step progress and asks
whether the job has stalled, and hands it the workers' stacks to name the rank
that hangs.

The model: the job has stalled when no step has completed for longer than
``max(floor_s, factor x the longest progress gap in the recent window)``. A gap is
the time between two progress records with a higher step, so it measures exactly
what the alarm measures (time without progress) at the resolution progress is
reported with. With ``factor`` >= the ratio between a job's slowest and fastest
steps, a healthy job never raises the alarm; a job with 1 s steps is flagged
after ``floor_s`` (20 s by default), one with 10 s steps after 100 s. Before the
round's first step the allowance is ``first_step_s`` (start-up, compilation);
inside a declared phase (``stead.phase("eval")``) it is ``phase_s``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import stead
from stead.plugin import StackSample

__all__ = ["Culprit", "StepClock", "Stall", "name_culprit", "where"]


@dataclasses.dataclass(frozen=True)
class Stall:
    """No progress for ``stalled_s`` (over ``threshold_s``, which ``why`` explains) since step ``step``."""

    round: int
    step: int | None
    stalled_s: float
    threshold_s: float
    why: str


class StepClock:
    """The progress of the running round and the recent gaps between progress records."""

    def __init__(self, *, floor_s: float, factor: float, first_step_s: float, phase_s: float,
                 window: int = 100) -> None:
        self.floor_s, self.factor = floor_s, factor
        self.first_step_s, self.phase_s = first_step_s, phase_s
        self.gaps: collections.deque[float] = collections.deque(maxlen=window)
        self.round = 0
        self.step: int | None = None
        self.phase = ""
        self.since = 0.0

    def start_round(self, round_: int, at: float) -> None:
        """The workers of ``round_`` run from ``at`` on (the gaps of earlier rounds still count)."""
        self.round, self.step, self.phase, self.since = round_, None, "", at

    def resume(self, step: int | None, gaps: list[float]) -> None:
        """The job went at this pace (recent gaps between steps) and the running round had reached ``step``
        (None: not known) when a master restart began this clock."""
        if step is not None:
            self.step = step
        self.gaps.extend(g for g in gaps if math.isfinite(g) and g >= 0)

    def observe(self, round_: int, step: int, at: float, phase: str = "") -> None:
        """A progress record: the slowest rank finished ``step`` (``phase``: one it declared)."""
        if round_ != self.round or at < self.since:
            return  # another round's, or older than what is known
        if self.step is not None and step > self.step and not self.phase and not phase:
            self.gaps.append(at - self.since)
        if self.step is None or step > self.step or phase != self.phase:
            self.since = at  # progress, or a phase began or ended: the clock starts again
        if self.step is None or step > self.step:
            self.step = step
        self.phase = phase

    def advance(self, round_: int, step: int, at: float) -> None:
        """The round reached ``step`` by ``at``, as seen other than by a progress record (the nodes' heartbeats while
        progress went unrecorded): the clock starts again from ``at``, and no gap is recorded, since the time since
        the last record is not one step's time (it would raise the threshold by the length of the stall)."""
        if round_ != self.round or at < self.since or (self.step is not None and step <= self.step):
            return
        self.step, self.since = step, at

    def threshold(self) -> tuple[float, str]:
        """How long without progress is a hang now, and why that long."""
        if self.phase:
            return self.phase_s, f"inside the declared phase {self.phase!r} (phase_s)"
        if self.step is None:
            return self.first_step_s, "before the round's first step (first_step_s)"
        if not self.gaps:
            return max(self.floor_s, self.first_step_s), "no step time known yet (first_step_s)"
        longest = max(self.gaps)
        if self.factor * longest <= self.floor_s:
            return self.floor_s, f"the floor (hang_floor_s); the longest recent gap is {longest:.2f} s"
        return self.factor * longest, f"{self.factor:g} x the longest recent gap between steps ({longest:.2f} s)"

    def stalled(self, now: float) -> Stall | None:
        """The stall if the round has gone without progress for longer than the threshold, else None."""
        threshold, why = self.threshold()
        waited = now - self.since
        if self.round == 0 or waited <= threshold * (1 + 1e-9):  # a gap of exactly the threshold is no stall
            return None
        return Stall(round=self.round, step=self.step, stalled_s=waited, threshold_s=threshold, why=why)


# -- stacks ---------------------------------------------------------------------------------

_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
#: frames from these are library frames, not the user's script
_LIBRARY = ("site-packages", "dist-packages", "/lib/python3", f"{Path(stead.__file__).parent}/", "<frozen ")


@dataclasses.dataclass(frozen=True)
class Culprit:
    """The rank that hangs (None when no rank stands out) and a one-line account of every rank."""

    rank: int | None
    summary: str


def _threads(stack: str) -> list[list[tuple[str, int, str]]]:
    threads: list[list[tuple[str, int, str]]] = []
    for line in stack.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif (match := _FRAME.match(line)) and threads:
            threads[-1].append((match["file"], int(match["line"]), match["func"]))
    return threads


def where(stack: str) -> str:
    """Where a worker's main thread is: "in backward() at train.py:41", or "at train.py:57 in <module>"."""
    threads = [t for t in _threads(stack) if t]
    if not threads:
        return "no stack"
    main = next((t for t in threads if any(func == "<module>" for _, _, func in t)), threads[0])
    user = next(((f, n, func) for f, n, func in main if not any(lib in f for lib in _LIBRARY)), None)
    innermost = main[0]
    if user is None:
        return f"in {innermost[2]}() at {_short(innermost[0])}:{innermost[1]}"
    place = f"at {_short(user[0])}:{user[1]}"
    if innermost == user:
        return f"{place} in {user[2]}"
    return f"in {innermost[2]}() {place}"


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _ranks(ranks: Iterable[int]) -> str:
    """1,2,3,5 -> "ranks 1-3,5"; one rank -> "rank 4"."""
    ordered = sorted(ranks)
    runs: list[str] = []
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        runs.append(f"{start}" if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return f"rank{'s' if len(ordered) > 1 else ''} {','.join(runs)}"


def name_culprit(samples: Sequence[StackSample]) -> Culprit:
    """Name the odd one out: the rank whose stack differs from the majority's, behind on steps.

    A rank waiting in a collective under DDP shows ``backward()`` (the all-reduce runs from
    autograd hooks in C++), so the hung rank is the one that is *not* where the others are,
    not the one in a collective-looking frame.
    """
    if not samples:
        return Culprit(None, "no stacks came back")
    groups: dict[str, list[StackSample]] = collections.defaultdict(list)
    for sample in samples:
        groups[where(sample.stack) if sample.stack else "no stack (stopped?)"].append(sample)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), min(s.rank for s in kv[1])))
    summary = "; ".join(f"{_ranks(s.rank for s in members)} {place}" for place, members in ordered)

    def behind(sample: StackSample) -> tuple[int, int]:
        return (sample.step if sample.step is not None else -1, sample.rank)

    if len(groups) > 1:
        minority = ordered[0][1]
        if len(minority) < len(samples) - len(minority) or len(groups) > 2:
            return Culprit(min(minority, key=behind).rank, summary)
    steps = {s.step for s in samples}
    if len(steps) > 1:  # every stack alike (or an even split): the rank behind on steps
        return Culprit(min(samples, key=behind).rank, summary)
    return Culprit(None, summary)
