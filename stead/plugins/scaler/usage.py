"""What a job's nodes used: one distribution per resource, read as peaks and percentiles.

Each look at the nodes' heartbeats adds one figure per node and resource: its
workers' resident memory and CPU, its GPUs' memory and utilisation. A figure a
node did not report is not added (an unknown is not a zero). A distribution keeps
a count per bucket 2 % wide on a log scale, so a percentile is read to within 2 %
(rounded up: a recommendation errs on the safe side) from a few hundred counters,
however long the job runs and however many nodes it has. Pure: figures in,
figures out; the plugin stores it as JSON so a new master carries it on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["RESOURCES", "Distribution", "UsageBook"]

#: the resources sampled, as the figures are named in a node's telemetry
RESOURCES: Final = ("rss_bytes", "cpu_percent", "gpu_memory_bytes", "gpu_util_percent")

#: the width of a bucket: each bucket's upper bound is this many times its lower bound
_RATIO: Final = 1.02
_LOG_RATIO: Final = math.log(_RATIO)


class Distribution:
    """Figures of one resource: their count, their peak, and counts per 2 % bucket."""

    def __init__(self) -> None:
        self.count = 0
        self.peak = 0.0
        self._zeros = 0
        self._buckets: dict[int, int] = {}

    def add(self, value: float) -> None:
        """One figure (>= 0; anything else is not a measurement and is left out)."""
        if not math.isfinite(value) or value < 0:
            return
        self.count += 1
        self.peak = max(self.peak, value)
        if value == 0:
            self._zeros += 1
            return
        bucket = math.floor(math.log(value) / _LOG_RATIO)
        self._buckets[bucket] = self._buckets.get(bucket, 0) + 1

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q <= 1) rounded up to its bucket's bound (never above the peak); None if empty."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q * self.count))
        seen = self._zeros
        if seen >= rank:
            return 0.0
        for bucket in sorted(self._buckets):
            seen += self._buckets[bucket]
            if seen >= rank:
                return min(self.peak, _RATIO ** (bucket + 1))
        return self.peak

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "peak": self.peak, "zeros": self._zeros,
                "buckets": {str(k): v for k, v in self._buckets.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Distribution:
        made = cls()
        made.count, made.peak, made._zeros = int(data["count"]), float(data["peak"]), int(data["zeros"])
        made._buckets = {int(k): int(v) for k, v in data["buckets"].items()}
        return made


class UsageBook:
    """A distribution per resource, and the nodes the figures came from."""

    def __init__(self) -> None:
        self.resources = {name: Distribution() for name in RESOURCES}
        self.nodes: set[str] = set()

    def add(self, node_id: str, figures: Mapping[str, float | None]) -> None:
        """One look at one node: the figures it reported (None: not reported, left out)."""
        for name in RESOURCES:
            value = figures.get(name)
            if value is not None:
                self.resources[name].add(float(value))
                self.nodes.add(node_id)

    @property
    def samples(self) -> int:
        return max(d.count for d in self.resources.values())

    def to_json(self) -> dict[str, Any]:
        return {"resources": {name: d.to_json() for name, d in self.resources.items()}, "nodes": sorted(self.nodes)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UsageBook:
        book = cls()
        for name, kept in data.get("resources", {}).items():
            if name in book.resources:
                book.resources[name] = Distribution.from_json(kept)
        book.nodes = set(data.get("nodes", ()))
        return book
