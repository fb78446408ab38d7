"""The sharding plugin's own event kinds: rare facts worth a line in the job's log.

Leases are not events (the event log must not grow with every lease); they live in
the plugin's journal. These record what an operator wants to see next to the
recovery: a dataset appeared, a round started from a checkpoint's cursor, a failed
worker's leases went back to the queue.
"""

from __future__ import annotations

import dataclasses

from stead.plugin import Event, event_kind

__all__ = ["DatasetRegistered", "LeasesReleased", "SamplesSkipped", "ShardRoundRefused", "ShardRoundStarted"]


@event_kind("shard.registered")
@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetRegistered(Event):
    dataset: str
    definition: str


@event_kind("shard.round_started")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardRoundStarted(Event):
    """A round began reading ``dataset``: from a checkpoint's cursor (``restored``) or from the beginning."""

    dataset: str
    round: int
    world_size: int
    restored: bool
    epoch: int
    #: samples left to read in all epochs (datasets; 0 for streaming sources)
    remaining: int


@event_kind("shard.round_refused")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardRoundRefused(Event):
    dataset: str
    round: int
    reason: str


@event_kind("shard.released")
@dataclasses.dataclass(frozen=True, kw_only=True)
class LeasesReleased(Event):
    """A worker's unconsumed leases went back to the queue (it failed, its node was lost, or it went silent)."""

    dataset: str
    round: int
    rank: int
    node_id: str
    samples: int
    reason: str


@event_kind("shard.skipped")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplesSkipped(Event):
    """A rank's skipped step (a numerical fault's batch) held ``samples`` of ``dataset``: the ledger records them as
    skipped; ``skipped``: the dataset's samples skipped so far (the job's history, less what a rollback reads again)."""

    dataset: str
    round: int
    rank: int
    step: int
    samples: int
    skipped: int
