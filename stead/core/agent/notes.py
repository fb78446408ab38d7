"""The agent's side of the workers' numerical notes: new lines of ``<progress file>.events``, checked, for the master.

Each worker appends JSON lines (:mod:`stead.core.worker.notes`); :class:`NotesReader` reads what is new since its
last look (at most :data:`MAX_READ_BYTES` a file a look), keeps a line that has no newline yet for the next look,
and turns each complete line into a :class:`~stead.core.events.NumericsNote`. A line that is not one (not JSON,
an unknown kind, a field of the wrong type, longer than :data:`MAX_LINE_BYTES`, a step_skipped note's samples
over their bounds or naming impossible slots) is refused with a log line saying why and counted; it never stops
the agent. Notes wait in a bounded queue for the agent's next report; what overflows it is counted too, and the
counts go to the master with the notes (``dropped``).
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from stead.core.events import (
    MAX_NOTES_PER_REPORT,
    MAX_SAMPLE_RANGES,
    MAX_SAMPLE_SETS,
    NOTE_KINDS,
    NumericsNote,
    StepSamples,
)
from stead.core.worker.notes import MAX_LINE_BYTES, NOTES_SUFFIX

__all__ = ["MAX_PENDING_NOTES", "MAX_READ_BYTES", "NotesReader", "parse_note"]

log = structlog.get_logger("stead.agent.notes")

#: what one look reads of one worker's notes at most (the rest waits for the next look)
MAX_READ_BYTES = 64 * 1024
#: notes waiting for a report at most; more are counted as dropped
MAX_PENDING_NOTES = 8 * MAX_NOTES_PER_REPORT
_ACTIONS = ("", "record", "skip")


def parse_note(line: bytes) -> NumericsNote:
    """The note a worker's line holds; ValueError saying what is wrong with it."""
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"a line of {len(line)} bytes, over {MAX_LINE_BYTES}")
    try:
        data = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"not a JSON object but {type(data).__name__}")
    kind = data.get("kind")
    if kind not in NOTE_KINDS:
        raise ValueError(f"kind {str(kind)[:40]!r} is not one of {', '.join(NOTE_KINDS)}")
    unknown = sorted(set(data) - {"kind", "rank", "step", "loss", "median", "score", "action", "round", "samples"})
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)[:80]}")
    action = data.get("action", "")
    if action not in _ACTIONS:
        raise ValueError(f"action {str(action)[:40]!r} is not record or skip")
    samples = data.get("samples")
    if samples is not None and kind != "step_skipped":
        raise ValueError(f"a {kind} note names no samples (only step_skipped does)")
    return NumericsNote(kind=kind, rank=_count(data, "rank"), step=_count(data, "step"), loss=_figure(data, "loss"),
                        median=_figure(data, "median"), score=_figure(data, "score"), action=action,
                        round=_round(data), samples=None if samples is None else _samples(samples))


#: the longest dataset name (the sharding plugin's bound)
_MAX_DATASET_CHARS = 200


def _samples(value: Any) -> tuple[StepSamples, ...]:
    """A step_skipped note's ``samples``: ``[[dataset, count, [[part, start, end], ...]], ...]`` within the bounds."""
    if not isinstance(value, list) or len(value) > MAX_SAMPLE_SETS:
        raise ValueError(f"samples {str(value)[:40]!r} is not a list of at most {MAX_SAMPLE_SETS} datasets")
    sets: list[StepSamples] = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 3):
            raise ValueError(f"samples entry {str(item)[:40]!r} is not [dataset, count, ranges]")
        name, count, ranges = item
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_DATASET_CHARS:
            raise ValueError(f"samples dataset {str(name)[:40]!r} is not a name of 1 to {_MAX_DATASET_CHARS} "
                             "characters")
        if not isinstance(ranges, list) or len(ranges) > MAX_SAMPLE_RANGES:
            raise ValueError(f"samples ranges of {name[:40]!r} are not a list of at most {MAX_SAMPLE_RANGES} ranges")
        named = StepSamples(dataset=name, count=_count({"count": count}, "count"),
                            ranges=tuple(_range(name, r) for r in ranges))
        if named.named > named.count:
            raise ValueError(f"samples ranges of {name[:40]!r} name {named.named} samples, more than its count "
                             f"{named.count}")
        sets.append(named)
    return tuple(sets)


def _range(name: str, value: Any) -> tuple[int, int, int]:
    if not (isinstance(value, list) and len(value) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ValueError(f"samples range {str(value)[:40]!r} of {name[:40]!r} is not [part, start, end]")
    part, start, end = value
    if not (0 <= part < 2**63 and 0 <= start < end < 2**63):
        raise ValueError(f"samples range {value!r} of {name[:40]!r} is not part >= 0 and 0 <= start < end")
    return part, start, end


def _count(data: Mapping[str, Any], name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise ValueError(f"{name} {str(value)[:40]!r} is not a count from 0")
    return value


def _round(data: Mapping[str, Any]) -> int | None:
    if data.get("round") is None:
        return None
    value = _count(data, "round")
    if value >= 2**31:  # an int32 on the wire
        raise ValueError(f"round {value} is past 2**31")
    return value


def _figure(data: Mapping[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} {str(value)[:40]!r} is not a finite number or null")
    return float(value)


class NotesReader:
    """New notes of a node's workers (module doc); ``paths``: local rank -> progress file."""

    def __init__(self, paths: Mapping[int, str | Path]) -> None:
        self._files = {rank: Path(f"{path}{NOTES_SUFFIX}") for rank, path in paths.items()}
        self._offsets = dict.fromkeys(self._files, 0)
        self.pending: collections.deque[NumericsNote] = collections.deque()
        #: notes refused or overflowed since the last :meth:`take`
        self.dropped = 0

    def look(self) -> None:
        """Read what the workers wrote since the last look into :attr:`pending`."""
        for rank, path in self._files.items():
            try:
                with open(path, "rb") as handle:
                    handle.seek(self._offsets[rank])
                    chunk = handle.read(MAX_READ_BYTES)
            except OSError:
                continue  # no note yet (the file is made by the first one)
            consumed = 0
            while (end := chunk.find(b"\n", consumed)) >= 0:
                self._take_line(rank, chunk[consumed:end])
                consumed = end + 1
            if consumed == 0 and len(chunk) >= MAX_READ_BYTES:  # one line longer than a whole read: skip it all
                self._refuse(rank, chunk[:80], f"a line over {MAX_READ_BYTES} bytes")
                consumed = len(chunk)
            self._offsets[rank] += consumed

    def _take_line(self, rank: int, line: bytes) -> None:
        try:
            note = parse_note(line)
        except ValueError as exc:
            self._refuse(rank, line[:80], str(exc))
            return
        if len(self.pending) >= MAX_PENDING_NOTES:
            self.dropped += 1
            return
        self.pending.append(note)

    def _refuse(self, rank: int, start: bytes, why: str) -> None:
        self.dropped += 1
        log.warning("worker_note_refused", local_rank=rank, why=why, line=start.decode(errors="replace"),
                    file=os.fspath(self._files[rank]))

    def take(self) -> tuple[tuple[NumericsNote, ...], int]:
        """Up to :data:`MAX_NOTES_PER_REPORT` pending notes and the count dropped since the last take, for a
        report (nothing when both are none)."""
        count = min(len(self.pending), MAX_NOTES_PER_REPORT)
        notes = tuple(self.pending.popleft() for _ in range(count))
        dropped, self.dropped = self.dropped, 0
        return notes, dropped
