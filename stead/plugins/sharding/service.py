"""The master side of data sharding: one ledger and journal per dataset, behind plain async methods.

The gRPC servicer (:mod:`.servicer`) and the plugin's event handlers call these. Each
call decides against the ledger (bad input raises InvalidRequest, nothing changes),
applies the resulting ops, waits until the journal holds them, then answers. A call
that finds nothing to lease yet (its round waits for other ranks, a streaming source
waits for records) is held up to ``wait_s`` and woken by the change it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import structlog

from stead.plugin import Event, InvalidRequest, Record, StateStore, name_problem
from stead.plugins.sharding.events import (
    DatasetRegistered,
    LeasesReleased,
    SamplesSkipped,
    ShardRoundRefused,
    ShardRoundStarted,
)
from stead.plugins.sharding.intervals import Range, SlotMap
from stead.plugins.sharding.journal import Journal, load_ledger
from stead.plugins.sharding.ledger import LeaseAnswer, Ledger, Tally
from stead.plugins.sharding.ops import (
    UNBOUNDED,
    CursorState,
    DatasetSpec,
    Op,
    Released,
    RoundRefused,
    Skipped,
    Started,
)
from stead.plugins.sharding.settings import ShardingSettings

__all__ = ["ShardService", "StreamId"]

log = structlog.get_logger("stead.plugins.sharding")

#: the longest dataset name (it is part of the dataset's store keys)
_MAX_NAME_CHARS = 200
Emit = Callable[[Event], Awaitable[Record | None]]


@dataclasses.dataclass(frozen=True)
class StreamId:
    """Who asks: one rank of one round reading one dataset, from one process (``nonce``)."""

    dataset: str
    round: int
    rank: int
    world_size: int
    node_id: str
    nonce: str


@dataclasses.dataclass
class _Dataset:
    ledger: Ledger
    journal: Journal
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    last_sweep: float = 0.0

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


def check_name(name: str) -> str:
    problem = name_problem("the dataset name", name, max_chars=_MAX_NAME_CHARS)
    if problem is not None:
        raise InvalidRequest(problem)
    return name


class ShardService:
    def __init__(self, store: StateStore, *, prefix: str, settings: ShardingSettings, emit: Emit | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 max_world_size: Callable[[], int | None] | None = None) -> None:
        self._store = store
        #: the job's largest world (MAX nodes x processes per node); a caller's world_size above it is refused
        self._max_world_size = max_world_size
        self._prefix = prefix.rstrip("/")
        self.settings = settings
        self._emit = emit
        self._clock = clock
        self._datasets: dict[str, _Dataset] = {}
        self._loading = asyncio.Lock()

    def _check_world(self, who: StreamId) -> None:
        """Refuse a world size the job cannot have before anything is sized by it."""
        largest = self._max_world_size() if self._max_world_size is not None else None
        if who.world_size < 1 or (largest is not None and who.world_size > largest):
            within = f"1 to {largest} (the job's MAX nodes x processes per node)" if largest is not None else \
                "at least 1"
            raise InvalidRequest(f"world_size={who.world_size} of dataset {who.dataset!r} is not a world this job "
                                 f"can have; pass the data-parallel world size, {within}")

    def _key(self, name: str) -> str:
        return f"{self._prefix}/datasets/{name}"

    # -- datasets ----------------------------------------------------------------------------------

    async def _dataset(self, name: str) -> _Dataset:
        found = self._datasets.get(name)
        if found is not None:
            return found
        check_name(name)
        async with self._loading:
            found = self._datasets.get(name)
            if found is not None:
                return found
            kv = await self._store.get(f"{self._key(name)}/spec")
            if kv is None:
                raise InvalidRequest(f"dataset {name!r} is not registered; create the sampler (which registers "
                                     "it) before leasing, and check the dataset name")
            spec = DatasetSpec(**json.loads(kv.value))
            return await self._load(spec)

    async def _load(self, spec: DatasetSpec) -> _Dataset:
        ledger, journal = await load_ledger(self._store, self._key(spec.name), lambda: Ledger(spec),
                                            now=self._clock(), snapshot_every=self.settings.snapshot_every)
        found = self._datasets[spec.name] = _Dataset(ledger, journal)
        return found

    async def load_all(self) -> list[str]:
        """Load every dataset the store holds (a restarted master, before handling failures)."""
        prefix = f"{self._prefix}/index/"
        for kv in await self._store.range(prefix):
            await self._dataset(kv.key[len(prefix):])
        return sorted(self._datasets)

    async def register(self, spec: DatasetSpec, *, partitions: Mapping[int, tuple[int, int]] | None = None,
                       closed: bool = False) -> None:
        """Declare a dataset (or a streaming source, or its partitions' new end offsets); idempotent."""
        parts = dict(partitions or {})
        _check_spec(spec, parts)
        ds = self._datasets.get(spec.name) or await self._load_or_create(spec)
        await self._commit(ds, ds.ledger.decide_register(spec, parts, closed))

    async def _load_or_create(self, spec: DatasetSpec) -> _Dataset:
        async with self._loading:
            found = self._datasets.get(spec.name)
            if found is not None:
                return found
            key = self._key(spec.name)
            if await self._store.get(f"{key}/spec") is None:
                body = json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()
                await self._store.create_all([(f"{key}/spec", body), (f"{self._prefix}/index/{spec.name}", b"")])
                log.info("dataset_registered", dataset=spec.name, definition=spec.describe())
                await self._announce(DatasetRegistered(dataset=spec.name, definition=spec.describe()))
                return await self._load(spec)
        return await self._dataset(spec.name)  # registered before: its stored definition decides

    # -- the calls of a worker ----------------------------------------------------------------------

    async def lease(self, who: StreamId, *, epoch: int, have: int, count: int, consumed: int,
                    wait_s: float = 0.0) -> LeaseAnswer:
        ds = await self._dataset(who.dataset)
        self._check_world(who)
        deadline = self._clock() + _check_wait(wait_s)
        while True:
            await self._sweep(ds)
            answer = await self._try_lease(ds, who, epoch=epoch, have=have, count=count, consumed=consumed)
            if answer.ranges or answer.exhausted or not await self._wait(ds, deadline):
                return answer

    async def _try_lease(self, ds: _Dataset, who: StreamId, *, epoch: int, have: int, count: int,
                         consumed: int) -> LeaseAnswer:
        ledger = ds.ledger
        if not ledger.started(who.round):
            ops = ledger.decide_declare(round_=who.round, rank=who.rank, world_size=who.world_size,
                                        node_id=who.node_id, nonce=who.nonce, cursor=None)
            await self._commit(ds, ops)
            if not ledger.started(who.round):
                return LeaseAnswer(waiting_for=ledger.waiting_for(who.round))
        ops, answer = ledger.decide_lease(round_=who.round, rank=who.rank, nonce=who.nonce, epoch=epoch,
                                          have=have, count=count, consumed=consumed)
        ledger.note_progress(who.round, who.rank, consumed=consumed, epoch=epoch, now=self._clock())
        await self._commit(ds, ops)
        return answer

    async def report(self, who: StreamId, *, consumed: int, epoch: int, release_rest: bool = False) -> None:
        """Progress of a worker: renews its leases; ``release_rest`` gives back what it holds beyond ``consumed``."""
        ds = await self._dataset(who.dataset)
        await self._sweep(ds)
        ops = ds.ledger.decide_report(round_=who.round, rank=who.rank, nonce=who.nonce, consumed=consumed,
                                      release_rest=release_rest)
        ds.ledger.note_progress(who.round, who.rank, consumed=consumed, epoch=epoch, now=self._clock())
        await self._commit(ds, ops)

    async def restore(self, who: StreamId, cursor: CursorState | None) -> bool:
        """This rank starts its round from ``cursor`` (None: from wherever the others do); True once it started."""
        ds = await self._dataset(who.dataset)
        self._check_world(who)
        ops = ds.ledger.decide_declare(round_=who.round, rank=who.rank, world_size=who.world_size,
                                       node_id=who.node_id, nonce=who.nonce, cursor=cursor)
        await self._commit(ds, ops)
        return ds.ledger.started(who.round)

    async def save(self, who: StreamId, *, consumed: Sequence[int], epochs: Sequence[int],
                   wait_s: float = 0.0) -> CursorState | None:
        """The cursor of a checkpoint; None while the round waits for ranks that have not declared themselves."""
        ds = await self._dataset(who.dataset)
        self._check_world(who)
        deadline = self._clock() + _check_wait(wait_s)
        while not ds.ledger.started(who.round):
            ops = ds.ledger.decide_declare(round_=who.round, rank=who.rank, world_size=who.world_size,
                                           node_id=who.node_id, nonce=who.nonce, cursor=None)
            await self._commit(ds, ops)
            if not ds.ledger.started(who.round) and not await self._wait(ds, deadline):
                return None
        ops, cursor = ds.ledger.decide_cut(round_=who.round, consumed=consumed, epochs=epochs)
        await self._commit(ds, ops)
        return cursor

    async def heads(self, who: StreamId, consumed: int) -> SlotMap:
        """The slots this stream read of its first ``consumed`` (a static partition's cut)."""
        ds = await self._dataset(who.dataset)
        return ds.ledger.heads(who.round, who.rank, who.nonce, consumed)

    async def cursor_after(self, who: StreamId, heads: SlotMap, epochs: Sequence[int]) -> CursorState:
        """The cursor once every rank of the round read ``heads`` (a static partition's cut: nothing changes)."""
        ds = await self._dataset(who.dataset)
        ds.ledger.heads(who.round, who.rank, who.nonce, 0)  # checks the stream
        return ds.ledger.cursor_after(heads, epochs)

    def waiting_for(self, who: StreamId) -> tuple[int, ...]:
        found = self._datasets.get(who.dataset)
        return found.ledger.waiting_for(who.round) if found else ()

    # -- skipped steps ---------------------------------------------------------------------------------------

    async def skipped(self, *, dataset: str, round_: int, rank: int, step: int, ranges: Sequence[Range]) -> None:
        """A rank's skipped step held ``ranges`` of ``dataset`` (its step_skipped note): recorded as skipped."""
        ds = await self._dataset(dataset)
        await self._commit(ds, ds.ledger.decide_skipped(round_=round_, rank=rank, step=step, ranges=ranges))

    async def tally(self, dataset: str) -> Tally:
        """Where every sample of ``dataset`` stands (done, skipped, unread)."""
        return (await self._dataset(dataset)).ledger.tally()

    # -- failures -----------------------------------------------------------------------------------------

    async def failed(self, *, node_id: str, round_: int | None = None, rank: int | None = None,
                     reason: str) -> None:
        """A worker or node failed: the leases its streams of the current round hold go back to the queue."""
        await self.load_all()
        for ds in list(self._datasets.values()):
            ops = ds.ledger.decide_failed(node_id=node_id, round_=round_, rank=rank, reason=reason)
            await self._commit(ds, ops)

    async def _sweep(self, ds: _Dataset) -> None:
        timeout = self.settings.lease_timeout_s
        now = self._clock()
        if timeout <= 0 or now - ds.last_sweep < timeout / 10:
            return
        ds.last_sweep = now
        await self._commit(ds, ds.ledger.decide_expire(now=now, timeout_s=timeout))

    # -- plumbing -------------------------------------------------------------------------------------

    async def _commit(self, ds: _Dataset, ops: Sequence[Op]) -> None:
        if not ops and not ds.journal.behind:
            return
        now = self._clock()
        notable: list[Event] = []
        for op in ops:
            before = _released_slots(ds.ledger, op)
            ds.ledger.apply(op, now=now)
            ds.journal.add(op)
            notable.extend(self._describe(ds.ledger, op, before))
        if ops:
            ds.notify()
        await ds.journal.flush()
        for event in notable:
            await self._announce(event)

    def _describe(self, ledger: Ledger, op: Op, released: int) -> list[Event]:
        match op:
            case Started():
                gen = ledger.gen
                assert gen is not None
                remaining = 0 if ledger.spec.streaming else ledger.remaining.total
                log.info("shard_round_started", dataset=ledger.name, round=op.round, world_size=op.world_size,
                         restored=bool(op.digest), epoch=gen.epoch, remaining=remaining)
                return [ShardRoundStarted(dataset=ledger.name, round=op.round, world_size=op.world_size,
                                          restored=bool(op.digest), epoch=gen.epoch, remaining=remaining)]
            case RoundRefused():
                log.error("shard_round_refused", dataset=ledger.name, round=op.round, reason=op.reason)
                return [ShardRoundRefused(dataset=ledger.name, round=op.round, reason=op.reason)]
            case Released():
                assert ledger.gen is not None
                stream = ledger.gen.streams[op.rank]
                log.warning("shard_leases_released", dataset=ledger.name, round=op.round, rank=op.rank,
                            node=stream.node_id, samples=released, reason=op.reason)
                return [LeasesReleased(dataset=ledger.name, round=op.round, rank=op.rank, node_id=stream.node_id,
                                       samples=released, reason=op.reason)]
            case Skipped():
                samples = sum(end - start for _, start, end in op.ranges)
                log.info("shard_samples_skipped", dataset=ledger.name, round=op.round, rank=op.rank, step=op.step,
                         samples=samples, skipped=ledger.skipped.total)
                return [SamplesSkipped(dataset=ledger.name, round=op.round, rank=op.rank, step=op.step,
                                       samples=samples, skipped=ledger.skipped.total)]
            case _:
                return []

    async def _announce(self, event: Event) -> None:
        if self._emit is None:
            return
        try:
            await self._emit(event)
        except Exception as exc:  # informational: the ledger is already durable
            log.warning("shard_event_not_recorded", kind=event.type_name, error=repr(exc))

    async def _wait(self, ds: _Dataset, deadline: float) -> bool:
        """Wait for a change of the dataset until ``deadline``; False when the time is up."""
        left = deadline - self._clock()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await ds.changed.wait()
        return True


def _released_slots(ledger: Ledger, op: Op) -> int:
    if isinstance(op, Released) and ledger.gen is not None:
        stream = ledger.gen.streams.get(op.rank)
        if stream is not None and not stream.dead:
            return stream.slots_after(op.at).total
    return 0


def _check_wait(wait_s: float) -> float:
    if not 0 <= wait_s <= 60:
        raise InvalidRequest(f"wait_s={wait_s} must be between 0 and 60 seconds")
    return wait_s


def _check_spec(spec: DatasetSpec, partitions: Mapping[int, tuple[int, int]]) -> None:
    check_name(spec.name)
    if spec.shard_size < 1:
        raise InvalidRequest(f"dataset {spec.name!r}: shard_size={spec.shard_size} must be at least 1")
    if spec.streaming:
        if spec.size or spec.seed or spec.epochs != 1:
            raise InvalidRequest(f"streaming source {spec.name!r} takes partitions, not size, seed or epochs")
        for p, (start, end) in partitions.items():
            if p < 0 or not 0 <= start <= end < UNBOUNDED:
                raise InvalidRequest(f"partition {p} of {spec.name!r}: need partition >= 0 and "
                                     f"0 <= start ({start}) <= end ({end})")
        return
    if partitions:
        raise InvalidRequest(f"dataset {spec.name!r} has a size; partitions are for streaming sources")
    if not 1 <= spec.size < UNBOUNDED:
        raise InvalidRequest(f"dataset {spec.name!r}: size={spec.size} must be at least 1")
    if not 1 <= spec.epochs <= 1_000_000:
        raise InvalidRequest(f"dataset {spec.name!r}: epochs={spec.epochs} must be between 1 and 1000000")
