"""A job's report: the timeline folded from recorded event logs, the HTML it renders, and `stead report`."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import anyio
import pytest

from stead.core.events import (
    Event,
    JobSubmitted,
    JobSucceeded,
    NodeJoined,
    NodeLost,
    NumericsNote,
    NumericsReported,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    WorkerFailed,
    WorkersSucceeded,
)
from stead.core.events.log import BadRecord, EventLog
from stead.core.store import open_store
from stead.core.views.goodput import RECOVERY_PHASES
from stead.core.views.report import JOB_LANE, render_html, timeline
from stead.plugins.ckpt.events import CheckpointRestored

T0 = 1_700_000_000.0
SPEC = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=1)


def log(*timed: tuple[float, Event]) -> list[Record]:
    return [Record(seq=i, at=T0 + at, event=event) for i, (at, event) in enumerate(timed, 1)]


def round_of(n: int, at: float, members: tuple[str, ...] = ("node-0", "node-1")) -> list[tuple[float, Event]]:
    return [(at, RoundStarted(round=n, members=members, nproc_per_node=1, restart_count=n - 1)),
            (at + 0.5, RoundCompleted(round=n))]


def crash_then_node_loss() -> list[Record]:
    """Two nodes; a worker crash at 12.4 s (restart), then node-1 lost at 20 s and relaunched as #2."""
    failed = WorkerFailed(node_id="node-1", round=1, local_rank=0, rank=1, exit_code=1, exited_at=T0 + 12.4)
    return log((0.0, SPEC), (0.5, NodeJoined(node_id="node-0", incarnation=1)),
               (0.6, NodeJoined(node_id="node-1", incarnation=1)), *round_of(1, 2.0),
               *[(3.0 + s, StepProgress(round=1, step=s + 1)) for s in range(10)],  # 1 step/s
               (12.45, failed), (12.5, RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="crash")),
               *round_of(2, 12.6), (13.2, CheckpointRestored(round=2, step=6)),
               *[(13.5 + s * 0.5, StepProgress(round=2, step=7 + s)) for s in range(8)],
               (20.0, NodeLost(node_id="node-1", incarnation=1, reason="no heartbeat")),
               (21.0, NodeJoined(node_id="node-1", incarnation=2)), *round_of(3, 21.5),
               (22.2, CheckpointRestored(round=3, step=14)),
               *[(22.5 + s, StepProgress(round=3, step=15 + s)) for s in range(3)],
               (25.0, WorkersSucceeded(node_id="node-0", round=3)), (25.5, JobSucceeded()))


def test_the_timeline_has_rounds_nodes_recovery_phases_marks_and_step_rates() -> None:
    tl = timeline(crash_then_node_loss())
    assert tl.origin == T0 and tl.length == pytest.approx(25.5) and tl.ended and tl.missing == ()
    rounds = [s for s in tl.spans if s.lane == "rounds"]
    assert [(round(s.start, 3), round(s.end, 3)) for s in rounds] == [(2.0, 12.6), (12.6, 21.5), (21.5, 25.5)]
    assert rounds[0].label == "round 1: node-0, node-1"
    node_1 = sorted((round(s.start, 3), round(s.end, 3), s.label) for s in tl.spans if s.lane == "node-1")
    assert node_1 == [(0.6, 20.0, "node-1 #1"), (21.0, 25.5, "node-1 #2")]  # relaunched: a new incarnation
    job_lane = [s for s in tl.spans if s.lane == JOB_LANE]
    assert job_lane[0].kind == "waiting" and (job_lane[0].start, job_lane[0].end) == pytest.approx((0.0, 3.0))
    assert job_lane[-1].kind == "idle" and job_lane[-1].start == pytest.approx(25.5)
    # the recovery spans tile each recovery: they begin at its failure and add up to the ledger's phases
    phases = [s for s in job_lane if s.kind in RECOVERY_PHASES]
    assert phases[0].start == pytest.approx(12.4) and phases[0].kind == "detect"
    for earlier, later in itertools.pairwise(phases):
        assert later.start == pytest.approx(earlier.end) or later.start > earlier.end
    for phase in RECOVERY_PHASES:
        drawn = sum(s.end - s.start for s in phases if s.kind == phase)
        assert drawn == pytest.approx(tl.ledger.recovery_phases[phase])
    assert [(m.kind, m.text.split()[0]) for m in tl.marks] == [
        ("failure", "worker.failed"), ("decision", "recovery.decided"), ("checkpoint", "ckpt.restored"),
        ("failure", "node.lost"), ("checkpoint", "ckpt.restored")]
    assert {(n, round(rate, 3)) for n, _, rate in tl.rates} == {(1, 1.0), (2, 2.0), (3, 1.0)}
    assert all(t > 3.0 for _, t, _ in tl.rates)


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.script_sources: list[str] = []
        self.inline_script = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(str(found["id"]))
        if tag == "script" and found.get("src"):
            self.script_sources.append(str(found["src"]))

    def handle_data(self, data: str) -> None:
        if "Plotly.newPlot" in data or "plotly.js" in data:
            self.inline_script += 1
        self.text.append(data)


