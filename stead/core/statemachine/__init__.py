"""Pure state machines: job, node and rendezvous. No IO, no clock, no logging."""

from stead.core.statemachine.base import Transition
from stead.core.statemachine.commands import in_force
from stead.core.statemachine.effects import (
    AgentOrder,
    CheckHealth,
    DumpStacks,
    Effect,
    Emit,
    KillNode,
    LaunchNode,
    StartTimer,
    StartWorkers,
    StopNode,
    StopWorkers,
)
from stead.core.statemachine.fold import fold, fold_all
from stead.core.statemachine.job import transition
from stead.core.statemachine.node import NodePhase, NodeState
from stead.core.statemachine.rendezvous import RendezvousState
from stead.core.statemachine.state import JobPhase, JobState

__all__ = [
    "AgentOrder",
    "CheckHealth",
    "DumpStacks",
    "Effect",
    "Emit",
    "JobPhase",
    "JobState",
    "KillNode",
    "LaunchNode",
    "NodePhase",
    "NodeState",
    "RendezvousState",
    "StartTimer",
    "StartWorkers",
    "StopNode",
    "StopWorkers",
    "Transition",
    "fold",
    "fold_all",
    "in_force",
    "transition",
]
