"""``stead top``: a live view of a running job, read from its store (no RPC to the master).

:func:`snapshot` folds what the store holds into a :class:`View` (pure); :func:`render` draws it
with ``rich`` for a terminal, redrawn in place; :func:`plain_lines` says what changed since the
last view, one line each, for a pipe, a log file or a terminal without cursor control. The view:
the job's phase, round and step, its step rate, the goodput so far with its breakdown, each node
with its state, incarnation and last diagnosis, the plugins' own lines and the latest events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from stead.core.errors import CodecError
from stead.core.events import Record
from stead.core.events.log import BadRecord, EventLog
from stead.core.statemachine import JobState, fold_all
from stead.core.store import StateStore
from stead.core.store.chunked import ChunkedValue
from stead.core.views.display import format_record, goodput_lines, last_diagnoses
from stead.core.views.goodput import Ledger, ledger, step_rates

__all__ = ["NodeRow", "View", "follow", "plain_lines", "published_lines", "render", "snapshot"]

#: the latest events shown
RECENT = 8
#: the step rate is averaged over the round's reports of this many seconds
RATE_WINDOW_S = 30.0


@dataclasses.dataclass(frozen=True)
class NodeRow:
    node_id: str
    phase: str
    incarnation: int
    #: in the running round (its step rate is the round's: every rank steps together)
    member: bool
    last_failure: str


@dataclasses.dataclass(frozen=True)
class View:
    job: str
    phase: str
    reason: str
    round: int
    step: int | None
    #: steps per second over the running round's last reports (None: not measured yet)
    rate: float | None
    goodput: Ledger
    nodes: tuple[NodeRow, ...]
    plugins: tuple[str, ...]
    recent: tuple[str, ...]
    ended: bool

    def headline(self) -> str:
        rate = f"{self.rate:.2f} steps/s" if self.rate is not None else "- steps/s"
        step = self.step if self.step is not None else "-"
        book = self.goodput
        good = f"goodput {book.goodput:.1%} of {book.wall_s:.0f} s" if book.wall_s > 0 else "goodput -"
        return f"{self.job}: {self.phase}, round {self.round}, step {step}, {rate}, {good}"


def _rate(records: Sequence[Record | BadRecord], round_: int) -> float | None:
    rates = [(t, r) for n, t, r in step_rates(records) if n == round_]
    if not rates:
        return None
    recent = [r for t, r in rates if t >= rates[-1][0] - RATE_WINDOW_S]
    return sum(recent) / len(recent)


def snapshot(job: str, items: Sequence[Record | BadRecord], *, now: float, plugins: Iterable[str] = ()) -> View:
    """The view of a job from its records (in log order) and its plugins' published lines."""
    records = [r for r in items if isinstance(r, Record)]
    state: JobState = fold_all(records)
    diagnoses = last_diagnoses(records)
    members = set(state.rdzv.members)
    nodes = tuple(NodeRow(node_id, node.phase.value, node.incarnation, node_id in members,
                          diagnoses.get(node_id, "")) for node_id, node in state.nodes.items())
    book = ledger(items, now=now)
    return View(job=job, phase=state.phase.value, reason=state.reason, round=state.rdzv.round, step=state.step,
                rate=_rate(items, state.rdzv.round), goodput=book, nodes=nodes, plugins=tuple(plugins),
                recent=tuple(format_record(r) for r in items[-RECENT:]), ended=book.ended)


def render(view: View) -> RenderableType:
    """The view as rich renderables: a headline, the goodput lines, a node table, plugin lines, recent events."""
    head = Text(view.headline(), style="bold")
    if view.reason:
        head.append(f"  ({view.reason})", style="dim")
    nodes = Table(expand=False, box=None, pad_edge=False, header_style="bold")
    for column in ("node", "state", "inc", "step rate", "last diagnosis"):
        nodes.add_column(column)
    for row in view.nodes:
        rate = f"{view.rate:.2f}/s" if row.member and view.rate is not None and not view.ended else "-"
        style = "green" if row.phase == "joined" else ("red" if row.phase in ("lost", "exited") else "")
        nodes.add_row(row.node_id, Text(row.phase, style=style), str(row.incarnation), rate,
                      Text(row.last_failure[:90], style="yellow"))
    parts: list[RenderableType] = [head, *(Text(line) for line in goodput_lines(view.goodput)), nodes]
    parts += [Text(line, style="cyan") for line in view.plugins]
    parts += [Text("recent events", style="bold"), *(Text(line, style="dim") for line in view.recent)]
    return Group(*parts)


def plain_lines(view: View, before: View | None, fresh: Sequence[Record | BadRecord]) -> list[str]:
    """What changed since ``before``: each of the ``fresh`` records, then the headline when the job moved."""
    lines = [format_record(item) for item in fresh]
    if before is None:
        return [*lines, view.headline()]
    moved = (view.phase, view.round, view.step, [n.phase for n in view.nodes]) != (
        before.phase, before.round, before.step, [n.phase for n in before.nodes])
    return [*lines, *([view.headline()] if moved or lines else [])]


async def published_lines(store: StateStore, job: str) -> list[str]:
    """The lines the job's plugins published for `stead status` (each plugin's ``status`` key, chunked or not)."""
    from stead.core.views.display import plugin_status_lines

    prefix = f"/stead/jobs/{job}/plugins/"
    lines: list[str] = []
    for kv in await store.range(prefix):
        if kv.key.endswith("/status"):
            try:
                raw = await ChunkedValue(store, kv.key).value_of(kv) or b""
            except CodecError:
                raw = b""  # shown as unreadable
            lines += plugin_status_lines(kv.key[len(prefix):].split("/")[0], raw)
    return lines


async def follow(store: StateStore, job: str, *, interval_s: float = 1.0, out: TextIO | None = None,
                 plain: bool | None = None) -> View:
    """Show the job until it ends (or the caller is cancelled); ``plain``: lines instead of a redrawn view
    (default: when ``out`` is not a terminal). Returns the last view."""
    out = out or sys.stdout
    console = Console(file=out)
    plain = not console.is_terminal if plain is None else plain
    event_log = EventLog(store, job)
    items: list[Record | BadRecord] = []
    waiting = False

    async def refresh() -> list[Record | BadRecord] | None:
        """The records appended since the last refresh (None: the job has none yet)."""
        nonlocal waiting
        after = max((item.seq or 0 for item in items), default=0)
        fresh = await event_log.scan(after + 1)
        items.extend(fresh)
        if not items:
            if not waiting:
                print(f"waiting for job {job!r} to be submitted to {store.url} (Ctrl-C to stop)", file=out,
                      flush=True)
                waiting = True
            return None
        return fresh

    async def look() -> View:
        return snapshot(job, items, now=time.time(), plugins=await published_lines(store, job))

    fresh = await refresh()
    while fresh is None:  # a job started after its view: say so once, then wait for its first record
        await asyncio.sleep(interval_s)
        fresh = await refresh()
    view = await look()
    if plain:
        before: View | None = None
        while True:
            for line in plain_lines(view, before, fresh):
                print(line, file=out, flush=True)
            if view.ended:
                break
            await asyncio.sleep(interval_s)
            fresh = await refresh() or []
            before, view = view, await look()
        for line in goodput_lines(view.goodput):
            print(line, file=out, flush=True)
        return view
    with Live(render(view), console=console, refresh_per_second=4, auto_refresh=False) as live:
        while not view.ended:
            await asyncio.sleep(interval_s)
            await refresh()
            view = await look()
            live.update(render(view), refresh=True)
    return view
