"""The worker's side of ShardService: over RPC to the master, or in process when there is none.

:class:`ShardClient` maps grpclib's errors to stead's through
:class:`~stead.core.rpc.RpcConnection` (an unreachable master is RpcUnavailable, a
refused request InvalidRequest). :class:`LocalBackend` runs the master's
:class:`~.service.ShardService` on an in-memory store inside the worker, so that a
script run by plain ``python`` (one process, no stead) reads the same shards in the
same order; :class:`StaticBackend` does so for each rank of a multi-rank script run
without stead (plain ``torchrun``).
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Protocol, Self

from stead.plugin import RpcConnection, StateStore
from stead.plugins.sharding._proto.stead import v1 as proto
from stead.plugins.sharding.intervals import SlotMap
from stead.plugins.sharding.ledger import CursorState, DatasetSpec, Range
from stead.plugins.sharding.service import ShardService, StreamId
from stead.plugins.sharding.servicer import cursor_from_proto, cursor_to_proto
from stead.plugins.sharding.settings import ShardingSettings

__all__ = ["LeaseReply", "LocalBackend", "SaveReply", "ShardBackend", "ShardClient", "StaticBackend"]


@dataclasses.dataclass(frozen=True)
class LeaseReply:
    ranges: tuple[Range, ...]
    exhausted: bool
    waiting_for: tuple[int, ...]
    lease_timeout_s: float


@dataclasses.dataclass(frozen=True)
class SaveReply:
    cursor: CursorState | None
    waiting_for: tuple[int, ...] = ()


class ShardBackend(Protocol):
    async def register(self, spec: DatasetSpec, partitions: Mapping[int, tuple[int, int]], closed: bool) -> None: ...

    async def lease(self, who: StreamId, *, epoch: int, have: int, count: int, consumed: int,
                    wait_s: float) -> LeaseReply: ...

    async def report(self, who: StreamId, *, consumed: int, epoch: int, release_rest: bool) -> None: ...

    async def save(self, who: StreamId, *, consumed: Sequence[int], epochs: Sequence[int],
                   wait_s: float) -> SaveReply: ...

    async def restore(self, who: StreamId, cursor: CursorState) -> None: ...


class ShardClient:
    """``async with ShardClient("host:port", token, call_timeout_s=5) as client``."""

    def __init__(self, address: str, token: str, *, call_timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        self._conn = RpcConnection(address, token, call_timeout_s, tls=tls)

    @property
    def _stub(self) -> proto.ShardServiceStub:
        return proto.ShardServiceStub(self._conn.channel)

    def _timeout(self, wait_s: float = 0.0) -> float:
        return wait_s + self._conn.call_timeout_s

    async def __aenter__(self) -> Self:
        self._conn.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._conn.close()

    async def register(self, spec: DatasetSpec, partitions: Mapping[int, tuple[int, int]], closed: bool) -> None:
        request = proto.RegisterDatasetRequest(
            name=spec.name, size=spec.size, shard_size=spec.shard_size, seed=spec.seed,
            epochs=0 if spec.streaming else spec.epochs, ordered=not spec.shuffle, streaming=spec.streaming,
            partitions=[proto.Partition(id=p, start=s, end=e) for p, (s, e) in sorted(partitions.items())],
            closed=closed, lockstep=spec.lockstep)
        with self._conn.errors("ShardService.RegisterDataset"):
            await self._stub.register_dataset(request, timeout=self._timeout())

    async def lease(self, who: StreamId, *, epoch: int, have: int, count: int, consumed: int,
                    wait_s: float) -> LeaseReply:
        request = proto.LeaseShardsRequest(
            dataset=who.dataset, node_id=who.node_id, rank=who.rank, count=count, round=who.round,
            world_size=who.world_size, nonce=who.nonce, epoch=epoch, have=have, consumed=consumed, wait_s=wait_s)
        with self._conn.errors("ShardService.LeaseShards"):
            reply = await self._stub.lease_shards(request, timeout=self._timeout(wait_s))
        return LeaseReply(tuple((s.part, s.start, s.end) for s in reply.shards), reply.exhausted,
                          tuple(reply.waiting_for), reply.lease_timeout_s)

    async def report(self, who: StreamId, *, consumed: int, epoch: int, release_rest: bool) -> None:
        request = proto.CompleteShardsRequest(
            dataset=who.dataset, node_id=who.node_id, rank=who.rank, round=who.round, world_size=who.world_size,
            nonce=who.nonce, epoch=epoch, consumed=consumed, release_rest=release_rest)
        with self._conn.errors("ShardService.CompleteShards"):
            await self._stub.complete_shards(request, timeout=self._timeout())

    async def save(self, who: StreamId, *, consumed: Sequence[int], epochs: Sequence[int],
                   wait_s: float) -> SaveReply:
        request = proto.SaveCursorRequest(
            dataset=who.dataset, node_id=who.node_id, rank=who.rank, round=who.round, world_size=who.world_size,
            nonce=who.nonce, consumed=list(consumed), epochs=list(epochs), wait_s=wait_s)
        with self._conn.errors("ShardService.SaveCursor"):
            reply = await self._stub.save_cursor(request, timeout=self._timeout(wait_s))
        if not reply.ready:
            return SaveReply(None, tuple(reply.waiting_for))
        return SaveReply(cursor_from_proto(reply.cursor))

    async def restore(self, who: StreamId, cursor: CursorState) -> None:
        request = proto.RestoreCursorRequest(
            dataset=who.dataset, node_id=who.node_id, rank=who.rank, round=who.round, world_size=who.world_size,
            nonce=who.nonce, cursor=cursor_to_proto(cursor))
        with self._conn.errors("ShardService.RestoreCursor"):
            await self._stub.restore_cursor(request, timeout=self._timeout())

    def __repr__(self) -> str:
        return f"ShardClient({self._conn.address})"


class LocalBackend:
    """The master's service in this process, on ``store`` (an in-memory one for a script run without stead)."""

    def __init__(self, store: StateStore, settings: ShardingSettings) -> None:
        self.service = ShardService(store, prefix="/stead/local/plugins/sharding/v1", settings=settings)

    async def register(self, spec: DatasetSpec, partitions: Mapping[int, tuple[int, int]], closed: bool) -> None:
        await self.service.register(spec, partitions=partitions, closed=closed)

    async def lease(self, who: StreamId, *, epoch: int, have: int, count: int, consumed: int,
                    wait_s: float) -> LeaseReply:
        answer = await self.service.lease(who, epoch=epoch, have=have, count=count, consumed=consumed,
                                          wait_s=wait_s)
        return LeaseReply(answer.ranges, answer.exhausted, answer.waiting_for,
                          self.service.settings.lease_timeout_s)

    async def report(self, who: StreamId, *, consumed: int, epoch: int, release_rest: bool) -> None:
        await self.service.report(who, consumed=consumed, epoch=epoch, release_rest=release_rest)

    async def save(self, who: StreamId, *, consumed: Sequence[int], epochs: Sequence[int],
                   wait_s: float) -> SaveReply:
        cursor = await self.service.save(who, consumed=consumed, epochs=epochs, wait_s=wait_s)
        return SaveReply(cursor, () if cursor else self.service.waiting_for(who))

    async def restore(self, who: StreamId, cursor: CursorState) -> None:
        await self.service.restore(who, cursor)


