"""The node machine: one node's agent from request to exit.

Phases and allowed transitions::

    REQUESTED ──started──▶ STARTED ──joined──▶ JOINED
        │  └─────────────joined──────────────▲   │
        └──────────────┬─────────────────────────┘
                       ▼ lost                exited
                      LOST ───exited───▶ EXITED ◀───── (any phase)

A relaunch is a new *incarnation* that starts again at REQUESTED. Events about
an older incarnation are stale: accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import enum

from stead.core.events import Event, NodeExited, NodeJoined, NodeLost, NodeRequested, NodeStarted
from stead.core.statemachine.base import Transition, reject
from stead.core.statemachine.effects import Effect, KillNode, LaunchNode

__all__ = ["NodeEvent", "NodePhase", "NodeState", "is_ready", "transition"]

NodeEvent = NodeRequested | NodeStarted | NodeJoined | NodeLost | NodeExited


class NodePhase(enum.Enum):
    REQUESTED = "requested"
    STARTED = "started"
    JOINED = "joined"
    LOST = "lost"
    EXITED = "exited"

    @property
    def alive(self) -> bool:
        return self in (NodePhase.REQUESTED, NodePhase.STARTED, NodePhase.JOINED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeState:
    node_id: str
    incarnation: int
    phase: NodePhase = NodePhase.REQUESTED
    host: str = ""
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    #: joined, but a health check must pass before it trains
    unchecked: bool = False
    #: what its platform gives it: as requested (NodeRequested), then as the platform says (NodeStarted)
    resources: tuple[tuple[str, str], ...] = ()
    #: why the platform has found no room for it yet (NodePending); "" once it started, or when none was said
    pending: str = ""


def is_ready(node: NodeState | None) -> bool:
    """Joined, with no health check pending: the node may train."""
    return node is not None and node.phase is NodePhase.JOINED and not node.unchecked


def is_stale(node: NodeState | None, event: Event) -> bool:
    """True when ``event`` speaks of an older incarnation than the one we track."""
    incarnation = getattr(event, "incarnation", None)
    return node is not None and incarnation is not None and incarnation < node.incarnation


def transition(node: NodeState | None, event: NodeEvent, *, now: float) -> Transition[NodeState | None]:
    """Apply one node event; ``node`` is ``None`` before the node's first request."""
    del now  # node phases do not depend on time; kept for a uniform signature
    if isinstance(event, NodeRequested):
        if node is not None and event.incarnation <= node.incarnation:
            return reject(node, f"node {event.node_id} incarnation {event.incarnation} was already requested")
        if node is not None and node.phase.alive:
            return reject(node, f"node {event.node_id} is still {node.phase.value}; it must be lost or exit first")
        fresh = NodeState(node_id=event.node_id, incarnation=event.incarnation, resources=event.resources)
        return Transition(fresh, (LaunchNode(node_id=event.node_id, incarnation=event.incarnation,
                                             avoid_hosts=event.avoid_hosts, warm_first=event.warm_first,
                                             resources=event.resources),))
    if node is None:
        return reject(node, f"node {event.node_id} was never requested")
    if is_stale(node, event):
        return Transition(node)
    if event.incarnation > node.incarnation:
        return reject(node, f"node {event.node_id} incarnation {event.incarnation} was never requested")
    match event:
        case NodeStarted():
            resources = event.resources or node.resources
            if node.phase is NodePhase.REQUESTED:
                return Transition(dataclasses.replace(node, phase=NodePhase.STARTED, host=event.host, pid=event.pid,
                                                      resources=resources, pending=""))
            if node.phase is NodePhase.JOINED:  # the agent registered before the platform's report arrived
                return Transition(dataclasses.replace(node, pid=event.pid, host=event.host or node.host,
                                                      resources=resources))
            return reject(node, f"node {node.node_id} cannot start: it is {node.phase.value}")
        case NodeJoined():
            if node.phase in (NodePhase.REQUESTED, NodePhase.STARTED):
                return Transition(dataclasses.replace(node, phase=NodePhase.JOINED, host=event.host or node.host))
            if node.phase is NodePhase.JOINED:  # re-registration after a master restart
                return Transition(node)
            return reject(node, f"node {node.node_id} cannot join: it is {node.phase.value}")
        case NodeLost():
            if not node.phase.alive:
                return Transition(node)
            effects: tuple[Effect, ...] = (KillNode(node_id=node.node_id, incarnation=node.incarnation),)
            return Transition(dataclasses.replace(node, phase=NodePhase.LOST), effects)
        case NodeExited():
            exited = dataclasses.replace(node, phase=NodePhase.EXITED, exit_code=event.exit_code, signal=event.signal)
            return Transition(exited)
