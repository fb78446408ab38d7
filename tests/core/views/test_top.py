"""`stead top`: the view of a job folded from its records, its plain lines, and the live view in a terminal."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.core.events import (
    Event,
    JobSubmitted,
    JobSucceeded,
    NodeJoined,
    Record,
    StepProgress,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.events.log import EventLog
from stead.core.store import MIN_MAX_WRITE_BYTES as LIMIT
from stead.core.store import open_store
from stead.core.store.chunked import ChunkedValue
from stead.core.views.top import follow, plain_lines, published_lines, snapshot
from stead.testing.replay import replay

#: the longest the terminal test waits for `stead top` to show something (a guard against a hang, not a timing)
WAIT_S = 60.0
SPEC = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=1)
#: a job's start as the master records it (the job machine's own follow-ups included): round 1 running
START: list[Event] = [step.event for step in replay(
    [SPEC, *(NodeJoined(node_id=n, incarnation=1) for n in ("node-0", "node-1")),
     *(WorkersStarted(node_id=n, round=1) for n in ("node-0", "node-1"))], now=0.0).steps]


def log(*timed: tuple[float, Event]) -> list[Record]:
    return [Record(seq=i, at=at, event=event) for i, (at, event) in enumerate(timed, 1)]


def test_the_view_has_the_phase_the_step_rate_the_nodes_and_the_goodput_so_far() -> None:
    failed = WorkerFailed(node_id="node-1", round=1, local_rank=0, rank=1, exit_code=1, exited_at=8.5)
    records = log(*[(i * 0.1, e) for i, e in enumerate(START)],
                  *[(2.0 + s * 0.5, StepProgress(round=1, step=s)) for s in range(1, 9)],  # 2 steps/s
                  (8.6, failed))
    view = snapshot("j", records, now=10.0, plugins=["diagnosis (at 10:00:00): no straggler"])
    assert (view.phase, view.round, view.step, view.ended) == ("recovering", 1, 8, False)
    assert view.rate == pytest.approx(2.0)
    assert [(n.node_id, n.phase, n.incarnation, n.member) for n in view.nodes] == [
        ("node-0", "joined", 1, True), ("node-1", "joined", 1, True)]
    assert view.goodput.wall_s == pytest.approx(10.0) and not view.goodput.ended
    assert view.headline() == "j: recovering, round 1, step 8, 2.00 steps/s, goodput 35.0% of 10 s"
    assert len(view.recent) == 8 and "worker.failed" in view.recent[-1]


def test_plain_lines_say_only_what_changed() -> None:
    records = log(*[(i * 0.1, e) for i, e in enumerate(START)], (2.0, StepProgress(round=1, step=1)))
    first = snapshot("j", records, now=3.0)
    lines = plain_lines(first, None, records)
    assert len(lines) == len(records) + 1 and lines[-1].startswith("j: running, round 1, step 1")
    assert plain_lines(snapshot("j", records, now=4.0), first, []) == []  # nothing new: no line
    more = [*records, Record(seq=len(records) + 1, at=4.0, event=StepProgress(round=1, step=2))]
    lines = plain_lines(snapshot("j", more, now=4.5), first, more[-1:])
    assert len(lines) == 2 and "progress.step" in lines[0] and "step 2, 0.50 steps/s" in lines[1]


async def _append_job(url: str, job: str, *, pause_s: float) -> None:
    store = await open_store(url)
    try:
        event_log = EventLog(store, job)
        for event in [*START, *(StepProgress(round=1, step=s) for s in range(1, 6))]:
            await event_log.append(event)
            await anyio.sleep(pause_s)
        await event_log.append(WorkersSucceeded(node_id="node-0", round=1))
        await event_log.append(JobSucceeded())
    finally:
        await store.close()


@pytest.mark.anyio
async def test_follow_prints_lines_until_the_job_ends(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    out = io.StringIO()
    store = await open_store(url)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _append_job(url, "j", pause_s=0.05))
            with anyio.fail_after(60):
                view = await follow(store, "j", interval_s=0.05, out=out)
    finally:
        await store.close()
    lines = out.getvalue().splitlines()
    assert view.ended and view.phase == "succeeded"
    assert lines[0].startswith("waiting for job 'j' to be submitted") or "job.submitted" in lines[0]
    assert any("job.succeeded" in line for line in lines)
    assert any(line.startswith("j: succeeded, round 1, step 5") for line in lines)
    assert lines[-1].startswith("goodput    ")  # the ledger, last
    assert "\x1b[" not in out.getvalue()  # no cursor control into a file


@pytest.mark.anyio
async def test_a_status_published_in_chunks_is_shown_whole(tmp_path: Path) -> None:
    """A plugin's status larger than one store write (the stragglers of a large job) is read through its head."""
    store = await open_store(f"sqlite:///{tmp_path / 'j.db'}", settings=Settings(store_max_write_bytes=LIMIT))
    try:
        summary = [f"straggler node-{i}: {'x' * 100}" for i in range(LIMIT // 50)]
        await ChunkedValue(store, "/stead/jobs/j/plugins/diagnosis/status").put(
            json.dumps({"summary": summary, "at": 0}).encode())
        await store.put("/stead/jobs/j/plugins/scaler/status", b'{"summary": ["resources: none yet"], "at": 0}')
        lines = await published_lines(store, "j")
    finally:
        await store.close()
    assert lines == [*(f"diagnosis (at ?): {line}" for line in summary), "scaler (at ?): resources: none yet"]


def test_stead_top_redraws_in_place_in_a_terminal_and_ends_with_the_job(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    anyio.run(_seed_start, url)
    leader, follower = pty.openpty()
    top = subprocess.Popen([sys.executable, "-m", "stead", "top", "--store", url, "--job", "j", "--interval", "0.1"],
                           cwd=tmp_path, stdin=follower, stdout=follower, stderr=subprocess.PIPE,
                           env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"})
    os.close(follower)
    shown = bytearray()

    def read_until(what: str, shows: bytes | None = None) -> None:
        """Read the terminal until it shows ``shows`` (None: until top exits and its terminal closes); a guard
        against a hang, not a timing: fails saying that ``what`` never came."""
        deadline = time.monotonic() + WAIT_S
        while shows is None or shows not in shown:
            if time.monotonic() > deadline:
                pytest.fail(f"stead top never {what} within {WAIT_S:g} s; it showed {bytes(shown)!r}")
            if select.select([leader], [], [], 0.1)[0]:
                try:
                    shown.extend(os.read(leader, 65536))
                except OSError:  # the terminal closed: top exited
                    return

    try:
        read_until("showed the job's running node", b"node-0")
        anyio.run(_finish, url)
        read_until("ended with the job")
        top.wait(WAIT_S)
    finally:
        if top.poll() is None:
            top.kill()
        top.wait()
        os.close(leader)
    text = shown.decode(errors="replace")
    assert top.returncode == 0, (text, top.stderr.read() if top.stderr else "")
    assert "\x1b[2K" in text and "\x1b[1A" in text  # the view is redrawn in place: lines erased, cursor moved up
    assert "\x1b[2J" not in text  # never a cleared screen (no flicker)
    assert "succeeded" in text and "goodput" in text and "recent events" in text


async def _seed_start(url: str) -> None:
    store = await open_store(url)
    try:
        event_log = EventLog(store, "j")
        for event in [*START, StepProgress(round=1, step=1)]:
            await event_log.append(event)
    finally:
        await store.close()


async def _finish(url: str) -> None:
    store = await open_store(url)
    try:
        event_log = EventLog(store, "j")
        for step in (2, 3):
            await event_log.append(StepProgress(round=1, step=step))
        await event_log.append(WorkersSucceeded(node_id="node-0", round=1))
        await event_log.append(JobSucceeded())
    finally:
        await store.close()