def test_the_html_is_one_self_contained_document_with_the_timeline_and_the_breakdown() -> None:
    page = render_html("j<b>", timeline(crash_then_node_loss()))
    parsed = _Page()
    parsed.feed(page)
    assert {"timeline", "goodput"} <= parsed.ids
    assert parsed.script_sources == []  # plotly inlined: opens with no network
    assert parsed.inline_script >= 2
    text = " ".join(parsed.text)
    assert "stead report: job j<b>" in text  # the job name escaped, shown as text
    assert "worker failed on node-1 (rank 1)" in text and "node node-1 lost: no heartbeat" in text


@pytest.mark.parametrize("case", ["never submitted", "never stepped", "corrupt record", "still running"])
def test_a_partial_log_gives_a_report_that_says_what_is_missing(case: str) -> None:
    records: list[Record | BadRecord] = []
    now = None
    if case == "never stepped":
        records = [*log((0.0, SPEC), *round_of(1, 1.0), (5.0, JobSucceeded()))]
    elif case == "corrupt record":
        records = [*log((0.0, SPEC), *round_of(1, 1.0), (2.0, StepProgress(round=1, step=1)),
                        (3.0, StepProgress(round=1, step=2)), (4.0, JobSucceeded())),
                   BadRecord(key="/stead/jobs/j/events/00000000000000000007", seq=7, error="not JSON")]
    elif case == "still running":
        records = [*log((0.0, SPEC), *round_of(1, 1.0), (2.0, StepProgress(round=1, step=1)),
                        (3.0, StepProgress(round=1, step=2)))]
        now = T0 + 10.0
    tl = timeline(records, now=now)
    expected = {"never submitted": "never submitted", "never stepped": "no step progress",
                "corrupt record": "1 unreadable record", "still running": "has not ended"}[case]
    assert any(expected in m for m in tl.missing), tl.missing
    if case == "still running":
        assert tl.length == pytest.approx(10.0) and not tl.ended
    page = render_html("j", tl)  # still a page, saying it
    assert expected in page and 'id="timeline"' in page


async def _seed(url: str, job: str, records: list[Record]) -> None:
    store = await open_store(url)
    try:
        event_log = EventLog(store, job)
        for record in records:
            await event_log.append(record.event)
        await store.put(event_log.key(len(records) + 1), b"{torn")  # a record cut short by a crash
    finally:
        await store.close()


def _stead(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stead", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_stead_report_writes_the_page_and_says_what_it_could_not_show(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    anyio.run(_seed, url, "j", crash_then_node_loss())
    result = _stead("report", "--store", url, "--job", "j", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    path = tmp_path / ".stead" / "j-report.html"
    assert f"written to {Path('.stead') / 'j-report.html'}" in result.stdout
    assert "(not shown: 1 unreadable record(s)" in result.stdout
    parsed = _Page()
    parsed.feed(path.read_text())
    assert "timeline" in parsed.ids
    assert not list(tmp_path.glob("**/*.tmp"))
    unknown = _stead("report", "--store", url, "--job", "other", "-o", str(tmp_path / "x.html"), cwd=tmp_path)
    assert unknown.returncode == 1 and "no job 'other'" in unknown.stderr and "Traceback" not in unknown.stderr
    assert not (tmp_path / "x.html").exists()
    unwritable = _stead("report", "--store", url, "--job", "j", "-o", str(tmp_path / "j.db" / "r.html"),
                        cwd=tmp_path)
    assert unwritable.returncode == 1 and "cannot write the report" in unwritable.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (Debian's package chromium renders the report)")
def test_chromium_renders_the_report_headless_with_its_timeline(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(render_html("j", timeline(crash_then_node_loss())))
    assert CHROMIUM is not None
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = _Page()
    rendered.feed(dom.stdout)
    assert "timeline" in rendered.ids
    # plotly drew it: the div holds the plot's SVG layers, with one bar per lane kind among them
    assert 'id="timeline"' in dom.stdout and "js-plotly-plot" in dom.stdout and "main-svg" in dom.stdout
    assert ">detect<" in dom.stdout  # the legend names the recovery phases


def test_the_report_lists_the_numerical_faults_as_stead_status_does() -> None:
    failed = WorkerFailed(node_id="node-1", round=1, local_rank=0, rank=1, exit_code=1, exited_at=T0 + 5.4)
    nan = RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="nan", rank=1, rule="non-finite-gradient",
                          failure_class="numerical", skip_steps=(4,),
                          evidence="NonFiniteGradientError: ... on rank 1 (host h<1>) at step 4: ...")
    records = log((0.0, SPEC), *round_of(1, 1.0), *[(2.0 + s, StepProgress(round=1, step=s)) for s in range(4)],
                  (5.45, failed), (5.5, nan), *round_of(2, 5.6),
                  (6.0, NumericsReported(node_id="node-0", round=2, notes=(
                      NumericsNote(kind="step_skipped", rank=0, step=4),))), (7.0, JobSucceeded()))
    tl = timeline(records)
    assert tl.numerics == ("step 4 skipped from round 2 on: a non-finite gradient on rank 1 (host h<1>) "
                           "(non-finite-gradient)", "step 4 skipped by the workers of round 2 (rank 0 says): samples "
                           "unknown (not read with stead's sampler)")
    parsed = _Page()
    parsed.feed(render_html("j", tl))
    text = " ".join(parsed.text)
    assert "Numerical faults" in text and "(host h<1>)" in text  # escaped, shown as text
    clean = _Page()
    clean.feed(render_html("j", timeline(crash_then_node_loss())))
    assert "No numerical faults." in " ".join(clean.text)
