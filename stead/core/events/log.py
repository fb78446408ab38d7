"""The append-only event log of one job, kept in the state store.

Records live under ``/stead/jobs/<job>/events/<seq, 20 digits>``. Appends are
compare-and-put on a key that must not exist yet, so two masters racing for the
same seq cannot both win: the loser gets :class:`LogConflict`. Reads verify that
the sequence has no gap or duplicate. Snapshots of the folded state go under
``/stead/jobs/<job>/snapshot`` so a restarted master replays only the tail; one
larger than a store write (a 10,000-node job's on etcd) is written in chunks that
become visible together (:class:`~stead.core.store.chunked.ChunkedValue`).

No write exceeds the store's ``max_write_bytes``: an event whose record alone
would is refused by :meth:`EventLog.encode` (:class:`WriteTooLarge`, naming its
kind and size) before the store is asked, and a writer that appends many events
keeps each append within :attr:`EventLog.append_budget` (see :meth:`EventLog.cost`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from stead.core.errors import CodecError, LogConflict, LogCorrupt, RetryableError, WriteTooLarge
from stead.core.events.base import EncodedEvent, Event, Record, decode_record, encode, encode_record
from stead.core.store import item_size, write_size
from stead.core.store.base import StateStore, WatchKind
from stead.core.store.chunked import ChunkedValue

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
        #: the first record of an append whose write failed without saying whether it reached the store
        self._unsure: tuple[str, bytes] | None = None
        self._snapshot = ChunkedValue(store, self.snapshot_key)
        self._key_cost = item_size(self.key(0), 0)  # every record's key has the same length

    def key(self, seq: int) -> str:
        return f"{self.prefix}{seq:0{_SEQ_DIGITS}d}"

    def _seq_of(self, key: str) -> int | None:
        tail = key[len(self.prefix):]
        return int(tail) if tail.isdigit() else None

    async def head(self) -> int:
        """The highest seq in the log (0 when empty)."""
        if self._next_seq is None:
            try:
                snapshot = await self.load_snapshot()
            except LogCorrupt:  # unusable: the reactor replays the whole log without it, and this scans it all
                snapshot = None
            start = self.key(snapshot.seq) if snapshot else None
            last = 0
            for kv in await self.store.range(self.prefix, start=start):
                seq = self._seq_of(kv.key)
                if seq is not None:
                    last = max(last, seq)
            self._next_seq = last + 1
        return self._next_seq - 1

    def encode(self, event: Event) -> EncodedEvent:
        """``event`` encoded for :meth:`append_many`; WriteTooLarge when its record alone exceeds a store write."""
        encoded = encode(event)
        if self.cost(encoded) > self.append_budget:
            raise WriteTooLarge(
                f"event {event.type_name} of job {self.job!r} is {encoded.record_bytes} bytes encoded, more than "
                f"one write to {self.store.url} takes ({self.store.max_write_bytes} bytes, store_max_write_bytes); "
                "it was not recorded: put less in one event (a shorter text, or several events)")
        return encoded

    def cost(self, encoded: EncodedEvent) -> int:
        """What a record of ``encoded`` adds to the store write of an append, at most."""
        return self._key_cost + encoded.record_bytes

    @property
    def append_budget(self) -> int:
        """The most the records of one append may cost together (:meth:`cost`): what a store write takes."""
        return self.store.max_write_bytes - write_size(())

    async def append(self, event: Event) -> Record:
        (record,) = await self.append_many([event])
        return record

    async def append_many(self, events: Sequence[Event | EncodedEvent], *,
                          extra: Sequence[tuple[str, bytes]] = ()) -> list[Record]:
        """Append ``events`` atomically with consecutive seqs (WriteTooLarge, nothing appended, if they are more
        than one store write takes: see :meth:`cost`).

        ``extra`` keys are created in the same atomic step (the reactor uses it to
        record an effect id together with the event it emitted).
        """
        encoded = [e if isinstance(e, EncodedEvent) else self.encode(e) for e in events]
        if self._unsure is not None:
            await self._settle_unsure()
        first = await self.head() + 1
        now = self._clock()
        records = [Record(seq=first + i, at=now, event=e.event) for i, e in enumerate(encoded)]
        items = [(self.key(r.seq), encode_record(r, e)) for r, e in zip(records, encoded, strict=True)]
        try:
            created = await self.store.create_all([*items, *extra])
        except RetryableError:
            # a write that timed out may still have been applied: find out now, or before the next append
            self._unsure = items[0]
            try:
                landed = await self._landed(*items[0])
            except RetryableError:
                landed = False
            if not landed:
                raise
            self._unsure = None
            created = True
        if not created:
            self._next_seq = None
            raise LogConflict(
                f"seq {first} of job {self.job!r} was written by another writer (or {extra[0][0] if extra else 'a key'}"
                " already exists); only one master may run per job: stop the other one, then restart this one"
            )
        self._next_seq = first + len(records)
        return records

    async def _landed(self, key: str, value: bytes) -> bool:
        """Whether this writer's record ``value`` is stored at ``key`` (the record's time makes it its own)."""
        found = await self.store.get(key)
        return found is not None and found.value == value

    async def _settle_unsure(self) -> None:
        """Before appending after a write that failed without an answer: LogConflict when it did land (the caller
        was told it failed, so the log holds records the caller's state lacks); the store's error while it
        cannot say."""
        assert self._unsure is not None
        key, value = self._unsure
        if await self._landed(key, value):
            raise LogConflict(
                f"an append to the event log of job {self.job!r} reached the store ({key}) after its write was "
                "reported failed (the store timed out), so this master's state lacks it: the master stops and "
                "the next one replays the whole log (`stead run` starts it)")
        self._unsure = None
        self._next_seq = None  # read the head again

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
        """Replace the snapshot; a reader sees the previous one until the whole of this one is stored."""
        data = json.dumps({"seq": seq, "body": body}, separators=(",", ":")).encode()
        await self._snapshot.put(data)

    async def load_snapshot(self) -> Snapshot | None:
        """The newest complete snapshot (one stored whole by any stead version), or None."""
        try:
            raw = await self._snapshot.get()
        except CodecError as exc:
            raise LogCorrupt(f"snapshot of job {self.job!r} is unreadable: {exc}") from exc
        if raw is None:
            return None
        try:
            obj = json.loads(raw)
            return Snapshot(seq=int(obj["seq"]), body=dict(obj["body"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise LogCorrupt(
                f"snapshot {self.snapshot_key} of job {self.job!r} is corrupt ({exc}); "
                "delete that key and the master will replay the whole log"
            ) from exc
