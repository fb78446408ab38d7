"""What a request's bytes may hold, checked on the protobuf wire format before the codec decodes them.

Decoding is where a small message becomes a large one: betterproto builds a Python object for every element of a
repeated field, so 4 MiB of empty heartbeats (two bytes each) decoded to 402 MiB and held the master's event loop
for 28 s. :func:`check_wire` reads the request's fields first (a tag, then a skip by wire type; nothing is built)
and refuses it as soon as something passes its bound, so what it reads of a refused request is in proportion to
the bounds, not to the message. In the request and every message inside it:

- a repeated field (a map's entries included) holds at most its bound: :data:`COUNT_BOUNDS` for every repeated
  field of a message a stead master receives (a list with one entry per rank: at most the job's largest world,
  once the server knows the job), :data:`MAX_ENTRIES` for any other (a plugin's own messages). Packed numbers
  are counted in C (a varint ends at each byte below 0x80). Over the bound: RESOURCE_EXHAUSTED, which says the
  same request is refused every time (:mod:`._refusals`);
- a field that is not repeated comes once (betterproto decodes each copy and keeps the last), in the wire type
  its schema gives it (a length-delimited int32 decodes to a list of numbers), and there are at most
  :data:`MAX_UNKNOWN_FIELDS` fields the schema does not know (betterproto appends each to one bytes object,
  which is quadratic): INVALID_ARGUMENT otherwise.

So a request decodes to at most its bounds' worth of objects (each 100 to 250 bytes, however few bytes it took on
the wire), and betterproto handles at most that many fields. Strings and bytes are left to the decoder: one costs
its wire bytes (up to four times that as a str), and :mod:`._checks` bounds every string once it is decoded.
The schema (field numbers, wire types, nested messages) comes from the generated classes; the bounds are here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NoReturn

from stead.core.events import MAX_NOTES_PER_REPORT, MAX_SAMPLE_RANGES, MAX_SAMPLE_SETS
from stead.core.rpc._protowire import FIXED32, FIXED64, LEN, MAX_VARINT_BYTES, VARINT, WIDTHS, read_varint
from stead.core.rpc._refusals import over_limit
from stead.core.rpc._status import invalid
from stead.core.rpc.backend import MAX_BATCH_BEATS, MAX_HEALTH_PEERS, MAX_NODE_WORKERS

__all__ = [
    "COUNT_BOUNDS",
    "MAX_CURSOR_RANGES",
    "MAX_ENTRIES",
    "MAX_HELD_STEPS",
    "MAX_STREAM_PARTITIONS",
    "MAX_UNKNOWN_FIELDS",
    "MAX_WORLD_SIZE",
    "CountBound",
    "check_wire",
]

#: the most ranks a job's world has (a checkpoint's, a dataset's cursor's progress per rank)
MAX_WORLD_SIZE = 1 << 20
#: the most steps one rank holds in memory: the flash checkpoint's two slots per rank
MAX_HELD_STEPS = 2
#: the most partitions one streaming source declares
MAX_STREAM_PARTITIONS = 1 << 16
#: the most ranges a dataset's cursor leaves unread (the master made it: a worker passes it back unchanged)
MAX_CURSOR_RANGES = 1 << 18
#: the most entries of a repeated field :data:`COUNT_BOUNDS` does not list (a plugin's own messages): about the
#: size of the default message limit once decoded
MAX_ENTRIES = 1 << 14
#: the most fields of one message the schema does not know (a newer client's): a message of this version has none
MAX_UNKNOWN_FIELDS = 16


@dataclasses.dataclass(frozen=True)
class CountBound:
    """How many entries a repeated field may hold, and what to send instead of more."""

    #: the field's name, as the schema spells it
    field: str
    most: int
    #: the bound's name and what to do, for the refusal's message
    send: str
    #: one entry per rank of the job: at most the job's largest world too, where the server knows it
    per_rank: bool = False


_NODE_WORKERS = f"MAX_NODE_WORKERS: a node runs at most {MAX_NODE_WORKERS} workers"
_HELD = f"MAX_HELD_STEPS: a rank holds at most {MAX_HELD_STEPS} steps, one per checkpoint slot"
_PER_RANK = f"MAX_WORLD_SIZE: one per rank, and a world has at most {MAX_WORLD_SIZE} ranks"
#: what a refusal says of a list over the job's own world
_JOB_WORLD = "one per rank, and this job's world has at most that many ranks (MAX nodes x processes per node)"

#: (message, field number) -> its bound, for every repeated field of every message a stead master receives
COUNT_BOUNDS: Mapping[tuple[str, int], CountBound] = {
    ("HeartbeatBatch", 1): CountBound("beats", MAX_BATCH_BEATS, "MAX_BATCH_BEATS per call: split the batch"),
    # before decoding, only what keeps the decoding bounded: the servicer refuses more than MAX_ACKS_PER_BEAT
    # within the heartbeat stream, which a refusal here would reset
    ("HeartbeatRequest", 12): CountBound("acked", MAX_ENTRIES,
                                         "MAX_ACKS_PER_BEAT a heartbeat: send the rest with the next ones"),
    ("FailureReport", 13): CountBound("exited_ok_ranks", MAX_NODE_WORKERS, _NODE_WORKERS),
    ("StacksReport", 4): CountBound("workers", MAX_NODE_WORKERS, _NODE_WORKERS),
    ("NumericsReport", 4): CountBound("notes", MAX_NOTES_PER_REPORT,
                                      "MAX_NOTES_PER_REPORT a report: send the rest with the next ones"),
    ("NumericsNote", 9): CountBound("samples", MAX_SAMPLE_SETS, "MAX_SAMPLE_SETS: name the first datasets only"),
    ("StepSamples", 3): CountBound("ranges", MAX_SAMPLE_RANGES,
                                   "MAX_SAMPLE_RANGES: name the first ranges, count the rest"),
    ("HealthReport", 5): CountBound("collectives", MAX_HEALTH_PEERS,
                                    "MAX_HEALTH_PEERS: one partner per stage of a check"),
    ("ReportSavedRequest", 6): CountBound("ranks", MAX_NODE_WORKERS, f"{_NODE_WORKERS}: report one node's ranks"),
    ("RankSaved", 3): CountBound("held_steps", MAX_HELD_STEPS, _HELD),
    ("RankSaved", 4): CountBound("seconds", MAX_HELD_STEPS, f"{_HELD}: one duration per step"),
    ("ReportSavedRequest", 10): CountBound("replicas", MAX_WORLD_SIZE,
                                           f"{_PER_RANK}: a node holds at most one replica of each", per_rank=True),
    ("GetCommittedRequest", 5): CountBound("ranks", MAX_NODE_WORKERS, f"{_NODE_WORKERS}: ask for the node's ranks"),
    ("GetCommittedRequest", 6): CountBound("replica_ranks", MAX_NODE_WORKERS,
                                           f"{_NODE_WORKERS}: ask for the node's ranks"),
    ("RegisterDatasetRequest", 8): CountBound("partitions", MAX_STREAM_PARTITIONS,
                                              "MAX_STREAM_PARTITIONS: split the source into several datasets"),
    ("SaveCursorRequest", 7): CountBound("consumed", MAX_WORLD_SIZE, _PER_RANK, per_rank=True),
    ("SaveCursorRequest", 8): CountBound("epochs", MAX_WORLD_SIZE, _PER_RANK, per_rank=True),
    ("Cursor", 3): CountBound("remaining", MAX_CURSOR_RANGES,
                              "MAX_CURSOR_RANGES: pass the cursor state_dict() returned, unchanged"),
}

_WIRE_TYPES = {**dict.fromkeys(("int32", "int64", "uint32", "uint64", "sint32", "sint64", "bool", "enum"), VARINT),
               **dict.fromkeys(("double", "fixed64", "sfixed64"), FIXED64),
               **dict.fromkeys(("float", "fixed32", "sfixed32"), FIXED32),
               **dict.fromkeys(("string", "bytes", "message", "map"), LEN)}
_WIRE_NAMES = {VARINT: "a varint", FIXED64: "8 bytes", LEN: "length-delimited", FIXED32: "4 bytes"}
#: every byte that ends a varint (a packed field's count is how many of these it holds)
_VARINT_ENDS = bytes(range(0x80))


@dataclasses.dataclass(frozen=True, slots=True)
class _WireField:
    name: str
    #: the wire type of one value
    wire: int
    #: how many times it may come (1: a field that is not repeated)
    most: int
    #: a repeated number: it may also come packed, length-delimited
    packed: bool
    #: what a refusal says to send, for a repeated field
    send: str
    #: one entry per rank: at most the job's world too
    per_rank: bool
    #: the plan of the message it holds (a map's: of its entries), whose fields are read too
    nested: _Plan | None


@dataclasses.dataclass(eq=False)
class _Plan:
    """How one message type's fields come on the wire, by field number."""

    name: str
    fields: dict[int, _WireField]


