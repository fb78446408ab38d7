"""Typed names: the job machine's timers and the ids of its effects, with the string form the log stores.

A timer or an effect id is a frozen dataclass with the fields the machine needs (a
round, a node and its incarnation), never a string taken apart again. The log, the
state's snapshot and the store's effect keys hold each one's string form
(:class:`~stead.core.serde.WireName`): ``decision/3``, ``rejoin/node-1/2``,
``check-health/1/node-0``, the names stead has always written, so a log written before
these types replays to the same state. ``str(name)`` gives that form.

:data:`TimerName` is every timer the job machine arms (``StartTimer``) and is told of
(``TimerFired``); :data:`EffectId` every effect's id (``EffectFailed`` names the one that
failed).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Self

from stead.core.serde import WireName

__all__ = ["CheckHealthId", "DecisionTimeout", "DumpStacksId", "EffectId", "EmitId", "GrowWindow", "HealthTimeout",
           "JoinTimeout", "KillId", "LastCall", "LaunchId", "RejoinTimeout", "ResizeWait", "ResourcesTimeout",
           "StartWorkersId", "StopNodeId", "StopWorkersId", "TimerId", "TimerName"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OfRound(WireName):
    round: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OfIncarnation(WireName):
    node_id: str
    incarnation: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class _OfRoundNode(WireName):
    round: int
    node_id: str


# -- timers ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class JoinTimeout(WireName):
    """The job's first nodes must join by then (``join_timeout_s``); one per run of the job (``life``)."""

    life: int = 0

    prefix: ClassVar[str] = "join-timeout"

    def __str__(self) -> str:  # the first run's was named before a job could be resumed
        return self.prefix if self.life == 0 else f"{self.prefix}/{self.life}"

    @classmethod
    def parse(cls, text: str) -> Self | None:
        return cls() if text == cls.prefix else super().parse(text)

    @classmethod
    def form(cls) -> str:
        return f"{cls.prefix}[/LIFE]"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionTimeout(_OfRound):
    """A worker failure of ``round`` waits this long for a plugin's decision (``decision_timeout_s``)."""

    prefix: ClassVar[str] = "decision"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthTimeout(WireName):
    """Health check ``check`` gives its verdict with the reports in by then (``health_timeout_s``)."""

    check: int

    prefix: ClassVar[str] = "health"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResizeWait(_OfRound):
    """Running ``round`` waits this long for a checkpoint commit before it is resized anyway (``resize_wait_s``)."""

    prefix: ClassVar[str] = "resize"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrowWindow(_OfRound):
    """Running ``round`` grows by every node that comes within this window (``grow_window_s``)."""

    prefix: ClassVar[str] = "grow"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RejoinTimeout(_OfIncarnation):
    """Relaunched node incarnation must join by then (``join_timeout_s``)."""

    prefix: ClassVar[str] = "rejoin"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResourcesTimeout(_OfIncarnation):
    """A node incarnation killed for its memory waits this long for its resources to be decided."""

    prefix: ClassVar[str] = "resources"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LastCall(_OfRound):
    """``round`` starts with the nodes joined by then, at least MIN (``last_call_timeout_s``)."""

    prefix: ClassVar[str] = "last-call"


TimerName = (JoinTimeout | DecisionTimeout | HealthTimeout | ResizeWait | GrowWindow | RejoinTimeout
             | ResourcesTimeout | LastCall)


# -- effect ids: one kind per effect (see stead.core.statemachine.effects) -------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchId(_OfIncarnation):
    prefix: ClassVar[str] = "launch"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KillId(_OfIncarnation):
    prefix: ClassVar[str] = "kill"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopNodeId(_OfIncarnation):
    prefix: ClassVar[str] = "stop-node"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartWorkersId(_OfRoundNode):
    prefix: ClassVar[str] = "start-workers"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopWorkersId(_OfRoundNode):
    prefix: ClassVar[str] = "stop-workers"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DumpStacksId(WireName):
    #: the seq of the StacksRequested record it answers
    request: int
    node_id: str

    prefix: ClassVar[str] = "dump-stacks"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckHealthId(WireName):
    check: int
    node_id: str

    prefix: ClassVar[str] = "check-health"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimerId(WireName):
    timer: TimerName

    prefix: ClassVar[str] = "timer"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmitId(WireName):
    #: the emission's key, unique per follow-up event (``request/node-1/2``, ``job-end``)
    key: str

    prefix: ClassVar[str] = "emit"


EffectId = (LaunchId | KillId | StopNodeId | StartWorkersId | StopWorkersId | DumpStacksId | CheckHealthId | TimerId
            | EmitId)
