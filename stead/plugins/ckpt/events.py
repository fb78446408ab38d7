"""Event kinds of the flash checkpoint plugin (``ckpt.*``).

CheckpointCommitted, CheckpointPersisted and CheckpointRestored are core kinds (the goodput ledger and the
metrics read them), re-exported here with the plugin's own.
"""

from __future__ import annotations

import dataclasses

from stead.plugin import CheckpointPersisted, CheckpointRestored, Event, EventMark, event_kind

__all__ = ["CheckpointCorrupt", "CheckpointPersisted", "CheckpointRestored"]


@event_kind("ckpt.corrupt", mark=EventMark.FAILURE)
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointCorrupt(Event):
    """A copy of ``step`` failed its checksums (or could not be read); the reader fell back to an older copy."""

    step: int
    tier: str
    rank: int
    node_id: str = ""
    detail: str = ""
