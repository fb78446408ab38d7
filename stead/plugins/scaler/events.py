"""Event kinds of the scaler plugin (``scaler.*``)."""

from __future__ import annotations

import dataclasses

from stead.plugin import Event, event_kind

__all__ = ["DecisionRejected", "OomAnswered", "PendingAnswered", "ResourcesRecommended", "ScaleRequested"]


@event_kind("scaler.recommended")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ResourcesRecommended(Event):
    """What the job's nodes used, and the requests recommended for its next run (recorded when the job ends).

    Figures are per node; a resource no node reported is None (an unknown is not a zero). ``lines``: what
    ``stead status`` shows, one per resource.
    """

    samples: int
    nodes: int
    memory_peak_bytes: int | None = None
    memory_p95_bytes: int | None = None
    memory_recommend_bytes: int | None = None
    cpu_peak_cores: float | None = None
    cpu_p95_cores: float | None = None
    cpu_recommend_cores: float | None = None
    gpu_memory_peak_bytes: int | None = None
    gpu_util_median_percent: float | None = None
    lines: tuple[str, ...] = ()


@event_kind("scaler.requested")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleRequested(Event):
    """Someone asked for ``nodes`` nodes (``stead scale``, the RPC, the embedding API); the policy decides next."""

    nodes: int
    by: str
    reason: str = ""


@event_kind("scaler.rejected")
@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionRejected(Event):
    """The membership policy returned something that cannot be a target (or raised): the job keeps its size."""

    policy: str
    returned: str
    reason: str


@event_kind("scaler.oom")
@dataclasses.dataclass(frozen=True, kw_only=True)
class OomAnswered(Event):
    """A worker ran out of memory (``ooms`` so far): the next rounds' workers get ``batch_scale`` (as
    STEAD_BATCH_SCALE, read by ``stead.data.batch_size``), halved per OOM until ``scaler.oom_budget`` is spent."""

    ooms: int
    batch_scale: float
    reason: str


@event_kind("scaler.pending")
@dataclasses.dataclass(frozen=True, kw_only=True)
class PendingAnswered(Event):
    """The platform has had no room for a node (node.pending): the scaler goes on without it while MIN hold
    (``decision`` "give_up": the target drops to the nodes that have room, asked again after
    ``scaler.pending_retry_s``) or waits (``decision`` "wait": MIN needs it; the job fails after join_timeout_s
    if it gets none)."""

    node_id: str
    incarnation: int
    decision: str
    reason: str
