"""Straggler detection: a node whose own time per step stays well above the other nodes'.

Each agent reports its node's own seconds per step (its slowest rank's time outside
backward(), see :mod:`stead.core.agent.pace`). A node is over when its figure is more
than ``factor`` times the median of the *other* nodes' figures (so that with two nodes
the slow one is compared with the fast one, not with an average it drags up). Over for
``window_s`` without a break: flagged; under for ``window_s``: cleared; out of the
round: cleared at once. Pure: figures and the time come in, verdicts go out.
Each look sorts the figures once and reads every node's "median of the others" off
that one list: it runs every second over every node (10,000 in a large job).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Mapping

__all__ = ["Straggler", "StragglerWatch", "median_without"]


@dataclasses.dataclass(frozen=True)
class Straggler:
    node_id: str
    compute_s: float
    median_s: float

    @property
    def ratio(self) -> float:
        return self.compute_s / self.median_s if self.median_s > 0 else float("inf")


class StragglerWatch:
    def __init__(self, *, factor: float, window_s: float) -> None:
        self.factor = factor
        self.window_s = window_s
        #: flagged nodes and their figures when flagged
        self.flagged: dict[str, Straggler] = {}
        self._over_since: dict[str, float] = {}
        self._under_since: dict[str, float] = {}

    def observe(self, figures: Mapping[str, float], *, members: Collection[str], now: float,
                ) -> tuple[list[Straggler], list[str]]:
        """Newly flagged nodes and newly cleared node ids, from each node's latest own seconds per step."""
        flagged: list[Straggler] = []
        cleared = [n for n in self.flagged if n not in members]
        for node in cleared:
            self._forget(node)
        ordered = sorted(figures.values())
        for node, figure in figures.items():
            if len(ordered) < 2:
                continue
            median = median_without(ordered, figure)
            over = median > 0 and figure > self.factor * median
            if over:
                self._under_since.pop(node, None)
                since = self._over_since.setdefault(node, now)
                if node not in self.flagged and now - since >= self.window_s:
                    self.flagged[node] = found = Straggler(node, figure, median)
                    flagged.append(found)
            else:
                self._over_since.pop(node, None)
                since = self._under_since.setdefault(node, now)
                if node in self.flagged and now - since >= self.window_s:
                    self._forget(node)
                    cleared.append(node)
        return flagged, cleared

    def _forget(self, node: str) -> None:
        self.flagged.pop(node, None)
        self._over_since.pop(node, None)
        self._under_since.pop(node, None)


def median_without(ordered: list[float], value: float) -> float:
    """The median of ``ordered`` (sorted, at least two values) with one occurrence of ``value`` left out."""
    gone = bisect.bisect_left(ordered, value)
    count = len(ordered) - 1

    def at(index: int) -> float:  # the index-th of the values left
        return ordered[index if index < gone else index + 1]

    middle = count // 2
    return at(middle) if count % 2 else (at(middle - 1) + at(middle)) / 2
