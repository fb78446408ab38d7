"""Event kinds of the diagnosis plugin (``diagnosis.*``)."""

from __future__ import annotations

import dataclasses

from stead.plugin import Event, event_kind

__all__ = ["HangDetected"]


@event_kind("diagnosis.hang")
@dataclasses.dataclass(frozen=True, kw_only=True)
class HangDetected(Event):
    """No rank of ``round`` finished a step for ``stalled_s`` (over ``threshold_s``); ``rank``: the one that hangs.

    ``summary`` says where every rank was ("rank 1 at train.py:57 in <module>; ranks 0,2-3 in backward() at
    train.py:41"); ``action``: "restart" or "notify".
    """

    round: int
    step: int | None
    stalled_s: float
    threshold_s: float
    why: str
    rank: int | None
    summary: str
    action: str
    evidence: str = ""
