"""Which samples each optimizer step trained on: the stream's positions the loop received, under prefetching."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from stead.core.events import StepSamples
from stead.core.worker import skipping
from stead.data import ShardedSampler
from stead.plugins.sharding.order import SampleOrder
from stead.plugins.sharding.steps import StepTracker

N = 60
SHARD = 7


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A sampler without stead (its in-process ledger), and the skip hook's window empty (its hook kept)."""
    for name in ("STEAD_MASTER_ADDR", "STEAD_ROUND", "RANK", "WORLD_SIZE", "STEAD_PROGRESS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("sources", []), ("samples", [])):
        monkeypatch.setattr(skipping._window, name, value)
    yield


def _ids(samples: StepSamples, order: SampleOrder) -> list[int]:
    """The sample ids the step's slot ranges name (the sampler maps slots to ids through the epoch's order)."""
    assert samples.named == samples.count, samples
    return [i for part, start, end in samples.ranges for i in order.samples(part, start, end)]


class _Steps:
    """A loop that steps an optimizer every ``every`` batches and keeps each step's batches and named samples."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(1, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.trained: list[list[int]] = []  # the ids of the batches each step trained on
        self.named: list[tuple[StepSamples, ...] | None] = []  # what a pre-step hook is told at each step
        self.opt.register_step_pre_hook(lambda opt, args, kwargs: self.named.append(skipping.step_samples()))

    def run(self, loader: DataLoader[Any], *, every: int, steps: int) -> None:
        held: list[int] = []
        for index, batch in enumerate(loader, 1):
            held += batch.flatten().tolist()
            self.model(batch.float().reshape(-1, 1)).sum().backward()
            if index % every == 0:
                self.opt.step()  # the post-step hook marks the boundary: what comes after is the next step's
                self.opt.zero_grad()
                self.trained.append(held)
                held = []
                if len(self.trained) == steps:
                    break


@pytest.mark.parametrize(("workers", "every"), [(0, 1), (2, 1), (2, 3)],
                         ids=["in-process", "2 workers prefetching", "2 workers, 3 batches a step"])
def test_each_step_names_the_samples_the_loop_received_not_those_prefetched(local: None, workers: int,
                                                                              every: int) -> None:
    sampler = ShardedSampler("steps", size=N, shard_size=SHARD, seed=2, epochs=1)
    order = SampleOrder(size=N, shard_size=SHARD, seed=2, shuffle=True)
    loader: DataLoader[Any] = DataLoader(list(range(N)), batch_size=4, sampler=sampler,  # type: ignore[arg-type]
                                         num_workers=workers, prefetch_factor=2 if workers else None)
    loop = _Steps()
    try:
        loop.run(loader, every=every, steps=4)
        if workers:
            assert sampler.consumed > 4 * every * 4  # the DataLoader pulled batches ahead of the loop
    finally:
        sampler.close()
        del loader
    assert len(loop.named) == 4
    for trained, named in zip(loop.trained, loop.named, strict=True):
        assert named is not None
        (samples,) = named
        assert samples.dataset == "steps" and samples.count == 4 * every
        assert _ids(samples, order) == trained  # the step's samples, in the order the loop got them


def test_a_sampler_iterated_without_a_dataloader_counts_what_it_handed_out(local: None) -> None:
    sampler = ShardedSampler("plain", size=N, shard_size=SHARD, seed=0, epochs=1)
    order = SampleOrder(size=N, shard_size=SHARD, seed=0, shuffle=True)
    loop = _Steps()
    try:
        it = iter(sampler)
        for _ in range(3):
            batch = [next(it) for _ in range(5)]  # 5 samples a step: across a shard boundary (7)
            loop.opt.step()
            loop.trained.append(batch)
    finally:
        sampler.close()
    assert [_ids(s, order) for (s,) in loop.named] == loop.trained  # type: ignore[misc]  # 5 a step, across the shards' boundaries


def test_the_tracker_maps_positions_through_ranges_cut_short_and_forgets_what_no_step_will_need() -> None:
    position = [0]
    tracker = StepTracker("d", lambda: position[0])
    tracker.handed(0, (0, 10, 20))
    tracker.handed(6, (0, 40, 50))  # the first range cut short after 6 (an epoch's leftovers given back)
    tracker.handed(16, (1, 0, 10))
    tracker.received(4, 8)
    tracker.received(8, 18)  # contiguous: one span
    assert tracker.take() == StepSamples(dataset="d", count=14, ranges=((0, 14, 16), (0, 40, 50), (1, 0, 2)))
    assert len(tracker._log) == 1  # positions before 18 come no more: only the range that holds them stays
    tracker.received(18, 20, named=False)  # an iterator out of order: counted, not named
    assert tracker.take() == StepSamples(dataset="d", count=2, ranges=())
    assert tracker.take() == StepSamples(dataset="d", count=0, ranges=())  # nothing received: an empty step


def test_every_hook_before_a_step_sees_the_same_samples_and_the_next_step_starts_after_it(local: None) -> None:
    position = [0]
    tracker = StepTracker("d", lambda: position[0])
    tracker.handed(0, (0, 0, 100))
    skipping.watch_samples(lambda: [tracker.take()])
    position[0] = 8
    assert skipping.step_samples() == (StepSamples(dataset="d", count=8, ranges=((0, 0, 8),)),)
    assert skipping.step_samples() == (StepSamples(dataset="d", count=8, ranges=((0, 0, 8),)),)  # a second hook
    skipping.step_ended()
    position[0] = 12
    assert skipping.step_samples() == (StepSamples(dataset="d", count=4, ranges=((0, 8, 12),)),)
    skipping.step_ended()
    assert skipping.step_samples() == ()  # nothing received: a step of no samples of stead's sampler


@pytest.mark.parametrize("size", [N, 20], ids=["mid-epoch", "prefetched to the epoch's end"])
def test_the_cursor_by_default_counts_what_the_dataloader_handed_the_loop_not_what_it_prefetched(
        local: None, size: int) -> None:
    sampler = ShardedSampler("cursor", size=size, shard_size=SHARD, seed=4, epochs=1)
    order = SampleOrder(size=size, shard_size=SHARD, seed=4, shuffle=True)
    loader: DataLoader[Any] = DataLoader(list(range(size)), batch_size=4, sampler=sampler,  # type: ignore[arg-type]
                                         num_workers=2, prefetch_factor=2)
    used: list[int] = []
    try:
        for batch in loader:
            used += batch.tolist()
            if len(used) == 12:
                break
        assert sampler.consumed > 12  # the workers pulled more than the loop took
        assert sampler.epoch == (1 if size == 20 else 0)  # ... to the epoch's end: the sampler's epoch moved on
        state = sampler.state_dict()
    finally:
        sampler.close()
        del loader
    left = [i for part, start, end in state["remaining"] for i in order.samples(part, start, end)]
    assert sorted(left + used) == list(range(size))  # what the loop did not get stays in the cursor: read again
    assert state["epoch"] == 0
