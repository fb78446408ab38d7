"""Where each node's replicas go: a ring over the round's nodes, each node's copies on the next nodes of other hosts.

A pure function of the membership (no IO, no clock), recomputed by the master whenever a node reports from a new
round. The nodes are ordered by their first rank; node ``i`` sends its replicas to the first ``replicas`` nodes after
it around the ring whose hosts differ from its own and from each other's. A ring rather than fixed groups: every
node holds about as many replicas as it sends (no group leader holds more), a node that comes or goes moves only
its neighbours' placements, and any number of nodes works (groups need the count to divide). A node is never given
a replica on its own host, where the host's loss would take both copies: on a single host no replica is placed (it
would protect nothing a node's own memory does not), and with fewer other hosts than ``replicas``, fewer are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Member", "targets"]


@dataclasses.dataclass(frozen=True)
class Member:
    """A node of the round: its id, its host, and the first global rank it runs."""

    node_id: str
    host: str
    first_rank: int


def targets(members: Sequence[Member], replicas: int) -> dict[str, tuple[str, ...]]:
    """node_id -> the node_ids that hold its replicas, nearest first (an empty tuple: none)."""
    ring = sorted(members, key=lambda m: (m.first_rank, m.node_id))
    placed: dict[str, tuple[str, ...]] = {}
    for i, member in enumerate(ring):
        chosen: list[Member] = []
        for offset in range(1, len(ring)):
            if len(chosen) >= replicas:
                break
            other = ring[(i + offset) % len(ring)]
            if other.host != member.host and all(other.host != c.host for c in chosen):
                chosen.append(other)
        placed[member.node_id] = tuple(c.node_id for c in chosen)
    return placed
