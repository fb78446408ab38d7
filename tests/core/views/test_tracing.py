"""Each recovery is one OpenTelemetry trace: detect, decide, restart, rendezvous, first step."""

from __future__ import annotations

import importlib
import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.events import (
    Event,
    JobSubmitted,
    NodeExited,
    NodeJoined,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RestartRequested,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.events.log import EventLog
from stead.core.master.reactor import Reactor
from stead.core.statemachine import Effect, JobState
from stead.core.store import open_store
from stead.core.views.tracing import RecoveryTracer, chosen_exporter, configure_tracing, summary_line

pytestmark = pytest.mark.anyio


class _Nothing:
    async def run(self, effect: Effect) -> None:
        return None


async def _trace(*events: Event, clock: Callable[[], float] = time.time) -> tuple[InMemorySpanExporter,
                                                                                   RecoveryTracer]:
    """Fold ``events`` through a reactor whose recovery tracer exports to memory (``clock``: the records' times)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RecoveryTracer(provider.get_tracer("test"), job="t")
    store = await open_store("memory://")
    event_log = EventLog(store, "t", clock=clock)
    async with Reactor(event_log, _Nothing(), settings=Settings(), observers=[tracer]) as reactor:
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


async def test_a_killed_worker_is_recorded_by_its_signal_and_detect_starts_when_its_agent_saw_it_end() -> None:
    # each append 10 s after the one before (ahead of the timers' clock: none fires): the agent saw the worker end
    # after the job was submitted and seconds before the master recorded it (detect never starts before the job did)
    seen, appends = time.time() + 5.0, itertools.count()
    exporter, tracer = await _trace(
        JobSubmitted(job="t", min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=1),
        NodeJoined(node_id="node-0", incarnation=1),
        WorkersStarted(node_id="node-0", round=1),
        WorkerFailed(node_id="node-0", round=1, local_rank=0, rank=0, signal=9, exited_at=seen),
        RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="transient"),
        WorkersStarted(node_id="node-0", round=2),
        StepProgress(round=2, step=5),
        clock=lambda: time.time() + 10.0 * next(appends),
    )
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "recovery"]
    (detect,) = [s for s in spans if s.name == "detect"]
    assert root.attributes is not None and "stead.exit_code" not in root.attributes
    assert root.attributes["stead.signal"] == 9
    assert root.start_time == detect.start_time == int(seen * 1e9)
    assert (detect.end_time or 0) - (detect.start_time or 0) >= 0.4e9
    children = sorted((s for s in spans if s.parent is not None), key=lambda s: s.start_time or 0)
    line = summary_line(root, children)
    assert line.startswith("stead: recovery (worker_failed: node-0 rank 0 signal 9): recovered in ")
    assert " = detect " in line and " + first_step " in line
    assert tracer.completed[0]["detect"] >= 0.4


async def test_with_no_step_reported_the_trace_says_so_instead_of_timing_the_end_of_the_job() -> None:
    exporter, tracer = await _trace(
        JobSubmitted(job="t", min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=1),
        NodeJoined(node_id="node-0", incarnation=1),
        WorkersStarted(node_id="node-0", round=1),
        WorkerFailed(node_id="node-0", round=1, local_rank=0, rank=0, exit_code=3),
        RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="transient"),
        WorkersStarted(node_id="node-0", round=2),
        WorkersSucceeded(node_id="node-0", round=2),
    )
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "recovery"]
    (rendezvous,) = [s for s in spans if s.name == "rendezvous"]
    assert not [s for s in spans if s.name == "first_step"]
    assert root.attributes is not None
    assert root.attributes["stead.first_step"] == "none reported before the job ended"
    assert root.attributes["stead.outcome"] == "succeeded" and root.end_time == rendezvous.end_time
    assert "first_step" not in tracer.completed[0]


def test_a_killed_agent_and_a_hang_are_traced_as_the_goodput_ledger_counts_them() -> None:
    # before the one recovery fold, tracing ignored node.exited and plugins' restart requests
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RecoveryTracer(provider.get_tracer("test"), job="t")
    members = ("node-0", "node-1")
    timed: list[tuple[float, Event]] = [
        (0.0, JobSubmitted(job="t", min_nodes=2, max_nodes=2, nproc_per_node=1)),
        (1.0, RoundStarted(round=1, members=members, nproc_per_node=1)), (1.5, RoundCompleted(round=1)),
        (2.0, StepProgress(round=1, step=1)), (3.0, NodeExited(node_id="node-1", incarnation=1, signal=9)),
        (4.0, RoundStarted(round=2, members=members, nproc_per_node=1)), (4.5, RoundCompleted(round=2)),
        (5.0, StepProgress(round=2, step=1)),
        (25.0, RestartRequested(round=2, reason="no step for 20 s", by="diagnosis")),
        (26.0, RoundStarted(round=3, members=members, nproc_per_node=1)), (26.5, RoundCompleted(round=3)),
        (27.0, StepProgress(round=3, step=1)),
    ]
    for seq, (at, event) in enumerate(timed, 1):
        tracer(Record(seq=seq, at=at, event=event), JobState())
    roots = [s for s in exporter.get_finished_spans() if s.name == "recovery"]
    assert [(r.attributes or {}).get("stead.cause") for r in roots] == ["node_exited", "restart_requested"]
    assert [c["outcome"] for c in tracer.completed] == ["recovered", "recovered"]
    assert tracer.completed[1]["detect"] == pytest.approx(20.0)  # the stall: since the last step report
    assert "detect" not in tracer.completed[0] and tracer.completed[0]["restart"] == pytest.approx(1.0)


def test_the_exporter_is_chosen_as_opentelemetry_says() -> None:
    assert chosen_exporter(None, {}) == "none"
    assert chosen_exporter(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}) == "otlp"
    assert chosen_exporter(None, {"OTEL_TRACES_EXPORTER": "console"}) == "console"
    assert chosen_exporter("none", {"OTEL_TRACES_EXPORTER": "otlp"}) == "none"  # the flag wins
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin' is not one stead exports to"):
        chosen_exporter(None, {"OTEL_TRACES_EXPORTER": "zipkin"})


def test_a_missing_otlp_exporter_is_a_warning_naming_the_package(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.import_module

    def missing(name: str, package: str | None = None) -> Any:
        if name.startswith("opentelemetry.exporter.otlp"):
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", missing)
    configure_tracing("otlp", environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert "needs the package opentelemetry-exporter-otlp-proto-grpc: pip install 'stead[otlp]'" in (
        capsys.readouterr().err)
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported"):
        configure_tracing("otlp", environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
