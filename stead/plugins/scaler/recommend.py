"""Requests for the next run of a job, from what its nodes really used (pure).

Memory is recommended at the peak of any node's workers' resident memory plus
``headroom``, rounded up to a Kubernetes quantity (256 MiB steps under 4 GiB,
whole GiB above): a pod under its peak is OOM-killed. CPU at the 95th percentile
plus headroom, in half cores: CPU over a request is throttled, not killed. GPU
memory and utilisation are reported, not requested (a GPU is requested whole):
the peak says how much room a larger batch has, the median how busy the GPUs were.
A resource no node reported gets no line: an unknown is not a zero.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from stead.plugins.scaler.usage import UsageBook

__all__ = ["Recommendation", "quantity", "recommend"]

_MI, _GI = 1 << 20, 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recommendation:
    """One resource: what was used and, where it can be requested, what to request next time."""

    #: "memory", "cpu", "gpu_memory" or "gpu_util"
    resource: str
    peak: float
    p95: float
    median: float
    #: the request for the next run (bytes, or cores for cpu); None where the resource is not requested
    recommend: float | None
    #: the line ``stead status`` shows
    line: str


def quantity(size: float) -> str:
    """Bytes as a Kubernetes quantity: ``14Gi``, ``768Mi``, ``11.2Gi`` (one decimal above 1 GiB)."""
    if size >= _GI:
        value = size / _GI
        return f"{value:.0f}Gi" if value == int(value) else f"{value:.1f}Gi"
    return f"{math.ceil(size / _MI)}Mi"


def _memory_request(peak: float, headroom: float) -> float:
    wanted = peak * (1 + headroom)
    step = 256 * _MI if wanted < 4 * _GI else _GI
    return max(step, math.ceil(wanted / step) * step)


def recommend(book: UsageBook, *, headroom: float,
              requested: Mapping[str, float] | None = None) -> list[Recommendation]:
    """A recommendation per resource some node reported, in the order memory, cpu, gpu memory, gpu utilisation;
    ``requested`` (bytes of ``memory``, cores of ``cpu``): what the job's nodes asked their platform for, shown
    beside (a Kubernetes pod's limits)."""
    asked = requested or {}
    out: list[Recommendation] = []
    for name, dist in book.resources.items():
        p95, median = dist.quantile(0.95), dist.quantile(0.5)
        if p95 is None or median is None:
            continue
        peak = dist.peak
        match name:
            case "rss_bytes":
                request = _memory_request(peak, headroom)
                given = f"requested {quantity(asked['memory'])}, " if asked.get("memory") else ""
                out.append(Recommendation(
                    resource="memory", peak=peak, p95=p95, median=median, recommend=request,
                    line=f"memory: {given}peak {quantity(peak)}, p95 {quantity(p95)} per node; "
                         f"recommend {quantity(request)}"))
            case "cpu_percent":
                cores = max(0.5, math.ceil(p95 / 100 * (1 + headroom) * 2) / 2)
                given = f"requested {asked['cpu']:g}, " if asked.get("cpu") else ""
                out.append(Recommendation(
                    resource="cpu", peak=peak / 100, p95=p95 / 100, median=median / 100, recommend=cores,
                    line=f"cpu: {given}peak {peak / 100:.1f} cores, p95 {p95 / 100:.1f} per node; "
                         f"recommend {cores:g}"))
            case "gpu_memory_bytes":
                out.append(Recommendation(
                    resource="gpu_memory", peak=peak, p95=p95, median=median, recommend=None,
                    line=f"gpu memory: peak {quantity(peak)}, p95 {quantity(p95)} on the fullest GPU of a node"))
            case "gpu_util_percent":
                out.append(Recommendation(
                    resource="gpu_util", peak=peak, p95=p95, median=median, recommend=None,
                    line=f"gpu utilisation: median {median:.0f}%, p95 {p95:.0f}%"))
    return out
