"""The append-only event log of one job, kept in the state store.

Records live under ``/stead/jobs/<job>/events/<seq, 20 digits>``. Appends are
compare-and-put on a key that must not exist yet, so two masters racing for the
same seq cannot both win: the loser gets :class:`LogConflict`. Reads verify that
the sequence has no gap or duplicate. Snapshots of the folded state go under
``/stead/jobs/<job>/snapshot`` so a restarted master replays only the tail.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from stead.core.errors import CodecError, LogConflict, LogCorrupt
from stead.core.events.base import Event, Record, decode_record, encode_record
from stead.core.store.base import StateStore, WatchKind

__all__ = ["BadRecord", "EventLog", "Snapshot", "job_prefix"]

_SEQ_DIGITS = 20


def job_prefix(job: str) -> str:
    return f"/stead/jobs/{job}/"


@dataclasses.dataclass(frozen=True)
class BadRecord:
    """A stored record that could not be decoded (shown by ``stead events``, never folded)."""

    key: str
    seq: int | None
    error: str


@dataclasses.dataclass(frozen=True)
class Snapshot:
    seq: int
    body: dict[str, Any]


class EventLog:
    """Append, read and follow one job's events."""

    def __init__(self, store: StateStore, job: str, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.job = job
        self.prefix = job_prefix(job) + "events/"
        self._clock = clock
        self._next_seq: int | None = None

    def key(self, seq: int) -> str:
        return f"{self.prefix}{seq:0{_SEQ_DIGITS}d}"

    def _seq_of(self, key: str) -> int | None:
        tail = key[len(self.prefix):]
        return int(tail) if tail.isdigit() else None

    async def head(self) -> int:
        """The highest seq in the log (0 when empty)."""
        if self._next_seq is None:
            snapshot = await self.load_snapshot()
            start = self.key(snapshot.seq) if snapshot else None
            last = 0
            for kv in await self.store.range(self.prefix, start=start):
                seq = self._seq_of(kv.key)
                if seq is not None:
                    last = max(last, seq)
            self._next_seq = last + 1
        return self._next_seq - 1

    async def append(self, event: Event) -> Record:
        (record,) = await self.append_many([event])
        return record

    async def append_many(self, events: Sequence[Event], *, extra: Sequence[tuple[str, bytes]] = ()) -> list[Record]:
        """Append ``events`` atomically with consecutive seqs.

        ``extra`` keys are created in the same atomic step (the reactor uses it to
        record an effect id together with the event it emitted).
        """
        first = await self.head() + 1
        now = self._clock()
        records = [Record(seq=first + i, at=now, event=e) for i, e in enumerate(events)]
        items = [(self.key(r.seq), encode_record(r)) for r in records]
        if not await self.store.create_all([*items, *extra]):
            self._next_seq = None
            raise LogConflict(
                f"seq {first} of job {self.job!r} was written by another writer (or {extra[0][0] if extra else 'a key'}"
                " already exists); only one master may run per job: stop the other one, then restart this one"
            )
        self._next_seq = first + len(records)
        return records

    async def scan(self, from_seq: int = 1) -> list[Record | BadRecord]:
        """Every stored record from ``from_seq``, decoded where possible (for display)."""
        out: list[Record | BadRecord] = []
        for kv in await self.store.range(self.prefix, start=self.key(from_seq)):
            seq = self._seq_of(kv.key)
            try:
                record = decode_record(kv.value, where=kv.key)
            except CodecError as exc:
                out.append(BadRecord(key=kv.key, seq=seq, error=str(exc)))
                continue
            if record.seq != seq:
                out.append(BadRecord(key=kv.key, seq=seq, error=f"record says seq {record.seq}"))
                continue
            out.append(record)
        return out

    async def read(self, from_seq: int = 1) -> list[Record]:
        """Records from ``from_seq``, checked to be complete and in order."""
        records: list[Record] = []
        expected = from_seq
        for item in await self.scan(from_seq):
            if isinstance(item, BadRecord):
                raise LogCorrupt(
                    f"event log of job {self.job!r} is corrupt at {item.key}: {item.error}; nothing was changed. "
                    f"Inspect it with `stead events --job {self.job}`, then repair or delete that key"
                )
            if item.seq != expected:
                what = "missing" if item.seq > expected else "duplicated"
                raise LogCorrupt(
                    f"event log of job {self.job!r} has seq {expected} {what} (found {item.seq}); "
                    "the store was edited or two writers raced without compare-and-put; "
                    f"inspect it with `stead events --job {self.job}`"
                )
            records.append(item)
            expected += 1
        return records

    async def follow(self, from_seq: int = 1) -> AsyncGenerator[Record | BadRecord, None]:
        """Every record from ``from_seq`` on, then new ones as they are appended."""
        revision = await self.store.revision()
        expected = from_seq
        for item in await self.scan(from_seq):
            yield item
            if item.seq is not None:
                expected = item.seq + 1
        async for change in self.store.watch(self.prefix, start_revision=revision + 1):
            seq = self._seq_of(change.key)
            if change.kind is not WatchKind.PUT or seq is None or seq < expected:
                continue
            try:
                record = decode_record(change.value, where=change.key)
            except CodecError as exc:
                yield BadRecord(key=change.key, seq=seq, error=str(exc))
            else:
                yield record
            expected = seq + 1

    # -- snapshots -----------------------------------------------------------------

    @property
    def snapshot_key(self) -> str:
        return job_prefix(self.job) + "snapshot"

    async def save_snapshot(self, seq: int, body: dict[str, Any]) -> None:
        data = json.dumps({"seq": seq, "body": body}, separators=(",", ":")).encode()
        await self.store.put(self.snapshot_key, data)

    async def load_snapshot(self) -> Snapshot | None:
        kv = await self.store.get(self.snapshot_key)
        if kv is None:
            return None
        try:
            obj = json.loads(kv.value)
            return Snapshot(seq=int(obj["seq"]), body=dict(obj["body"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise LogCorrupt(
                f"snapshot {self.snapshot_key} of job {self.job!r} is corrupt ({exc}); "
                "delete that key and the master will replay the whole log"
            ) from exc