class StaticBackend(LocalBackend):
    """A multi-rank script without stead (plain ``torchrun``): each rank reads its static share.

    Every rank runs this in-process ledger with the same dataset and world size, and
    plays the other ranks' part in starting each round (they start from the same
    cursor, or from the beginning). A round is always split in lockstep
    (:mod:`.lockstep`): each rank leases only its own block of each epoch, so the
    ranks read disjoint samples without talking to each other. The cursor is cut
    from every rank's read slots, which the sampler all-gathers
    (:meth:`heads`, then :meth:`cursor_after`).
    """

    def __init__(self, store: StateStore, settings: ShardingSettings) -> None:
        super().__init__(store, settings)
        self._started: set[tuple[str, int]] = set()

    async def register(self, spec: DatasetSpec, partitions: Mapping[int, tuple[int, int]], closed: bool) -> None:
        await super().register(dataclasses.replace(spec, lockstep=True), partitions, closed)

    async def _declare(self, who: StreamId, cursor: CursorState | None) -> None:
        for rank in range(who.world_size):
            other = who if rank == who.rank else dataclasses.replace(who, rank=rank, nonce=f"static-{rank}")
            await self.service.restore(other, cursor)
        self._started.add((who.dataset, who.round))

    async def _ensure_started(self, who: StreamId) -> None:
        if (who.dataset, who.round) not in self._started:
            await self._declare(who, None)

    async def lease(self, who: StreamId, *, epoch: int, have: int, count: int, consumed: int,
                    wait_s: float) -> LeaseReply:
        await self._ensure_started(who)
        return await super().lease(who, epoch=epoch, have=have, count=count, consumed=consumed, wait_s=wait_s)

    async def restore(self, who: StreamId, cursor: CursorState) -> None:
        await self._declare(who, cursor)

    async def save(self, who: StreamId, *, consumed: Sequence[int], epochs: Sequence[int],
                   wait_s: float) -> SaveReply:
        raise AssertionError("a static partition's cursor is cut with heads() and cursor_after()")

    async def heads(self, who: StreamId, consumed: int) -> SlotMap:
        await self._ensure_started(who)
        return await self.service.heads(who, consumed)

    async def cursor_after(self, who: StreamId, heads: SlotMap, epochs: Sequence[int]) -> CursorState:
        return await self.service.cursor_after(who, heads, epochs)
