"""The master's book of flash checkpoints: pure functions, no IO, no clock.

Every report says, for some ranks of a round, the newest step each rank *passed*
(it called save(): it either saved the step or skipped it) and the steps it *holds*
in memory. A step is committed when every rank of the round holds it; the newest
such step wins. A rank's newest held step that is not committed is *pending*: the
rank keeps it until it is committed or released. It is released when another rank
of the round passed it without keeping it: then it can never be committed, and the
rank may overwrite it. Reports of an older round are ignored; a newer round starts
a fresh set of holdings (memory written in earlier rounds is not reported again).

Disk reports count the ranks that wrote each step; the step is persisted when all
ranks of the world did.

Reports may say how long a rank took (its save() copy, its disk write). A step is
as slow as its slowest rank, so the book keeps the longest of each step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

__all__ = ["Book", "Holding", "disk_report", "memory_report", "released", "save_seconds"]

_DISK_STEPS_KEPT = 32


@dataclasses.dataclass(frozen=True)
class Holding:
    passed: int
    steps: frozenset[int]
    #: step -> seconds the rank's save() took to copy it (where known)
    seconds: Mapping[int, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Book:
    #: the newest round reported, its world size and its ranks' holdings
    round: int = 0
    world_size: int = 0
    holdings: Mapping[int, Holding] = dataclasses.field(default_factory=dict)
    #: the committed step of ``round`` (-1 when none yet)
    round_step: int = -1
    #: the latest committed step of any round, and that round (what a restart restores)
    step: int = -1
    step_round: int = 0
    #: disk: step -> ranks that wrote it, and the world size they wrote it in
    disk: Mapping[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    disk_world: Mapping[int, int] = dataclasses.field(default_factory=dict)
    #: disk: step -> the longest write among the ranks that reported one
    disk_s: Mapping[int, float] = dataclasses.field(default_factory=dict)
    persisted: int = -1


def memory_report(book: Book, *, round_: int, world_size: int,
                  ranks: Mapping[int, Holding]) -> tuple[Book, int | None]:
    """Fold a memory report in; returns the new book and the step it commits (None: no new commit)."""
    if round_ < book.round:
        return book, None
    if round_ > book.round or world_size != book.world_size:
        book = dataclasses.replace(book, round=round_, world_size=world_size, holdings={}, round_step=-1)
    holdings = {**book.holdings, **ranks}
    book = dataclasses.replace(book, holdings=holdings)
    if any(r not in holdings for r in range(world_size)):
        return book, None
    common = frozenset.intersection(*(holdings[r].steps for r in range(world_size)))
    if not common or max(common) <= book.round_step:
        return book, None
    step = max(common)
    return dataclasses.replace(book, round_step=step, step=step, step_round=round_), step


def released(book: Book, ranks: Iterable[int]) -> dict[int, int]:
    """The pending step of each of ``ranks`` that can never be committed (rank -> step)."""
    out: dict[int, int] = {}
    for rank in ranks:
        mine = book.holdings.get(rank)
        if mine is None or not mine.steps:
            continue
        pending = max(mine.steps)
        if pending <= book.round_step:
            continue
        if any(pending not in other.steps and other.passed >= pending for other in book.holdings.values()):
            out[rank] = pending
    return out


def save_seconds(book: Book, step: int) -> float | None:
    """How long the slowest rank of the book's round took to copy ``step`` (None: no rank said)."""
    return max((h.seconds[step] for h in book.holdings.values() if step in h.seconds), default=None)


def disk_report(book: Book, *, step: int, world_size: int, ranks: Iterable[int],
                seconds: float | None = None) -> tuple[Book, bool]:
    """Fold in ranks that wrote ``step`` (the slowest of them in ``seconds``); True when it completes the step."""
    same_world = book.disk_world.get(step) == world_size
    before = book.disk.get(step, frozenset()) if same_world else frozenset()
    after = before | frozenset(ranks)
    complete = len(before) < world_size <= len(after) and all(r in after for r in range(world_size))
    slowest = [t for t in (seconds, book.disk_s.get(step) if same_world else None) if t is not None]
    keep = sorted({*book.disk, step})[-_DISK_STEPS_KEPT:]  # the book stays small on a long job
    disk = {s: (after if s == step else book.disk[s]) for s in keep}
    disk_s = {s: t for s, t in book.disk_s.items() if s in keep and s != step}
    if slowest:
        disk_s[step] = max(slowest)
    book = dataclasses.replace(book, disk=disk, disk_s=disk_s,
                               disk_world={s: (world_size if s == step else book.disk_world[s]) for s in keep})
    if complete:
        book = dataclasses.replace(book, persisted=max(book.persisted, step))
    return book, complete
