"""Counts and views over a job's nodes that the job machine reads at every join, kept cheap at 10,000 nodes."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from stead.core.statemachine.node import NodeState, is_ready
from stead.core.statemachine.state import JobState

__all__ = ["READY", "Incarnations", "Ready"]


class ReadyCounts:
    """``len(state.ready)`` of the last few node mappings the machine made.

    A join changes one node: :func:`_with_node` derives the new mapping's count from the old one's instead of
    scanning every node, which made a 10,000-node rendezvous quadratic. A memo of a pure function, keyed by the
    mapping's identity (the entry holds the mapping, so the id cannot be reused while it is kept): the machine
    stays pure, and a mapping not kept here (a replayed or loaded state) is counted once.
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._entries: collections.OrderedDict[int, tuple[Mapping[str, NodeState], int]] = collections.OrderedDict()

    def count(self, nodes: Mapping[str, NodeState]) -> int:
        entry = self._entries.get(id(nodes))
        if entry is not None and entry[0] is nodes:
            return entry[1]
        count = sum(1 for s in nodes.values() if is_ready(s))
        self.keep(nodes, count)
        return count

    def keep(self, nodes: Mapping[str, NodeState], count: int) -> None:
        self._entries[id(nodes)] = (nodes, count)
        self._entries.move_to_end(id(nodes))
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)


READY = ReadyCounts()


class Ready(Sequence[str]):
    """``state.ready``, listed only when something reads more than its length (planning a round asks the length
    at every join, the names only when the round starts)."""

    def __init__(self, state: JobState) -> None:
        self._state = state
        self._names: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return READY.count(self._state.nodes) if self._names is None else len(self._names)

    def _list(self) -> tuple[str, ...]:
        if self._names is None:
            self._names = self._state.ready
        return self._names

    def __getitem__(self, index: Any) -> Any:
        return self._list()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __contains__(self, name: object) -> bool:
        return name in self._list()


class Incarnations(Mapping[str, int]):
    """node id -> its incarnation, read through from the nodes (not copied at every rendezvous event)."""

    def __init__(self, nodes: Mapping[str, NodeState]) -> None:
        self._nodes = nodes

    def __getitem__(self, node_id: str) -> int:
        return self._nodes[node_id].incarnation

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)
