"""A job's report: one self-contained HTML file (``stead report``) drawn from its event log.

:func:`timeline` is a pure fold of the records into what the picture shows: the job's own lane
(start-up, each recovery in its phases, the tail), one band per round, one lane per node
incarnation, marks for failures, decisions and checkpoints, the step rate over time, the goodput
ledger, and the numerical faults (the lines of ``stead status``, every one). :func:`render_html`
draws it with plotly, its JavaScript inlined: the file opens with no network, so it can be
attached to a bug report. A log with unreadable records, a job that
never stepped or one still running gives a report that says what it could not show.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import os
from collections.abc import Iterable

from stead.core.errors import PermanentError
from stead.core.events import (
    JobFailed,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    NodeExited,
    NodeJoined,
    NodeLost,
    Record,
    RoundStarted,
    StepProgress,
)
from stead.core.events.log import BadRecord
from stead.core.views.goodput import PARTS, Ledger, ledger, step_rates
from stead.core.views.numerics import numerics_lines
from stead.core.views.recovery import RecoveryOutcome, RecoveryPhase
from stead.core.views.warnings import warning_lines

__all__ = ["JOB_LANE", "Mark", "Span", "Timeline", "render_html", "timeline", "write_report"]

JOB_LANE = "job"
_COLORS = {
    "waiting": "#b0bec5", "idle": "#eceff1", "round": "#81c784", "node": "#90caf9", "detect": "#e57373",
    "decide": "#ffb74d", "restart": "#ba68c8", "rendezvous": "#4fc3f7", "first_step": "#aed581",
    "failure": "#c62828", "diagnosis": "#6a1b9a", "decision": "#ef6c00", "checkpoint": "#1565c0",
    "useful": "#43a047", "lost": "#e53935", "recovery": "#fb8c00", "checkpoint_part": "#1e88e5",
    "phases": "#8e24aa",
}


@dataclasses.dataclass(frozen=True)
class Span:
    """``lane`` was in ``kind`` from ``start`` to ``end`` (seconds since the submission)."""

    lane: str
    kind: str
    start: float
    end: float
    label: str


@dataclasses.dataclass(frozen=True)
class Mark:
    """Something that happened at ``at`` (seconds since the submission)."""

    at: float
    kind: str
    text: str


@dataclasses.dataclass(frozen=True)
class Timeline:
    #: the submission's time, seconds since the epoch (0.0 when the job was never submitted)
    origin: float
    #: seconds from the submission to the end (or to ``now`` for a running job)
    length: float
    spans: tuple[Span, ...]
    marks: tuple[Mark, ...]
    #: (round, seconds since the submission, steps per second since the round's report before it)
    rates: tuple[tuple[int, float, float], ...]
    ledger: Ledger
    ended: bool
    #: what could not be drawn, in words (the ledger's own gaps included)
    missing: tuple[str, ...]
    #: the numerical faults, a line each (steps skipped, loss spikes, restores bounded: :mod:`.numerics`)
    numerics: tuple[str, ...] = ()
    #: the warnings that the job would be stopped soon (Slurm's), a line each (:mod:`.warnings`)
    warnings: tuple[str, ...] = ()


def _describe(record: Record) -> str:
    event = record.event
    fields = [f"{k}={v}" for k, v in dataclasses.asdict(event).items()
              if v not in (None, "", (), [], {}) and k not in ("job", "evidence")]
    return f"{event.type_name} " + " ".join(fields)[:300]


def timeline(records: Iterable[Record | BadRecord], *, now: float | None = None) -> Timeline:
    """What the report draws, from a job's records in log order (``now``: where a running job's picture ends)."""
    items = list(records)
    good = [r for r in items if isinstance(r, Record)]
    book = ledger(items, now=now)
    first = next((r for r in good if isinstance(r.event, JobSubmitted)), None)
    if first is None:
        return Timeline(origin=0.0, length=0.0, spans=(), marks=(), rates=(), ledger=book, ended=False,
                        missing=book.missing)
    origin = first.at
    end_at = max([r.at for r in good] + ([now] if now is not None and not book.ended else []))
    spans: list[Span] = []
    marks: list[Mark] = []
    rates = [(round_, t - origin, rate) for round_, t, rate in step_rates(good)]
    open_nodes: dict[tuple[str, int], float] = {}
    current_round: tuple[int, float, str] | None = None
    first_step: float | None = None
    ended_at: float | None = None

    def close_round(at: float) -> None:
        if current_round is not None:
            spans.append(Span("rounds", "round", current_round[1], at, current_round[2]))

    for record in good:
        event, at = record.event, record.at - origin
        match event:
            case RoundStarted():
                close_round(at)
                current_round = (event.round, at, f"round {event.round}: {', '.join(event.members)}")
            case NodeJoined():
                open_nodes.setdefault((event.node_id, event.incarnation), at)
            case NodeLost() | NodeExited():
                joined = open_nodes.pop((event.node_id, event.incarnation), None)
                if joined is not None:
                    spans.append(Span(event.node_id, "node", joined, at, f"{event.node_id} #{event.incarnation}"))
            case StepProgress():
                first_step = at if first_step is None else first_step
            case JobSucceeded() | JobFailed() | JobStopped():
                ended_at = at
        kind = type(event).mark  # (declared by each event kind, a plugin's included)
        if kind is not None:
            marks.append(Mark(at, kind.value, _describe(record)))
    length = end_at - origin
    close_round(ended_at if ended_at is not None else length)
    spans += [Span(node, "node", joined, length, f"{node} #{inc} (still up)" if not book.ended else f"{node} #{inc}")
              for (node, inc), joined in open_nodes.items()]
    up = min([first_step if first_step is not None else length, *(r.at - origin for r in book.recoveries)])
    spans.append(Span(JOB_LANE, "waiting", 0.0, up, "start-up"))  # (a failure before the first step ends it)
    for recovery in book.recoveries:
        for phase in recovery.spans:
            if phase.seconds > 0:
                spans.append(Span(JOB_LANE, phase.phase.value, phase.start - origin, phase.end - origin,
                                  f"{_label(phase.phase)}: {recovery.cause}"))
    if ended_at is not None:
        spans.append(Span(JOB_LANE, "idle", ended_at, length, "ended"))
    missing = list(book.missing)
    if not book.ended:
        missing.append("the job has not ended: the report shows it up to "
                       + datetime.datetime.fromtimestamp(end_at).strftime("%Y-%m-%d %H:%M:%S"))
    if not rates:
        missing.append("no step rate: fewer than two step reports in one round")
    return Timeline(origin=origin, length=length, spans=tuple(spans), marks=tuple(marks), rates=tuple(rates),
                    ledger=book, ended=book.ended, missing=tuple(missing),
                    numerics=tuple(numerics_lines(good, shown=None)),
                    warnings=tuple(warning_lines(good, shown=None)))


def _label(phase: RecoveryPhase) -> str:
    return phase.value.replace("_", " ")


#: how the report's table says a recovery ended, when it did not recover
_UNFINISHED = {RecoveryOutcome.ONGOING: " (going on)", RecoveryOutcome.INTERRUPTED: " (interrupted by another failure)",
               RecoveryOutcome.RESUMED: " (the job was resumed)", RecoveryOutcome.SUCCEEDED: " (the job succeeded)",
               RecoveryOutcome.FAILED: " (the job failed)", RecoveryOutcome.STOPPED: " (the job was stopped)"}


def _timeline_figure(job: str, tl: Timeline) -> object:
    from plotly import graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.06,
                        subplot_titles=("timeline", "step rate (steps/s)"))
    lanes = [JOB_LANE, "rounds", *dict.fromkeys(s.lane for s in tl.spans if s.kind == "node")]
    for kind in dict.fromkeys(s.kind for s in tl.spans):
        chosen = [s for s in tl.spans if s.kind == kind]
        fig.add_trace(go.Bar(
            orientation="h", y=[s.lane for s in chosen], base=[s.start for s in chosen],
            x=[max(s.end - s.start, 1e-3) for s in chosen], name=kind.replace("_", " "),
            marker={"color": _COLORS.get(kind, "#9e9e9e"), "line": {"color": "white", "width": 1}},
            customdata=[s.label for s in chosen], insidetextanchor="middle", textposition="inside",
            text=[s.label.split(":")[0] if kind in ("round", "node") else "" for s in chosen],
            hovertemplate="%{customdata}<br>%{base:.2f} s + %{x:.2f} s<extra></extra>"), row=1, col=1)
    for kind in dict.fromkeys(m.kind for m in tl.marks):
        chosen_marks = [m for m in tl.marks if m.kind == kind]
        fig.add_trace(go.Scatter(
            x=[m.at for m in chosen_marks], y=[JOB_LANE] * len(chosen_marks), mode="markers", name=kind,
            marker={"color": _COLORS[kind], "size": 11, "symbol": "line-ns-open", "line": {"width": 2}},
            text=[m.text for m in chosen_marks], hovertemplate="%{x:.2f} s: %{text}<extra></extra>"), row=1, col=1)
    xs: list[float | None] = []
    ys: list[float | None] = []
    for i, (round_, t, rate) in enumerate(tl.rates):
        if i and tl.rates[i - 1][0] != round_:
            xs.append(None)  # a gap between rounds: no line across a recovery
            ys.append(None)
        xs.append(t)
        ys.append(rate)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name="steps/s", line={"color": "#2e7d32"}),
                  row=2, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)), row=1, col=1)
    fig.update_xaxes(title_text="seconds since the job was submitted", row=2, col=1)
    fig.update_layout(barmode="overlay", height=300 + 32 * len(lanes), title=f"job {job}",
                      margin={"l": 90, "r": 20, "t": 60, "b": 40})
    return fig


def _goodput_figure(book: Ledger) -> object:
    from plotly import graph_objects as go

    fig = go.Figure()
    for part in PARTS:
        seconds = book.parts[part]
        fig.add_trace(go.Bar(orientation="h", y=["wall time"], x=[seconds], name=f"{part} {seconds:.1f} s",
                             marker_color=_COLORS["checkpoint_part" if part == "checkpoint" else part]))
    fig.update_layout(barmode="stack", height=220, title=f"goodput {book.goodput:.1%} of {book.wall_s:.1f} s",
                      xaxis_title="seconds", legend={"orientation": "h", "y": -0.6},
                      margin={"l": 90, "r": 20, "t": 50, "b": 40})
    return fig


def render_html(job: str, tl: Timeline) -> str:
    """The report as one HTML document, plotly's JavaScript inlined (opens with no network)."""
    import plotly.io as pio

    book = tl.ledger
    started = (datetime.datetime.fromtimestamp(tl.origin).strftime("%Y-%m-%d %H:%M:%S") if tl.origin
               else "never submitted")
    rows = "".join(
        f"<tr><td>{html.escape(datetime.datetime.fromtimestamp(r.at).strftime('%H:%M:%S.%f')[:-3])}</td>"
        f"<td>{html.escape(r.cause)}</td><td>{html.escape(r.restored or '-')}</td>"
        + "".join(f"<td>{r.phases.get(p, 0.0):.2f}</td>" for p in RecoveryPhase)
        + f"<td>{r.seconds:.2f}{_UNFINISHED.get(r.outcome, '')}</td></tr>"
        for r in book.recoveries)
    recoveries = (
        "<table><tr><th>at</th><th>cause</th><th>restored (ranks by tier)</th>"
        + "".join(f"<th>{_label(p)} s</th>" for p in RecoveryPhase)
        + f"<th>total s</th></tr>{rows}</table>" if rows else "<p>No recoveries.</p>")
    numerics = ("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in tl.numerics) + "</ul>"
                if tl.numerics else "<p>No numerical faults.</p>")
    warned = ("<h2>Warnings before a stop</h2><ul>" + "".join(f"<li>warned {html.escape(line)}</li>"
                                                            for line in tl.warnings) + "</ul>" if tl.warnings else "")
    missing = ("<ul class='missing'>" + "".join(f"<li>{html.escape(m)}</li>" for m in tl.missing) + "</ul>"
               if tl.missing else "")
    timeline_div = pio.to_html(_timeline_figure(job, tl), full_html=False, include_plotlyjs=True,
                               div_id="timeline", config={"displaylogo": False})
    goodput_div = pio.to_html(_goodput_figure(book), full_html=False, include_plotlyjs=False, div_id="goodput",
                              config={"displaylogo": False})
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>stead report: {html.escape(job)}</title>
<style>body{{font-family:sans-serif;margin:1.5em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left}} .missing{{color:#b71c1c}}</style></head>
<body><h1>stead report: job {html.escape(job)}</h1>
<p>Submitted {html.escape(started)}; {tl.length:.1f} s shown{"" if tl.ended else " (the job has not ended)"};
goodput <b>{book.goodput:.1%}</b>; {len(book.recoveries)} recoveries; {book.useful_steps} useful steps.</p>
{missing}
{timeline_div}
{goodput_div}
<h2>Recoveries</h2>
{recoveries}
<h2>Numerical faults</h2>
{numerics}
{warned}
</body></html>
"""


def write_report(job: str, records: Iterable[Record | BadRecord], path: str, *, now: float | None = None) -> Timeline:
    """Render the job's report to ``path`` (written whole or not at all); what it drew, for a summary line."""
    drawn = timeline(records, now=now)
    page = render_html(job, drawn)
    tmp = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise PermanentError(f"cannot write the report to {path}: {exc.strerror or exc}; pass --output with a "
                             "writable path") from exc
    return drawn
