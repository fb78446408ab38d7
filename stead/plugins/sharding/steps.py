"""Which samples each training step held: a stream's positions at step boundaries, right under prefetching.

A step that is skipped (:mod:`stead.core.worker.skipping`) names its samples so that the sharding ledger records
them as skipped, not consumed. The sampler alone cannot say which samples a step trained on: ``reader.consumed``
counts what it handed out, and a ``DataLoader`` takes ahead of the training loop (with ``num_workers=N`` the
main process pulls ``prefetch_factor * N`` batches of indices ahead; the workers only ever see index lists).

What is right under any prefetch: the main process is the only one that iterates the sampler, in
``DataLoader``'s ``_next_index()``, and an iterator in order (``in_order=True``, the default) returns batches in
the order their indices were pulled. So stead wraps three methods of torch's ``_BaseDataLoaderIter`` (once, when a
stead sampler is first made; every DataLoader iterator inherits them): ``_next_index`` notes the stream positions
each pull moved (``[before, after)`` of each stead sampler it drew from, usually one), in a queue per iterator;
``__next__`` pops the oldest when it hands a batch to the loop, and those positions are then *received*;
``_reset`` (a new epoch, persistent workers) empties the queue, as torch drops the batches it had in flight.
A step's samples are the positions received since the previous optimizer step (:meth:`StepTracker.take`, called
by the step hook); the tracker maps positions to slots through the ranges the stream read, in order. Several
batches per step (gradient accumulation) all count; a batch abandoned in flight counts for no step.

Where that does not hold, the samples are counted but not named: an iterator with ``in_order=False`` (batches come
in any order), positions older than what the tracker keeps (:data:`MAX_LOG_RANGES` ranges). A sampler iterated
without a DataLoader (``for i in sampler``) counts what it handed out: the loop took it. A batch sampler that
buffers ahead of its batches (bucketing by length) shifts the positions by what it holds; a script that takes the
next batch before stepping (its own prefetch to the GPU) likewise.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import structlog

from stead.core.events import StepSamples
from stead.plugins.sharding.intervals import Range

__all__ = ["MAX_LOG_RANGES", "StepTracker", "live_trackers", "track_loaders"]

log = structlog.get_logger("stead.data")

#: the ranges of its stream a tracker keeps at most (the oldest go first; their positions are then counted, unnamed)
MAX_LOG_RANGES = 4096
_ITER_QUEUE = "_stead_batches"


class StepTracker:
    """One stream's positions (``position()``: samples handed out) -> slots, and what the loop received."""

    def __init__(self, dataset: str, position: Callable[[], int]) -> None:
        self.dataset = dataset
        self.position = position
        #: (stream position where it starts, range) of every range handed out, oldest first
        self._log: collections.deque[tuple[int, Range]] = collections.deque()
        #: position intervals received since the last take, and samples received whose positions are unknown
        self._received: list[tuple[int, int]] = []
        self._unnamed = 0
        #: a DataLoader pulls from this stream and says what the loop received; else everything handed out is
        self.loader = False
        self._received_to = 0
        self._taken_to = 0

    def handed(self, at: int, piece: Range) -> None:
        """The stream's range ``piece`` starts at position ``at`` (the reader pops it)."""
        self._log.append((at, piece))
        if len(self._log) > MAX_LOG_RANGES:
            self._log.popleft()

    def received(self, start: int, end: int, *, named: bool = True) -> None:
        """The loop received the samples at positions ``[start, end)`` (``named``: in stream order)."""
        self.loader = True
        if end <= start:
            return
        self._received_to = max(self._received_to, end)
        if not named:
            self._unnamed += end - start
        elif self._received and self._received[-1][1] == start:
            self._received[-1] = (self._received[-1][0], end)
        else:
            self._received.append((start, end))

    def take(self) -> StepSamples:
        """The samples received since the last take (one step's), as slot ranges of the ledger."""
        if self.loader:
            spans, self._received = self._received, []
        else:
            now = self.position()
            spans = [(self._taken_to, now)] if now > self._taken_to else []
            self._taken_to = max(self._taken_to, now)
        unnamed, self._unnamed = self._unnamed, 0
        ranges = [piece for start, end in spans for piece in self._slots(start, end)]
        count = unnamed + sum(end - start for start, end in spans)
        if spans:
            self._forget_before(spans[-1][1])
        return StepSamples(dataset=self.dataset, count=count, ranges=tuple(ranges))

    def received_to(self) -> int:
        """The stream position up to which the training loop has received its samples: what a DataLoader handed it,
        not what it pulled ahead (without a DataLoader: every sample handed out)."""
        return self._received_to if self.loader else self.position()

    def part_at(self, position: int) -> int | None:
        """The part (a dataset's epoch) of the sample at stream ``position``; None: not known (not handed out yet,
        or forgotten)."""
        entries = list(self._log)
        for index, (at, (part, first, last)) in enumerate(entries):
            end = at + last - first
            if index + 1 < len(entries):
                end = min(end, entries[index + 1][0])
            if at <= position < end:
                return part
        return None

    def _slots(self, start: int, end: int) -> list[Range]:
        out: list[Range] = []
        entries = list(self._log)
        for index, (at, (part, first, last)) in enumerate(entries):
            length = last - first
            if index + 1 < len(entries):  # a range cut short (leftovers given back) ends where the next starts
                length = min(length, entries[index + 1][0] - at)
            lo, hi = max(start, at), min(end, at + length)
            if lo < hi:
                piece = (part, first + lo - at, first + hi - at)
                if out and out[-1][0] == part and out[-1][2] == piece[1]:
                    out[-1] = (part, out[-1][1], piece[2])
                else:
                    out.append(piece)
        return out

    def _forget_before(self, position: int) -> None:
        """Positions before ``position`` are never received again (batches come in order): drop their ranges."""
        while len(self._log) > 1 and self._log[1][0] <= position:
            self._log.popleft()


