"""The ledger's vocabulary: a dataset's spec, a checkpoint's cursor, and the ops the journal stores.

Ops are plain records (encoded as JSON lists by :func:`encode_op`); folding them in
order with :meth:`~stead.plugins.sharding.ledger.Ledger.apply` rebuilds a ledger.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from stead.plugins.sharding.intervals import Range

#: the end of a streaming partition's slots: records not appended yet
UNBOUNDED = 1 << 62
#: most shards one lease call may ask for
MAX_LEASE_COUNT = 4096


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """What a dataset is; registering the same name with another spec is refused."""

    name: str
    shard_size: int
    streaming: bool = False
    size: int = 0
    seed: int = 0
    epochs: int = 1
    shuffle: bool = True
    #: every rank reads the same number of samples per epoch (see :mod:`.lockstep`)
    lockstep: bool = False

    def fingerprint(self) -> str:
        """What a cursor must match: the samples and their order (how they are split between ranks is free)."""
        fields = dataclasses.asdict(self)
        del fields["lockstep"]
        body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def describe(self) -> str:
        if self.streaming:
            return f"streaming source with shard_size={self.shard_size}"
        return (f"size={self.size}, shard_size={self.shard_size}, seed={self.seed}, epochs={self.epochs}, "
                f"shuffle={self.shuffle}, lockstep={self.lockstep}")


@dataclasses.dataclass(frozen=True)
class CursorState:
    """A checkpoint's cursor: every slot not consumed by the training steps the checkpoint holds."""

    fingerprint: str
    epoch: int
    remaining: tuple[Range, ...]

    @property
    def digest(self) -> str:
        body = json.dumps([self.fingerprint, self.epoch, self.remaining], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]


# -- ops: what the journal stores ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PartitionsChanged:
    """Streaming: partitions added or their end offsets moved forward; ``closed``: no more records."""

    partitions: tuple[tuple[int, int, int], ...]  # (partition, start, end)
    closed: bool


@dataclasses.dataclass(frozen=True)
class Declared:
    """A rank of a round that has not started said where it starts: a cursor (``digest``) or not ("")."""

    round: int
    rank: int
    world_size: int
    node_id: str
    nonce: str
    digest: str
    cursor: CursorState | None  # given with the first declaration of each digest only


@dataclasses.dataclass(frozen=True)
class Started:
    round: int
    world_size: int
    digest: str  # "" = from the beginning


@dataclasses.dataclass(frozen=True)
class RoundRefused:
    round: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Granted:
    round: int
    rank: int
    ranges: tuple[Range, ...]


@dataclasses.dataclass(frozen=True)
class Truncated:
    """The stream gives back everything it holds beyond ``at`` slots (and keeps reading after that)."""

    round: int
    rank: int
    at: int


@dataclasses.dataclass(frozen=True)
class Released:
    """The stream is dead (its worker failed or went silent): what it held beyond ``at`` returns."""

    round: int
    rank: int
    at: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Folded:
    """A cursor was cut at these positions: the slots before them leave the streams for the round's start set."""

    round: int
    positions: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Skipped:
    """Rank ``rank`` of ``round`` skipped its step ``step`` (a numerical fault's batch): these slots trained nothing."""

    round: int
    rank: int
    step: int
    ranges: tuple[Range, ...]


Op = Folded | PartitionsChanged | Declared | Started | RoundRefused | Granted | Truncated | Released | Skipped
_OPS: dict[str, type[Any]] = {
    "part": PartitionsChanged, "decl": Declared, "start": Started, "refuse": RoundRefused,
    "grant": Granted, "trunc": Truncated, "release": Released, "fold": Folded, "skip": Skipped,
}
_TAGS = {cls: tag for tag, cls in _OPS.items()}


def encode_op(op: Op) -> list[Any]:
    if isinstance(op, Declared):
        cursor = None if op.cursor is None else [op.cursor.fingerprint, op.cursor.epoch, op.cursor.remaining]
        return ["decl", op.round, op.rank, op.world_size, op.node_id, op.nonce, op.digest, cursor]
    if isinstance(op, Granted):  # the hot one: no deep copy
        return ["grant", op.round, op.rank, [list(r) for r in op.ranges]]
    return [_TAGS[type(op)], *dataclasses.astuple(op)]


def decode_op(raw: Any) -> Op:
    """The op of one journal entry; raises ValueError, KeyError or TypeError on a malformed one."""
    tag, *fields = raw
    if tag == "decl":
        round_, rank, world_size, node_id, nonce, digest, cursor = fields
        state = None if cursor is None else CursorState(str(cursor[0]), int(cursor[1]), decode_ranges(cursor[2]))
        return Declared(int(round_), int(rank), int(world_size), str(node_id), str(nonce), str(digest), state)
    if tag == "part":
        return PartitionsChanged(decode_ranges(fields[0]), bool(fields[1]))
    if tag == "grant":
        return Granted(fields[0], fields[1], decode_ranges(fields[2]))
    if tag == "fold":
        return Folded(int(fields[0]), tuple(int(p) for p in fields[1]))
    if tag == "skip":
        return Skipped(int(fields[0]), int(fields[1]), int(fields[2]), decode_ranges(fields[3]))
    cls = _OPS[tag]
    op: Op = cls(*fields)
    return op


def decode_ranges(raw: Sequence[Sequence[int]]) -> tuple[Range, ...]:
    return tuple((int(p), int(s), int(e)) for p, s, e in raw)
