"""Prometheus metrics of one job, served by its master (``prometheus-client``).

Everything is computed from the event log when scraped, so a metric never disagrees with
``stead status``: the goodput ledger (:mod:`stead.core.views.goodput`) gives the goodput, the
wall time by part and the recovery phases (a histogram over the job's recoveries: the same
figures as the recovery traces); the records give the restarts by failure class and
action, the checkpoints committed and persisted with their save and persist times (the
slowest rank's, as the checkpoint records carry them); the folded state gives the nodes by
phase, the step and the step rate.

A master that takes over a running job reads the log it replays, so its metrics cover
the whole job, not only its own part. ``metrics_port``: -1 serves nothing (the default of
``stead run`` and ``stead master``), 0 a free port, any other number that port; the
address goes into the job's master record and the master's log. They are served on
``metrics_host`` (loopback unless told otherwise) and, with ``metrics_token_file``, only
to a scrape that sends that token (``authorization: Bearer``, Prometheus'
``authorization.credentials_file``): any other request is answered 401. Each connection
holds a thread while it is open: at most ``metrics_max_connections`` are served at once
(one more is closed unread), and one that sends nothing (or reads nothing) for
``metrics_request_timeout_s`` is closed. A metrics address the master cannot serve on
(a port in use, a host not of this machine) is a ConfigError that says which.
"""

from __future__ import annotations

import hmac
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector, CollectorRegistry

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.events import (
    CheckpointCommitted,
    CheckpointPersisted,
    Record,
    RecoveryDecided,
    StepProgress,
)
from stead.core.events.log import BadRecord
from stead.core.statemachine import JobState, NodePhase
from stead.core.views.goodput import ledger
from stead.core.views.numerics import numerics_counts
from stead.core.views.recovery import RecoveryPhase

__all__ = ["JobMetrics", "MetricsServer", "RECOVERY_BUCKETS_S", "read_metrics_token"]

log = structlog.get_logger("stead.metrics")

#: recovery phase histogram buckets, seconds: a warm restart's phases are milliseconds, a relaunch seconds
RECOVERY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_DEFAULTS = Settings()
#: a server that closes connections over its limit logs it at most this often (a storm is a line a second, counted)
_LOG_EVERY_S = 1.0


