"""Event kinds of the flash checkpoint plugin (``ckpt.*``).

CheckpointCommitted, CheckpointPersisted and CheckpointRestored are core kinds (the goodput ledger and the
metrics read them), re-exported here with the plugin's own.
"""

from __future__ import annotations

import dataclasses

from stead.plugin import CheckpointPersisted, CheckpointRestored, Event, EventMark, event_kind

__all__ = ["CheckpointCorrupt", "CheckpointPersisted", "CheckpointReplicated", "CheckpointRestored"]


@event_kind("ckpt.corrupt", mark=EventMark.FAILURE)
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointCorrupt(Event):
    """A copy of ``step`` failed its checksums (or could not be read); the reader fell back to an older copy."""

    step: int
    tier: str
    rank: int
    node_id: str = ""
    detail: str = ""


@event_kind("ckpt.replicated", mark=EventMark.CHECKPOINT)
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointReplicated(Event):
    """Every rank's copy of committed ``step`` (of ``round``) is in the memory of a node on another host: a host's
    loss restores it, or a newer step, from memory (the newest such step: "R")."""

    step: int
    round: int
    #: seconds from the step's choice for copying (its commit, or the previous step's replication) to now
    lag_s: float | None = None
