"""Recovery traces with the OpenTelemetry API (the CLI configures the SDK).

Each recovery is one trace: a root span ``recovery`` from the failure to the
first training step after it, with children ``detect`` (the agent seeing the
worker end, to the failure's record), ``decide`` (record to the diagnosis' decision), ``restart`` (decision to
the new round), ``rendezvous`` (round to every node's workers running) and
``first_step`` (workers running to the first step of the new round; with no step
reported before the job ended, the root says so instead). The recoveries and their
phases are :mod:`stead.core.views.recovery`'s, the goodput ledger's too; span times come
from the event log, so the trace tells the same story as ``stead events``.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from stead.core.errors import ConfigError
from stead.core.events import (
    NodeExited,
    NodeLost,
    Record,
    RelaunchRequested,
    RestartRequested,
    WorkerFailed,
)
from stead.core.logging import TRACE_CHOICES
from stead.core.statemachine import JobState
from stead.core.views.recovery import Failure, Recovery, RecoveryFold, RecoveryOutcome, RecoveryPhase

__all__ = ["TRACE_CHOICES", "RecoveryTracer", "RecoverySummaryExporter", "chosen_exporter", "configure_tracing",
           "summary_line"]

_NS = 1_000_000_000


def _ns(t: float) -> int:
    return int(t * _NS)


def _failure_attributes(failure: Failure) -> dict[str, str | int]:
    match failure:
        case WorkerFailed():
            attrs: dict[str, str | int] = {"node": failure.node_id, "rank": failure.rank}
            if failure.exit_code is not None:
                attrs["exit_code"] = failure.exit_code
            if failure.signal is not None:
                attrs["signal"] = failure.signal
            return attrs
        case NodeLost() | NodeExited() | RelaunchRequested():
            return {"node": failure.node_id}
        case RestartRequested():
            return {"by": failure.by}


class RecoveryTracer:
    """Observes the reactor's records and turns each recovery
    (:class:`~stead.core.views.recovery.RecoveryFold`) into one
    trace, exported when the recovery ends.

    A master that takes over learns the running round from the state it is told with its first record; a recovery
    already under way then is not traced, the next one is.
    """

    def __init__(self, tracer: trace.Tracer | None = None, *, job: str = "") -> None:
        self._tracer = tracer or trace.get_tracer("stead")
        self._job = job
        self._fold = RecoveryFold()
        self._joined = False
        #: one entry per finished recovery: its cause, outcome and each phase's duration in seconds
        self.completed: list[dict[str, str | float]] = []

    def __call__(self, record: Record, state: JobState) -> None:
        if not self._joined:
            self._joined = True
            self._fold.join(state.rdzv.round, state.rdzv.members)
        for recovery in self._fold.apply(record).closed:
            self._trace(recovery)

    def _trace(self, recovery: Recovery) -> None:
        """The recovery's root span and one child per phase; with no step reported before the job ended, the
        root says so and ends where ``first_step`` began, rather than timing the job's end."""
        spans = list(recovery.spans)
        no_step = recovery.outcome not in _OPEN_ENDS and spans[-1].phase is RecoveryPhase.FIRST_STEP
        if no_step:
            spans.pop()
        end = spans[-1].end if spans else recovery.at
        root = self._tracer.start_span(
            "recovery", start_time=_ns(recovery.at),
            attributes={"stead.job": self._job, "stead.cause": recovery.kind.value,
                        **{f"stead.{k}": v for k, v in _failure_attributes(recovery.failure).items()}})
        durations: dict[str, float] = {}
        for span in spans:
            attrs: dict[str, str | int] = {}
            if span.phase is RecoveryPhase.DECIDE and recovery.action is not None:
                attrs["stead.action"] = recovery.action.value
            elif span.phase is RecoveryPhase.RESTART and recovery.new_round is not None:
                attrs["stead.round"] = recovery.new_round
            elif span.phase is RecoveryPhase.FIRST_STEP and recovery.first_step is not None:
                attrs["stead.step"] = recovery.first_step
            child = self._tracer.start_span(span.phase.value, context=trace.set_span_in_context(root),
                                            start_time=_ns(span.start), attributes=attrs)
            child.end(end_time=_ns(span.end))
            durations[span.phase.value] = durations.get(span.phase.value, 0.0) + span.seconds
        if no_step:
            root.set_attribute("stead.first_step", "none reported before the job ended")
        root.set_attribute("stead.outcome", recovery.outcome.value)
        root.end(end_time=_ns(end))
        self.completed.append({"cause": recovery.kind.value, "outcome": recovery.outcome.value, **durations,
                               "total": end - recovery.at})


