"""Event kinds of the diagnosis plugin (``diagnosis.*``)."""

from __future__ import annotations

import dataclasses

from stead.plugin import Event, EventMark, event_kind

__all__ = ["FailureClassified", "HangDetected", "StragglerCleared", "StragglerDetected"]


@event_kind("diagnosis.hang", mark=EventMark.FAILURE)
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


@event_kind("diagnosis.classified", mark=EventMark.DIAGNOSIS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class FailureClassified(Event):
    """A node failure (lost, or its agent gone) classified by the rules; a worker failure's class is in its decision.

    The job machine already relaunches a lost node; this records why it was lost, for the scaler (``oom``: more
    memory), ``stead status`` and post-mortems.
    """

    node_id: str
    incarnation: int
    failure_class: str
    action: str
    rule: str
    evidence: str


@event_kind("diagnosis.straggler", mark=EventMark.DIAGNOSIS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class StragglerDetected(Event):
    """``node_id`` has spent ``compute_s`` per step on its own work for ``window_s``, ``ratio`` x the others' median."""

    node_id: str
    round: int
    compute_s: float
    median_s: float
    ratio: float
    window_s: float
    #: "report" or "relaunch" (at the next committed checkpoint)
    action: str


@event_kind("diagnosis.straggler_cleared")
@dataclasses.dataclass(frozen=True, kw_only=True)
class StragglerCleared(Event):
    """``node_id`` is back within the straggler factor (or left the round)."""

    node_id: str
    round: int
    compute_s: float | None
    median_s: float | None
