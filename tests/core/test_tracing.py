"""Each recovery is one OpenTelemetry trace: detect, decide, restart, rendezvous, first step."""

from __future__ import annotations

import itertools

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stead.core.config import Settings
from stead.core.events import (
    Event,
    JobSubmitted,
    NodeJoined,
    RecoveryAction,
    RecoveryDecided,
    StepProgress,
    WorkerFailed,
    WorkersStarted,
)
from stead.core.events.log import EventLog
from stead.core.reactor import Reactor
from stead.core.statemachine import Effect
from stead.core.store import open_store
from stead.core.tracing import RecoveryTracer

pytestmark = pytest.mark.anyio


class _Nothing:
    async def run(self, effect: Effect) -> None:
        return None


async def _trace(*events: Event) -> tuple[InMemorySpanExporter, RecoveryTracer]:
    """Fold ``events`` through a reactor whose recovery tracer exports to memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RecoveryTracer(provider.get_tracer("test"), job="t")
    store = await open_store("memory://")
    async with Reactor(EventLog(store, "t"), _Nothing(), settings=Settings(), observers=[tracer]) as reactor:
        await reactor.resume()
        for event in events:
            await reactor.submit(event)
    await store.close()
    return exporter, tracer


async def test_a_worker_recovery_is_one_trace_with_its_phases_in_order() -> None:
    exporter, tracer = await _trace(
        JobSubmitted(job="t", min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=1),
        NodeJoined(node_id="node-0", incarnation=1),
        WorkersStarted(node_id="node-0", round=1),
        StepProgress(round=1, step=0),
        WorkerFailed(node_id="node-0", round=1, local_rank=1, rank=1, exit_code=17),
        RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="transient"),
        WorkersStarted(node_id="node-0", round=2),
        StepProgress(round=2, step=0),
    )
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "recovery"]
    children = sorted((s for s in spans if s.parent is not None), key=lambda s: s.start_time or 0)
    assert [s.name for s in children] == ["detect", "decide", "restart", "rendezvous", "first_step"]
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in children)
    assert all(s.context.trace_id == root.context.trace_id for s in children)
    assert root.attributes is not None
    assert root.attributes["stead.cause"] == "worker_failed" and root.attributes["stead.outcome"] == "recovered"
    assert root.attributes["stead.rank"] == 1
    for earlier, later in itertools.pairwise(children):
        assert (earlier.end_time or 0) <= (later.start_time or 0) + 1
    assert root.end_time == children[-1].end_time
    (summary,) = tracer.completed
    assert summary["outcome"] == "recovered" and set(summary) >= {"decide", "restart", "rendezvous", "first_step"}


async def test_a_failed_recovery_ends_its_trace_with_the_job_outcome() -> None:
    exporter, _ = await _trace(
        JobSubmitted(job="t", min_nodes=1, max_nodes=1, nproc_per_node=1),
        NodeJoined(node_id="node-0", incarnation=1),
        WorkerFailed(node_id="node-0", round=1, local_rank=0, rank=0, exit_code=1),
        RecoveryDecided(round=1, action=RecoveryAction.FAIL, reason="NameError"),
    )
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "recovery"]
    assert root.attributes is not None and root.attributes["stead.outcome"] == "failed"
