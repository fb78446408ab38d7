"""Event kinds of the flash checkpoint plugin (``ckpt.*``); CheckpointCommitted is a core kind."""

from __future__ import annotations

import dataclasses

from stead.plugin import Event, event_kind

__all__ = ["CheckpointCorrupt", "CheckpointPersisted", "CheckpointRestored"]


@event_kind("ckpt.persisted")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointPersisted(Event):
    """Every rank of the world wrote its shard of ``step`` to ``path`` (loadable by torch.distributed.checkpoint)."""

    step: int
    path: str
    world_size: int
    #: how long the slowest rank took to write its files (None: not reported)
    persist_s: float | None = None


@event_kind("ckpt.corrupt")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointCorrupt(Event):
    """A copy of ``step`` failed its checksums (or could not be read); the reader fell back to an older copy."""

    step: int
    tier: str
    rank: int
    node_id: str = ""
    detail: str = ""


@event_kind("ckpt.restored")
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRestored(Event):
    """The workers of ``round`` restored ``step`` (-1: started fresh); ranks counted by where they read it."""

    round: int
    step: int
    memory_ranks: int = 0
    disk_ranks: int = 0