#: outcomes of a recovery that did not end with the job: its last phase is timed to its end
_OPEN_ENDS = (RecoveryOutcome.RECOVERED, RecoveryOutcome.INTERRUPTED, RecoveryOutcome.RESUMED)


#: the OTLP exporter of each protocol: (module, the package that provides it)
_OTLP = {
    protocol: (f"opentelemetry.exporter.otlp.proto.{name}.trace_exporter", f"opentelemetry-exporter-otlp-proto-{name}")
    for protocol, name in (("http/protobuf", "http"), ("grpc", "grpc"))
}


def chosen_exporter(flag: str | None, environ: Mapping[str, str]) -> str:
    """``--trace`` when given, else ``OTEL_TRACES_EXPORTER``, else otlp when an OTLP endpoint is set, else none."""
    if flag is not None:
        return flag
    named = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        first = named.split(",")[0].strip()
        if first not in TRACE_CHOICES:
            raise ConfigError(f"OTEL_TRACES_EXPORTER={named!r} is not one stead exports to; use one of "
                              f"{', '.join(TRACE_CHOICES)}")
        return first
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "otlp"
    return "none"


def _otlp_exporter(environ: Mapping[str, str]) -> SpanExporter | None:
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip()
    if protocol not in _OTLP:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use http/protobuf or grpc")
    module, package = _OTLP[protocol]
    try:
        exporter_class = importlib.import_module(module).OTLPSpanExporter
    except ImportError:
        print(f"stead: warning: exporting traces over OTLP ({protocol}) needs the package {package}: "
              "pip install 'stead[otlp]'; recovery traces are not exported", file=sys.stderr)
        return None
    exporter: SpanExporter = exporter_class()  # endpoint, headers, timeout: from the OTEL_EXPORTER_OTLP_* variables
    return exporter


def configure_tracing(exporter: str | None = None, *, service: str = "stead",
                      environ: Mapping[str, str] | None = None) -> None:
    """Install the OpenTelemetry SDK, configured as OpenTelemetry's standard variables say.

    ``exporter``: ``console`` (one summary line per recovery on stderr), ``otlp`` (the
    OTLP exporter of ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``http/protobuf``, the default, or
    ``grpc``; endpoint and headers from ``OTEL_EXPORTER_OTLP_*``), ``none``, or None:
    as ``OTEL_TRACES_EXPORTER`` says. ``OTEL_SERVICE_NAME`` overrides ``service``. A bad
    value raises ConfigError; a missing exporter package is a warning naming it.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    env = os.environ if environ is None else environ
    kind = chosen_exporter(exporter, env)
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create(attributes))
    if kind == "console":
        provider.add_span_processor(SimpleSpanProcessor(RecoverySummaryExporter()))
    elif kind == "otlp":
        otlp = _otlp_exporter(env)
        if otlp is not None:
            provider.add_span_processor(BatchSpanProcessor(otlp))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # the batch is flushed before the process exits


class RecoverySummaryExporter(SpanExporter):
    """One readable line per recovery trace on stderr, instead of raw span JSON."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out
        self._children: dict[int, list[ReadableSpan]] = {}

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            trace_id = span.context.trace_id if span.context is not None else 0
            if span.name != "recovery":
                self._children.setdefault(trace_id, []).append(span)
                continue
            children = sorted(self._children.pop(trace_id, []), key=lambda c: c.start_time or 0)
            print(summary_line(span, children), file=self._out or sys.stderr, flush=True)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._children.clear()


def _ms(start: int | None, end: int | None) -> str:
    return f"{((end or 0) - (start or 0)) / 1e6:.0f} ms"


def summary_line(root: ReadableSpan, children: Sequence[ReadableSpan]) -> str:
    """``stead: recovery (worker_failed: node-0 rank 1, exit 17): recovered in 245 ms = detect 3 ms + ...``."""
    attrs = dict(root.attributes or {})
    what = [f"{attrs['stead.node']}"] if "stead.node" in attrs else []
    if "stead.rank" in attrs:
        what.append(f"rank {attrs['stead.rank']}")
    if "stead.exit_code" in attrs:
        what.append(f"exit {attrs['stead.exit_code']}")
    if "stead.signal" in attrs:
        what.append(f"signal {attrs['stead.signal']}")
    cause = f"{attrs.get('stead.cause', '?')}: {' '.join(what)}" if what else str(attrs.get("stead.cause", "?"))
    parts = " + ".join(f"{c.name} {_ms(c.start_time, c.end_time)}" for c in children)
    line = f"stead: recovery ({cause}): {attrs.get('stead.outcome', '?')} in {_ms(root.start_time, root.end_time)}"
    if parts:
        line += f" = {parts}"
    if "stead.first_step" in attrs:
        line += f"; first step: {attrs['stead.first_step']}"
    return line
