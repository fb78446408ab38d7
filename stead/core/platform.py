"""The Platform protocol: how the master launches and kills nodes.

A node is one agent (an OS process on the local platform, a pod on Kubernetes).
Launch and kill are idempotent by ``(node_id, incarnation)``: doing one twice is
harmless, so the reactor can re-run an effect after a master restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Protocol, runtime_checkable

from stead.core.events import NodeExited, NodePending, NodeStarted, RoomFound

__all__ = ["AGENT_IDENTITY_ENV", "HOST_ENV", "WARM_FIRST_ENV", "NodeSpec", "Platform", "PlatformEvent", "agent_title"]

PlatformEvent = NodeStarted | NodeExited | NodePending | RoomFound

#: in an agent's environment (``JOB/NODE/INCARNATION``): which node incarnation it runs, for a platform that adopts
#: agents by pid and for the workers it starts
AGENT_IDENTITY_ENV = "STEAD_LOCAL_NODE"
#: "1" in the environment of an agent that grows a running job: it joins once its zygote imported everything the
#: workers import (torch._dynamo too), so that the resized round does not wait for a cold node
WARM_FIRST_ENV = "STEAD_WARM_FIRST"
#: in an agent's environment: the host it runs on as the platform names it (a Kubernetes node, where the agent's
#: own host name is its pod's); what it reports when it registers, and what a faulty host's exclusion names
HOST_ENV = "STEAD_NODE_HOST"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """What a platform needs to start one node's agent."""

    job: str
    node_id: str
    incarnation: int
    #: argv of the agent process (``python -m stead agent ...``)
    command: tuple[str, ...]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cwd: str | None = None
    nproc: int = 1
    #: a platform-specific resource request (memory, cpu, gpu); free-form strings
    resources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: hosts the node must not run on (excluded as faulty); a platform that cannot place it elsewhere logs it
    avoid_hosts: tuple[str, ...] = ()
    #: argv that frees what the agent leaves on its machine when it is killed (``stead agent --cleanup``); a
    #: platform whose nodes' machines outlive them runs it when it closes, for a node whose last agent was killed
    cleanup_command: tuple[str, ...] = ()
    #: argv of a spare agent (``stead agent --spare``): it starts warm (torch imported, zygote ready) before any
    #: node needs it and becomes a node's agent when it reads ``{"node_id": ..., "incarnation": ...}`` (one JSON
    #: line) on its stdin. A platform that can keep one ready (the local platform) launches a node faster with it;
    #: empty: none. Every node of a job gives the same one.
    spare_command: tuple[str, ...] = ()


def agent_title(job: str, node_id: str, incarnation: int) -> str:
    """The process title a spare agent takes once it knows its node: a platform that adopts agents by pid
    recognises it by this, as it does an agent launched for the node by its environment."""
    return f"stead agent {job}/{node_id}/{incarnation}"


@runtime_checkable
class Platform(Protocol):
    """Launches and kills nodes and reports their lifecycle.

    Used as an async context manager: entering starts whatever the platform
    watches with; exiting kills every node it launched and waits for them.
    """

    name: str

    async def launch(self, spec: NodeSpec) -> None:
        """Start the node; a second call with the same (node_id, incarnation) does nothing."""

    async def kill(self, node_id: str, incarnation: int) -> None:
        """Stop the node (SIGKILL on local); unknown or finished nodes are ignored."""

    async def adopt(self, spec: NodeSpec, *, pid: int | None) -> bool:
        """Take over a node that an earlier master launched from ``spec`` (``pid``: what its NodeStarted said).

        A new master calls it for every node its log says runs, before it acts on anything: an adopted node
        is killed, watched and stopped like one launched by this platform. A node that is gone is reported
        NodeExited at once; returns whether it was adopted.
        """

    def events(self) -> AsyncIterator[PlatformEvent]:
        """NodeStarted / NodeExited as they happen, for every launched node (and NodePending for one the platform
        cannot find room for, where it can tell)."""


