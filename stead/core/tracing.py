"""Recovery traces with the OpenTelemetry API (the CLI configures the SDK).

Each recovery is one trace: a root span ``recovery`` from the failure to the
first training step after it, with children ``detect`` (failure report to its
record), ``decide`` (record to the diagnosis' decision), ``restart`` (decision to
the new round), ``rendezvous`` (round to every node's workers running) and
``first_step`` (workers running to the first step of the new round). Span times
come from the event log, so the trace tells the same story as ``stead events``.
"""

from __future__ import annotations

import dataclasses

from opentelemetry import trace

from stead.core.events import (
    NodeLost,
    Record,
    RecoveryDecided,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    WorkerFailed,
)
from stead.core.statemachine import JobPhase, JobState

__all__ = ["RecoveryTracer", "configure_tracing"]

_NS = 1_000_000_000


def _ns(t: float) -> int:
    return int(t * _NS)


@dataclasses.dataclass
class _Recovery:
    root: trace.Span
    cause: str
    mark: float
    start: float
    phase: str = "decide"
    round: int | None = None
    durations: dict[str, float] = dataclasses.field(default_factory=dict)


class RecoveryTracer:
    """Observes the reactor's records and turns each recovery into one trace."""

    def __init__(self, tracer: trace.Tracer | None = None, *, job: str = "") -> None:
        self._tracer = tracer or trace.get_tracer("stead")
        self._job = job
        self._current: _Recovery | None = None
        #: one entry per finished recovery: its cause, outcome and each phase's duration in seconds
        self.completed: list[dict[str, str | float]] = []

    def __call__(self, record: Record, state: JobState) -> None:
        event = record.event
        rec = self._current
        if rec is None:
            if isinstance(event, WorkerFailed) and state.awaiting_decision and state.last_failure == event:
                self._begin(record, cause="worker_failed", attrs={"node": event.node_id, "rank": event.rank,
                                                                  "exit_code": event.exit_code or 0})
            elif isinstance(event, NodeLost) and state.phase is JobPhase.RECOVERING:
                self._begin(record, cause="node_lost", attrs={"node": event.node_id})
                if self._current is not None:
                    self._current.phase = "restart"
            return
        if state.phase.terminal:
            self._child(rec, rec.phase, record.at)
            self._finish(rec, state.phase.value, record.at)
            return
        if isinstance(event, RecoveryDecided) and rec.phase == "decide":
            self._child(rec, "decide", record.at, action=event.action.value)
            rec.phase = "restart"
        elif isinstance(event, RoundStarted) and rec.phase == "restart":
            self._child(rec, "restart", record.at, round=event.round)
            rec.phase, rec.round = "rendezvous", event.round
        elif isinstance(event, RoundCompleted) and rec.phase == "rendezvous" and event.round == rec.round:
            self._child(rec, "rendezvous", record.at)
            rec.phase = "first_step"
        elif isinstance(event, StepProgress) and rec.phase == "first_step" and event.round == rec.round:
            self._child(rec, "first_step", record.at, step=event.step)
            self._finish(rec, "recovered", record.at)

    def _begin(self, record: Record, *, cause: str, attrs: dict[str, str | int]) -> None:
        root = self._tracer.start_span(
            "recovery", start_time=_ns(record.at), attributes={"stead.job": self._job, "stead.cause": cause,
                                                               **{f"stead.{k}": v for k, v in attrs.items()}}
        )
        rec = _Recovery(root=root, cause=cause, mark=record.at, start=record.at)
        detect = self._tracer.start_span("detect", context=trace.set_span_in_context(root), start_time=_ns(record.at))
        detect.end(end_time=_ns(record.at))
        self._current = rec

    def _finish(self, rec: _Recovery, outcome: str, at: float) -> None:
        rec.root.set_attribute("stead.outcome", outcome)
        rec.root.end(end_time=_ns(at))
        self.completed.append({"cause": rec.cause, "outcome": outcome, **rec.durations, "total": at - rec.start})
        self._current = None

    def _child(self, rec: _Recovery, name: str, end: float, **attrs: str | int) -> None:
        span = self._tracer.start_span(
            name, context=trace.set_span_in_context(rec.root), start_time=_ns(rec.mark),
            attributes={f"stead.{k}": v for k, v in attrs.items()},
        )
        span.end(end_time=_ns(end))
        rec.durations[name] = end - rec.mark
        rec.mark = end


def configure_tracing(exporter: str = "none", *, service: str = "stead") -> None:
    """Install the OpenTelemetry SDK: ``console``, ``otlp`` (when installed and an endpoint is set) or ``none``."""
    import os

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    chosen: SpanExporter | None = None
    if exporter == "console":
        chosen = ConsoleSpanExporter()
    elif exporter == "otlp" or (exporter == "none" and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        except ImportError:
            chosen = None
        else:
            chosen = OTLPSpanExporter()
    if chosen is not None:
        provider.add_span_processor(BatchSpanProcessor(chosen))
    trace.set_tracer_provider(provider)