_lock = threading.Lock()
_trackers: list[StepTracker] = []


def live_trackers() -> list[StepTracker]:
    with _lock:
        return list(_trackers)


def add_tracker(tracker: StepTracker) -> None:
    with _lock:
        _trackers.append(tracker)


def remove_tracker(tracker: StepTracker) -> None:
    with _lock:
        if tracker in _trackers:
            _trackers.remove(tracker)


def step_samples() -> list[StepSamples]:
    """Every live stream's samples received since the last step (the sample source of the skip hook)."""
    return [tracker.take() for tracker in live_trackers()]


class _Installed:
    done = False


def track_loaders() -> None:
    """Wrap torch's DataLoader iterators so that trackers learn what the loop received (module doc); once."""
    with _lock:
        if _Installed.done:
            return
        _Installed.done = True
    from torch.utils.data import dataloader

    base: Any = getattr(dataloader, "_BaseDataLoaderIter", None)
    if not all(hasattr(base, name) for name in ("_next_index", "__next__", "_reset")):
        # another torch than those this was written for (2.x): a step's samples are what the sampler handed out
        log.warning("shard_steps_untracked", torch=getattr(dataloader, "__name__", "?"),
                    hint="a skipped step names the samples the DataLoader pulled, prefetched ones included")
        return
    next_index, next_batch, reset = base._next_index, base.__next__, base._reset

    def _next_index(self: Any) -> Any:
        trackers = live_trackers()
        before = [t.position() for t in trackers]
        index = next_index(self)
        moved = [(t, was, t.position()) for t, was in zip(trackers, before, strict=True) if t.position() != was]
        for tracker, _, _ in moved:
            tracker.loader = True
        queue = self.__dict__.setdefault(_ITER_QUEUE, collections.deque())
        queue.append(moved)
        return index

    def __next__(self: Any) -> Any:
        batch = next_batch(self)
        queue = self.__dict__.get(_ITER_QUEUE)
        if queue:
            named = bool(getattr(self, "_in_order", True))
            for tracker, start, end in queue.popleft():
                tracker.received(start, end, named=named)
        return batch

    def _reset(self: Any, *args: Any, **kwargs: Any) -> None:
        self.__dict__[_ITER_QUEUE] = collections.deque()
        reset(self, *args, **kwargs)

    base._next_index, base.__next__, base._reset = _next_index, __next__, _reset