class JobMetrics(Collector):
    """The collector: feed it the job's records (:meth:`observe`, a reactor observer), scrape it any time."""

    def __init__(self, job: str, state: Callable[[], JobState], *, clock: Callable[[], float] = time.time) -> None:
        self.job = job
        self._state = state
        self._clock = clock
        self._records: list[Record | BadRecord] = []
        self._last_seq = 0
        self._lock = threading.Lock()  # scrapes run in the HTTP server's thread

    def seed(self, records: Iterable[Record | BadRecord]) -> None:
        """The records already in the log (a master that takes over reads them before it replays)."""
        for record in records:
            self._add(record)

    def observe(self, record: Record, state: JobState) -> None:
        """A reactor observer: one new record."""
        del state
        self._add(record)

    def _add(self, record: Record | BadRecord) -> None:
        seq = record.seq or 0
        with self._lock:
            if isinstance(record, Record) and seq <= self._last_seq:
                return  # seeded already
            self._records.append(record)
            self._last_seq = max(self._last_seq, seq)

    def collect(self) -> Iterator[Any]:
        with self._lock:
            records = list(self._records)
        state = self._state()
        job = [self.job]
        book = ledger(records, now=self._clock())

        goodput = GaugeMetricFamily("stead_goodput_ratio", "Useful step time over wall time (0..1)", labels=["job"])
        goodput.add_metric(job, book.goodput)
        yield goodput
        parts = GaugeMetricFamily("stead_wall_seconds", "The job's wall time, split by what it was spent on",
                                  labels=["job", "part"])
        for part, seconds in book.parts.items():
            parts.add_metric([self.job, part], seconds)
        yield parts

        phases = HistogramMetricFamily("stead_recovery_phase_seconds",
                                       "Each recovery's phases (detect, decide, restart, rendezvous, first step)",
                                       labels=["job", "phase"])
        for phase in RecoveryPhase:
            values = [r.phases[phase] for r in book.recoveries if phase in r.phases]
            phases.add_metric([self.job, phase.value], _buckets(values), sum_value=sum(values))
        yield phases

        decided = Counter((r.event.failure_class or "unclassified", r.event.action.value)
                          for r in records if isinstance(r, Record) and isinstance(r.event, RecoveryDecided))
        restarts = CounterMetricFamily("stead_recovery_decisions", "Failures decided, by failure class and action",
                                       labels=["job", "failure_class", "action"])
        for (failure_class, action), count in sorted(decided.items()):
            restarts.add_metric([self.job, failure_class, action], count)
        yield restarts

        committed = [r.event for r in records if isinstance(r, Record) and isinstance(r.event, CheckpointCommitted)]
        persisted = [r.event for r in records if isinstance(r, Record) and isinstance(r.event, CheckpointPersisted)]
        checkpoints = CounterMetricFamily("stead_checkpoints", "Checkpoints committed (in memory) and persisted",
                                          labels=["job", "tier"])
        checkpoints.add_metric([self.job, "memory"], len(committed))
        checkpoints.add_metric([self.job, "disk"], len(persisted))
        yield checkpoints
        took = HistogramMetricFamily("stead_checkpoint_seconds", "Checkpoint times: save (the in-memory copy, the "
                                     "training loop's stall) and persist (writing to disk), the slowest rank's",
                                     labels=["job", "stage"])
        for stage, values in (("save", [e.save_s for e in committed if e.save_s is not None]),
                              ("persist", [e.persist_s for e in persisted if e.persist_s is not None])):
            took.add_metric([self.job, stage], _buckets(values), sum_value=sum(values))
        yield took

        nodes = GaugeMetricFamily("stead_nodes", "The job's nodes by phase", labels=["job", "phase"])
        by_phase = Counter(node.phase for node in state.nodes.values())
        for node_phase in NodePhase:
            nodes.add_metric([self.job, node_phase.value], by_phase[node_phase])
        yield nodes
        step = GaugeMetricFamily("stead_step", "The step every rank of the running round has finished",
                                 labels=["job"])
        step.add_metric(job, float(state.step or 0))
        yield step
        rate = GaugeMetricFamily("stead_step_rate", "Steps per second between the last two progress records of "
                                 "the running round", labels=["job"])
        rate.add_metric(job, _step_rate(records))
        yield rate
        restarts_used = GaugeMetricFamily("stead_restarts", "Restarts spent of the budget", labels=["job"])
        restarts_used.add_metric(job, float(state.restarts))
        yield restarts_used
        yield from _numerics(self.job, [r for r in records if isinstance(r, Record)])


def _numerics(job: str, records: Sequence[Record]) -> Iterator[Any]:
    """The numerical faults' metrics (:func:`stead.core.views.numerics.numerics_counts`)."""
    counts = numerics_counts(records)
    faults = CounterMetricFamily("stead_numerical_faults", "Numerical faults decided (NaN/Inf gradients, loss "
                                 "spikes, replica mismatches, the nan budget spent), by the rule that matched",
                                 labels=["job", "rule"])
    for rule, count in sorted(counts.faults.items()):
        faults.add_metric([job, rule], count)
    yield faults
    skipped = GaugeMetricFamily("stead_steps_skipped", "Steps every rank skips (their batch caused a numerical "
                                "fault), as decided", labels=["job"])
    skipped.add_metric([job], counts.steps_skipped)
    yield skipped
    notes = CounterMetricFamily("stead_numerics_notes", "The workers' numerical notes recorded (loss spikes, steps "
                                "skipped), by kind; dropped: those their agents refused or could not send",
                                labels=["job", "kind"])
    for kind, count in sorted(counts.notes.items()):
        notes.add_metric([job, kind], count)
    notes.add_metric([job, "dropped"], counts.notes_dropped)
    yield notes
    bounded = CounterMetricFamily("stead_bounded_restores", "Restores bounded to the last step whose replicas' "
                                  "fingerprints agreed (after a replica mismatch)", labels=["job"])
    bounded.add_metric([job], counts.bounded_restores)
    yield bounded