_PLANS: dict[type, _Plan] = {}


def check_wire(data: bytes, message_type: type, *, world_size: int | None = None) -> None:
    """Refuse ``data`` before it is decoded as a ``message_type`` where it holds more than its bounds (see the
    module docstring): RESOURCE_EXHAUSTED for a count over its bound, INVALID_ARGUMENT for what no valid message
    holds. ``world_size``: the job's largest world, which bounds every list with one entry per rank (None: no
    job yet, :data:`MAX_WORLD_SIZE` does)."""
    plan = _plan(message_type)
    _scan(data, 0, len(data), plan, plan.name, world_size)


def _scan(data: bytes, pos: int, end: int, plan: _Plan, where: str, world: int | None) -> None:
    """Read the fields of one message, ``data[pos:end]``; ``where`` names it in a refusal."""
    fields = plan.fields
    counts: dict[int, int] = {}
    unknown = 0
    while pos < end:
        tag = data[pos]
        pos += 1
        if tag & 0x80:
            tag, pos = _varint(data, pos - 1, end, where)
        wire = tag & 7
        start = pos
        if wire == VARINT:
            stop = min(end, pos + MAX_VARINT_BYTES)
            while pos < stop and data[pos] & 0x80:
                pos += 1
            if pos == stop:
                _malformed(where, "a varint is cut off or longer than 10 bytes")
            pos += 1
        elif wire == LEN:
            length, start = _varint(data, pos, end, where)
            pos = start + length
        elif wire in WIDTHS:
            pos += WIDTHS[wire]
        else:
            _malformed(where, f"a field has wire type {wire}, which protobuf 3 does not use")
        if pos > end:
            _malformed(where, f"field {tag >> 3} runs past the end of its message")
        field = fields.get(tag >> 3)
        if field is None:
            unknown += 1
            if unknown > MAX_UNKNOWN_FIELDS:
                invalid(f"{where} has more than {MAX_UNKNOWN_FIELDS} fields this master does not know: run the "
                        "master and its clients with the same stead version")
            continue
        most = field.most if world is None or not field.per_rank else min(field.most, world)
        count = counts.get(tag >> 3, 0)
        if wire == field.wire:
            count += 1
        elif wire == LEN and field.packed:
            count += _packed_count(data, start, pos, field, most - count, where)
        else:
            invalid(f"{where}.{field.name} comes {_WIRE_NAMES.get(wire, wire)}, where its type is sent "
                    f"{_WIRE_NAMES[field.wire]}: send messages built from proto/stead/v1 of the same stead version")
        if count > most:
            _over(where, field, count, most)
        counts[tag >> 3] = count
        if field.nested is not None:
            inner = f"{where}.{field.name}[{count - 1}]" if field.most > 1 else f"{where}.{field.name}"
            _scan(data, start, pos, field.nested, inner, world)


