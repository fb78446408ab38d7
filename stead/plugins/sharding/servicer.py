"""ShardService over gRPC: protobuf in, :class:`~.service.ShardService` calls, protobuf out.

Bad input is answered INVALID_ARGUMENT with a message that says what to send
instead; a store that is down, UNAVAILABLE (the worker's client retries).
"""

from __future__ import annotations

from typing import Protocol

from stead.plugin import MAX_NODE_ID_CHARS, InvalidRequest, at_least, backend_errors, check_name
from stead.plugins.sharding._proto.stead import v1 as proto
from stead.plugins.sharding.ledger import CursorState, DatasetSpec, Range
from stead.plugins.sharding.service import ShardService, StreamId

__all__ = ["ShardServicer", "cursor_from_proto", "cursor_to_proto"]

#: the longest nonce a worker sends (it sends 16 hex digits, or static-<rank>)
_MAX_NONCE_CHARS = 64


class _StreamRequest(Protocol):
    """What every call about one rank's stream carries."""

    dataset: str
    node_id: str
    rank: int
    round: int
    world_size: int
    nonce: str


def _stream_id(message: _StreamRequest) -> StreamId:
    """Who asks; INVALID_ARGUMENT for an id that is not a name or a negative round or rank (the dataset's name and
    the world are checked by the service)."""
    where = type(message).__name__
    check_name(f"{where}.node_id", message.node_id, max_chars=MAX_NODE_ID_CHARS,
               what="the node's id (STEAD_NODE_ID), or this host's name")
    check_name(f"{where}.nonce", message.nonce, max_chars=_MAX_NONCE_CHARS, what="the id the sampler made")
    at_least(f"{where}.round", message.round, 0, "rendezvous rounds count from 0 (STEAD_ROUND)")
    at_least(f"{where}.rank", message.rank, 0, "ranks count from 0")
    return StreamId(message.dataset, message.round, message.rank, message.world_size, message.node_id,
                    message.nonce)


def _shards(ranges: tuple[Range, ...]) -> list[proto.Shard]:
    return [proto.Shard(part=p, start=s, end=e) for p, s, e in ranges]


def cursor_to_proto(cursor: CursorState) -> proto.Cursor:
    return proto.Cursor(fingerprint=cursor.fingerprint, epoch=cursor.epoch, remaining=_shards(cursor.remaining))


def cursor_from_proto(cursor: proto.Cursor | None) -> CursorState:
    if cursor is None:
        return CursorState("", 0, ())
    return CursorState(cursor.fingerprint, cursor.epoch, tuple((s.part, s.start, s.end) for s in cursor.remaining))


class ShardServicer(proto.ShardServiceBase):
    def __init__(self, service: ShardService) -> None:
        self.service = service

    async def register_dataset(self, message: proto.RegisterDatasetRequest) -> proto.Ack:
        with backend_errors("ShardService.RegisterDataset"):
            if message.streaming:
                spec = DatasetSpec(name=message.name, shard_size=message.shard_size, streaming=True,
                                   size=message.size, seed=message.seed, epochs=message.epochs or 1)
            else:
                spec = DatasetSpec(name=message.name, shard_size=message.shard_size, size=message.size,
                                   seed=message.seed, epochs=message.epochs, shuffle=not message.ordered,
                                   lockstep=message.lockstep)
            partitions = {p.id: (p.start, p.end) for p in message.partitions}
            if len(partitions) != len(message.partitions):
                raise InvalidRequest(f"streaming source {message.name!r} lists a partition twice; list each once")
            await self.service.register(spec, partitions=partitions, closed=message.closed)
        return proto.Ack()

    async def lease_shards(self, message: proto.LeaseShardsRequest) -> proto.LeaseShardsReply:
        who = _stream_id(message)
        with backend_errors("ShardService.LeaseShards"):
            answer = await self.service.lease(who, epoch=message.epoch, have=message.have, count=message.count,
                                              consumed=message.consumed, wait_s=message.wait_s)
        return proto.LeaseShardsReply(shards=_shards(answer.ranges), exhausted=answer.exhausted,
                                waiting_for=list(answer.waiting_for),
                                lease_timeout_s=self.service.settings.lease_timeout_s)

    async def complete_shards(self, message: proto.CompleteShardsRequest) -> proto.Ack:
        who = _stream_id(message)
        with backend_errors("ShardService.CompleteShards"):
            await self.service.report(who, consumed=message.consumed, epoch=message.epoch,
                                      release_rest=message.release_rest)
        return proto.Ack()

    async def save_cursor(self, message: proto.SaveCursorRequest) -> proto.SaveCursorReply:
        who = _stream_id(message)
        with backend_errors("ShardService.SaveCursor"):
            cursor = await self.service.save(who, consumed=message.consumed, epochs=message.epochs,
                                             wait_s=message.wait_s)
        if cursor is None:
            return proto.SaveCursorReply(ready=False, waiting_for=list(self.service.waiting_for(who)))
        return proto.SaveCursorReply(ready=True, cursor=cursor_to_proto(cursor))

    async def restore_cursor(self, message: proto.RestoreCursorRequest) -> proto.Ack:
        who = _stream_id(message)
        with backend_errors("ShardService.RestoreCursor"):
            await self.service.restore(who, cursor_from_proto(message.cursor))
        return proto.Ack()