def _buckets(values: Sequence[float]) -> list[tuple[str, float]]:
    counts = [(f"{bound:g}", float(sum(1 for v in values if v <= bound))) for bound in RECOVERY_BUCKETS_S]
    return [*counts, ("+Inf", float(len(values)))]


def _step_rate(records: Sequence[Record | BadRecord]) -> float:
    progress = [r for r in records if isinstance(r, Record) and isinstance(r.event, StepProgress)]
    if len(progress) < 2:
        return 0.0
    last, before = progress[-1], progress[-2]
    assert isinstance(last.event, StepProgress) and isinstance(before.event, StepProgress)
    if last.event.round != before.event.round or last.at <= before.at:
        return 0.0
    return max(0, last.event.step - before.event.step) / (last.at - before.at)


def read_metrics_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace dropped), as Prometheus reads a credentials_file."""
    try:
        with open(path, encoding="utf-8") as file:
            token = file.read().strip()
    except OSError as exc:
        raise ConfigError(f"metrics_token_file {path!r} cannot be read ({exc.strerror}); give a file holding the "
                          "token Prometheus sends, or leave metrics_token_file empty") from None
    if not token:
        raise ConfigError(f"metrics_token_file {path!r} is empty; write the token Prometheus sends into it")
    return token


class _Quiet(WSGIRequestHandler):
    """No line on stderr per scrape; a connection that stays silent past its timeout is closed, not a traceback."""

    def log_message(self, format: str, *args: Any) -> None:
        del format, args

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:  # the socket's timeout (the server's metrics_request_timeout_s): the peer went silent
            self.close_connection = True
            log.debug("metrics_connection_timed_out", peer=self.client_address[0])


class _BoundedServer(ThreadingWSGIServer):
    """Prometheus' threading WSGI server with a cap on the connections served at once (each holds a thread)."""

    max_connections = _DEFAULTS.metrics_max_connections

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0
        self._logged = -math.inf

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            now = time.monotonic()
            if now - self._logged >= _LOG_EVERY_S:
                self._logged = now
                log.warning("metrics_connection_refused", peer=client_address[0], refused=self.refused,
                            max_connections=self.max_connections,
                            hint="more connections than a scraper opens: if they are your scrapers, raise "
                                 "metrics_max_connections")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _guarded(app: Callable[..., Any], token: str | None) -> Callable[..., Any]:
    """``app`` behind ``authorization: Bearer <token>``: a request without it is 401, before anything is computed."""
    if token is None:
        return app
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        given = str(environ.get("HTTP_AUTHORIZATION", "")).encode()
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Bearer realm="stead metrics"'),
                                                ("Content-Type", "text/plain; charset=utf-8")])
            return [b"401: send the metrics token (authorization: Bearer TOKEN, metrics_token_file)\n"]
        return app(environ, start_response)

    return guarded


class MetricsServer:
    """Serves a :class:`JobMetrics` over HTTP (``/metrics``) on ``host``; ``close()`` frees the port.

    With ``token``, only to requests that carry it (``authorization: Bearer``); the others get 401.
    """

    def __init__(self, metrics: JobMetrics, *, host: str, port: int, token: str | None = None,
                 request_timeout_s: float = _DEFAULTS.metrics_request_timeout_s,
                 max_connections: int = _DEFAULTS.metrics_max_connections) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(metrics)
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            server_class = type("_MetricsHTTPServer", (_BoundedServer,), {"address_family": family,
                                                                          "max_connections": max_connections})
            handler_class = type("_MetricsHandler", (_Quiet,), {"timeout": request_timeout_s})
            self._server: WSGIServer = make_server(host, port, _guarded(make_wsgi_app(self.registry), token),
                                                   server_class, handler_class=handler_class)
        except OSError as exc:
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise ConfigError(f"cannot serve metrics on {where}: {exc.strerror or exc}; choose another metrics_port "
                              "(0: a free one) or a metrics_host of this machine") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="stead-metrics", daemon=True)
        self._thread.start()
        self.host = host
        self.port = int(self._server.server_address[1])
        if token is None and not _loopback(host):
            log.warning("metrics_without_token", url=self.url,
                        hint="anyone who reaches this address reads the job's metrics; set metrics_token_file")
        log.info("metrics_serving", url=self.url, token=token is not None)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