def _varint(data: bytes, pos: int, end: int, where: str) -> tuple[int, int]:
    """The varint at ``data[pos]`` and the position after it."""
    try:
        return read_varint(data, pos, end)
    except ValueError as exc:
        _malformed(where, str(exc))


def _packed_count(data: bytes, start: int, stop: int, field: _WireField, room: int, where: str) -> int:
    """How many numbers a packed field's ``data[start:stop]`` holds; where even the shortest numbers would be more
    than the ``room`` left under its bound, a count just past it, without counting."""
    size = stop - start
    width = WIDTHS.get(field.wire)
    if width is not None:
        if size % width:
            _malformed(where, f"{field.name} holds {size} bytes of {width}-byte numbers")
        return size // width
    if size > room * MAX_VARINT_BYTES:  # more numbers than the room, however long each one is
        return -(-size // MAX_VARINT_BYTES)
    chunk = data[start:stop]
    return size - len(chunk.translate(None, _VARINT_ENDS))


def _over(where: str, field: _WireField, count: int, most: int) -> NoReturn:
    if field.most == 1:
        invalid(f"{where}.{field.name} comes {count} times: a field that is not repeated is sent once; send "
                "messages built from proto/stead/v1 of the same stead version")
    send = field.send if most == field.most else _JOB_WORLD
    over_limit(f"{where}.{field.name} has {count} entries or more: send at most {most} ({send})")


def _malformed(where: str, problem: str) -> NoReturn:
    invalid(f"the request body is not a valid {where.split('.', 1)[0]} message ({where}: {problem}): send messages "
            "built from proto/stead/v1 of the same stead version")


def _plan(cls: type) -> _Plan:
    """The wire plan of ``cls`` and of every message inside it (worked out once per type)."""
    plan = _PLANS.get(cls)
    if plan is not None:
        return plan
    plan = _PLANS[cls] = _Plan(cls.__name__, {})  # first: a message that holds its own type finds it
    meta = cls._betterproto  # type: ignore[attr-defined]  # what betterproto generated
    for number, name in meta.field_name_by_number.items():
        field = meta.meta_by_field_name[name]
        kind: str = field.proto_type
        repeated = bool(field.repeated) or kind == "map"
        nested = None
        if kind in ("message", "map"):
            nested = _plan(field.unwrap() if field.unwrap else meta.cls_by_field[name])
        bound = COUNT_BOUNDS.get((cls.__name__, number))
        if not repeated:
            bound = CountBound(name, 1, "")
        elif bound is None:
            bound = CountBound(name, MAX_ENTRIES, "MAX_ENTRIES: a list of a plugin's own message")
        plan.fields[number] = _WireField(name, _WIRE_TYPES[kind], bound.most, repeated and _WIRE_TYPES[kind] != LEN,
                                         bound.send, bound.per_rank, nested)
    return plan
