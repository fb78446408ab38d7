"""Counts and views over a job's nodes that the job machine reads at every join, kept cheap at 10,000 nodes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from stead.core.statemachine.node import NodeState, is_ready
from stead.core.statemachine.state import JobState

__all__ = ["Incarnations", "Nodes", "Ready", "ready_count", "with_node"]


class Nodes(dict[str, NodeState]):
    """A job's nodes (``JobState.nodes``) that carry how many of them are ready.

    A join changes one node: :func:`with_node` derives the new mapping's count from the old one's instead of
    scanning every node, which made a 10,000-node rendezvous quadratic. The count lives on the mapping it counts:
    every state that shares the mapping (``dataclasses.replace`` keeps it) shares its count, and the count goes
    with it. The mapping is never changed in place once made (``JobState.nodes`` is a read-only ``Mapping``).
    """

    __slots__ = ("_ready",)

    def __init__(self, nodes: Mapping[str, NodeState] | Iterable[tuple[str, NodeState]] = (), *,
                 ready: int | None = None) -> None:
        """``ready``: how many of ``nodes`` are ready, when the caller knows; counted when first read otherwise."""
        super().__init__(nodes)
        self._ready = ready

    @property
    def ready(self) -> int:
        if self._ready is None:
            self._ready = sum(1 for s in self.values() if is_ready(s))
        return self._ready


def ready_count(nodes: Mapping[str, NodeState]) -> int:
    """``len(state.ready)``: carried by nodes made by :func:`with_node`, counted for others (a fresh or a loaded
    state's plain dict, counted again at each read until its first node event)."""
    return nodes.ready if isinstance(nodes, Nodes) else sum(1 for s in nodes.values() if is_ready(s))


def with_node(nodes: Mapping[str, NodeState], node: NodeState) -> Nodes:
    """``nodes`` with ``node`` put in (added or replacing its entry), its ready count derived from theirs."""
    ready = ready_count(nodes) + is_ready(node) - is_ready(nodes.get(node.node_id))
    new = Nodes(nodes, ready=ready)
    new[node.node_id] = node
    return new


class Ready(Sequence[str]):
    """``state.ready``, listed only when something reads more than its length (planning a round asks the length
    at every join, the names only when the round starts)."""

    def __init__(self, state: JobState) -> None:
        self._state = state
        self._names: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return ready_count(self._state.nodes) if self._names is None else len(self._names)

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
