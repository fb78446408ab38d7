"""A dataset's ledger in the state store: a group-committed journal of ops plus snapshots.

Keys, under the plugin's own prefix for the dataset::

    spec                          the dataset's definition (created once)
    snapshot                      {"segment": k, "covered": n, "ledger": {...}}: the ledger after n ops
    journal/<k:06d>/<seq:012d>    {"first": i, "ops": [...]}: ops i, i+1, ... in segment k

Every RPC that changes the ledger applies its ops in memory, then waits for
:meth:`Journal.flush` before it answers: concurrent calls share one store write
(group commit), so a lease is durable before the worker sees it and a restarted
master loses none; ops more than one store write takes (``max_write_bytes``: the
leases of thousands of workers at once, on etcd) go in several records. Journal
keys are created, never overwritten, so a second master writing the same journal
fails instead of forking it. Every ``snapshot_every`` records the ledger is
written whole (in chunks when it is larger than a store write: a ledger of tens of
thousands of workers' streams is megabytes) and the older segment deleted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import structlog

from stead.plugin import ChunkedValue, CodecError, LogCorrupt, StateStore, StoreError, write_size
from stead.plugins.sharding.ledger import Ledger, Op, decode_op, encode_op

__all__ = ["Journal", "load_ledger"]

log = structlog.get_logger("stead.plugins.sharding")


def _dumps(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


class Journal:
    def __init__(self, store: StateStore, prefix: str, *, segment: int, seq: int, covered: int,
                 snapshot_every: int, state: Callable[[], dict[str, Any]]) -> None:
        self._store = store
        self._prefix = prefix
        self._segment = segment
        self._seq = seq
        self._snapshot_every = max(1, snapshot_every)
        self._state = state
        self._snapshots = ChunkedValue(store, f"{prefix}/snapshot")
        self._pending: list[Any] = []
        self._added = covered  # ops applied in memory
        self._durable = covered  # ops in the store
        self._lock = asyncio.Lock()

    def add(self, op: Op) -> None:
        self._pending.append(encode_op(op))
        self._added += 1

    @property
    def behind(self) -> int:
        """Ops applied in memory but not yet in the store."""
        return self._added - self._durable

    async def flush(self) -> None:
        """Return once every op added so far is in the store (written together with the other callers')."""
        target = self._added
        while self._durable < target:
            async with self._lock:
                if self._durable >= target:
                    return
                await self._write()

    async def _write(self) -> None:
        first = self._durable
        key = f"{self._prefix}/journal/{self._segment:06d}/{self._seq + 1:012d}"
        batch, record = self._record(key, first)
        self._pending = self._pending[len(batch):]
        try:
            created = await self._store.compare_and_put(key, record, expected_mod_revision=0)
        except BaseException:
            self._pending[:0] = batch  # written by the next flush (or found written: see _own_record)
            raise
        written = len(batch) if created else await self._own_record(key, first, batch)
        self._pending[:0] = batch[written:]
        self._seq += 1
        self._durable = first + written
        if self._seq >= self._snapshot_every:
            await self._snapshot()

    def _record(self, key: str, first: int) -> tuple[list[Any], bytes]:
        """The pending ops that one record at ``key`` holds within a store write (at least one), and the record."""
        room = self._store.max_write_bytes - write_size([(key, 0)])
        record = _dumps({"first": first, "ops": self._pending})
        if len(record) <= room:
            return self._pending, record
        count, size = 0, len(_dumps({"first": first, "ops": []}))
        for op in self._pending:
            size += len(_dumps(op)) + 1  # and its comma
            if size > room:
                break
            count += 1
        batch = self._pending[:max(1, count)]
        return batch, _dumps({"first": first, "ops": batch})

    async def _own_record(self, key: str, first: int, batch: list[Any]) -> int:
        """How many ops of ``batch`` the existing record at ``key`` holds, when an earlier write of ours made it.

        A write whose caller was cancelled may still have reached the store; its ops
        were queued again, so the retry finds its own record there. Anything else
        at ``key`` was written by another master.
        """
        kv = await self._store.get(key)
        try:
            body = json.loads(kv.value) if kv is not None else None
            ops = body["ops"] if body is not None and int(body["first"]) == first else None
        except (ValueError, KeyError, TypeError):
            ops = None
        if ops is None or ops != batch[:len(ops)]:
            raise StoreError(f"{key} was written by another master: only one master may run per job; "
                             "stop the other one, then restart this one")
        return len(ops)

    async def _snapshot(self) -> None:
        body = {"segment": self._segment + 1, "covered": self._added, "ledger": self._state()}
        await self._snapshots.put(_dumps(body))
        old, self._segment, self._seq = self._segment, self._segment + 1, 0
        await self._store.delete_prefix(f"{self._prefix}/journal/{old:06d}/")


async def load_ledger(store: StateStore, prefix: str, spec_ledger: Callable[[], Ledger], *, now: float,
                      snapshot_every: int) -> tuple[Ledger, Journal]:
    """The ledger as the store holds it (snapshot, then the journal replayed) and its journal."""
    where = f"{prefix}/snapshot"
    segment, covered = 0, 0
    ledger: Ledger | None = None
    try:
        raw = await ChunkedValue(store, where).get()
    except CodecError as exc:
        raise LogCorrupt(f"{where} is unreadable ({exc}); delete the job's sharding keys ({prefix}) to start the "
                         "dataset over") from exc
    if raw is not None:
        try:
            body = json.loads(raw)
            segment, covered = int(body["segment"]), int(body["covered"])
            ledger = Ledger.from_json(body["ledger"], now=now)
        except (ValueError, KeyError, TypeError) as exc:
            raise LogCorrupt(f"{where} is not a sharding snapshot ({exc!r}); delete the job's sharding keys "
                             f"({prefix}) to start the dataset over") from exc
    if ledger is None:
        ledger = spec_ledger()
    applied, seq = covered, 0
    for record in await store.range(f"{prefix}/journal/{segment:06d}/"):
        try:
            body = json.loads(record.value)
            first, ops = int(body["first"]), body["ops"]
            seq = int(record.key.rsplit("/", 1)[1])
            for index, raw in enumerate(ops, start=first):
                if index < applied:
                    continue  # already in the snapshot
                if index > applied:
                    raise ValueError(f"op {index} follows op {applied - 1}: ops are missing")
                ledger.apply(decode_op(raw), now=now)
                applied += 1
        except (ValueError, KeyError, TypeError, AssertionError, IndexError) as exc:
            raise LogCorrupt(f"{record.key} is not a valid sharding journal record ({exc!r}); delete the job's "
                             f"sharding keys ({prefix}) to start the dataset over") from exc
    if segment > 0:  # a crash between a snapshot and the deletion of the older segment
        await store.delete_prefix(f"{prefix}/journal/{segment - 1:06d}/")
    journal = Journal(store, prefix, segment=segment, seq=seq, covered=applied, snapshot_every=snapshot_every,
                      state=ledger.to_json)
    log.info("dataset_loaded", dataset=ledger.name, ops=applied, segment=segment)
    return ledger, journal
