"""The event codec: every kind round-trips; every bad record fails with an error naming it."""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Union, get_args, get_origin

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stead.core.events.base as events_base
from stead.core.errors import CodecError
from stead.core.events import (
    Event,
    NodeJoined,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RoundStarted,
    decode_record,
    encode_record,
    event_kind,
    event_types,
)
from stead.core.events import kinds as core_kinds

WHERE = "/stead/jobs/j/events/00000000000000000007"


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """Values of a field type the codec supports (finite floats: NaN never equals itself)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union or origin is types.UnionType:
        return st.one_of([strategy_for(a) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
        return st.tuples(*(strategy_for(a) for a in args))
    if origin is frozenset:
        return st.frozensets(strategy_for(args[0]), max_size=3)
    if origin in (dict, Mapping):
        return st.dictionaries(st.text(max_size=5), strategy_for(args[1]), max_size=3)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(tp) if f.init}
        return st.builds(tp, **fields)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(tp)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(), bool: st.booleans(), int: st.integers(), str: st.text(max_size=20),
        float: st.floats(allow_nan=False, allow_infinity=False),
    }
    return simple[tp] if tp in simple else st.from_type(tp)


def records(cls: type[Event]) -> st.SearchStrategy[Record]:
    return st.builds(Record, seq=st.integers(1, 2**62), at=st.floats(0, 4e9), event=strategy_for(cls))


CORE_KINDS = [name for name in core_kinds.__all__  # the event classes (not their parts, such as StackSample)
              if isinstance(getattr(core_kinds, name), type) and issubclass(getattr(core_kinds, name), Event)]


def test_every_core_event_kind_is_registered_under_a_dotted_name() -> None:
    registered = {cls.__name__: name for name, cls in event_types().items()}
    for kind in CORE_KINDS:
        assert kind in registered, f"{kind} is not registered"
        assert "." in registered[kind]


@pytest.mark.parametrize("type_name", sorted(event_types()))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_registered_event_kind_round_trips(type_name: str, data: st.DataObject) -> None:
    record = data.draw(records(event_types()[type_name]))
    raw = encode_record(record)
    assert decode_record(raw, where=WHERE) == record
    assert encode_record(decode_record(raw, where=WHERE)) == raw  # stable bytes


def test_record_layout_is_type_version_seq_time_and_data() -> None:
    record = Record(seq=7, at=12.5, event=RoundStarted(round=2, members=("node-1", "node-0"), nproc_per_node=4))
    assert json.loads(encode_record(record)) == {
        "type": "round.started", "v": 1, "seq": 7, "at": 12.5,
        "data": {"round": 2, "members": ["node-1", "node-0"], "nproc_per_node": 4, "restart_count": 0},
    }


def test_enum_field_is_stored_as_its_value() -> None:
    event = RecoveryDecided(round=1, action=RecoveryAction.FAIL, reason="r")
    assert json.loads(encode_record(Record(seq=1, at=0.0, event=event)))["data"]["action"] == "fail"


def raw(type_name: str = "node.joined", data: Any = None, **top: Any) -> bytes:
    body = {"type": type_name, "v": 1, "seq": 7, "at": 1.0,
            "data": {"node_id": "node-0", "incarnation": 1} if data is None else data, **top}
    return json.dumps(body).encode()


def test_fields_with_defaults_may_be_absent_from_an_older_record() -> None:
    record = decode_record(raw(), where=WHERE)
    assert record == Record(seq=7, at=1.0, event=NodeJoined(node_id="node-0", incarnation=1))


def test_integer_time_is_read_as_a_float() -> None:
    assert decode_record(raw(at=3), where=WHERE).at == 3.0


BAD_RECORDS: list[tuple[str, bytes, list[str]]] = [
    ("unknown type", raw("nope.kind"), [WHERE, "unknown event type 'nope.kind'", "plugin"]),
    ("malformed JSON", b'{"type": "node.joined", "v": 1, ', [WHERE, "not JSON"]),
    ("not UTF-8", b"\xff\xfe\x00", [WHERE, "not JSON"]),
    ("not an object", b"[1, 2]", [WHERE, "not an event record"]),
    ("no type", json.dumps({"v": 1, "data": {}}).encode(), [WHERE, "needs 'type' and 'data'"]),
    ("type not a string", json.dumps({"type": 3, "data": {}}).encode(), [WHERE, "needs 'type' and 'data'"]),
    ("no data", json.dumps({"type": "node.joined", "v": 1}).encode(), [WHERE, "needs 'type' and 'data'"]),
    ("data not an object", raw(data=[1]), [WHERE, "node.joined: expected an object, got list"]),
    ("wrong field type", raw(data={"node_id": "node-0", "incarnation": "one"}),
     [WHERE, "node.joined.incarnation: expected an integer, got 'one'"]),
    ("bool is not an int", raw(data={"node_id": "node-0", "incarnation": True}),
     ["node.joined.incarnation: expected an integer, got True"]),
    ("wrong nested type", raw("round.started", {"round": 1, "members": ["node-0", 5], "nproc_per_node": 1}),
     [WHERE, "round.started.members[1]: expected str, got 5"]),
    ("list where a tuple's list belongs", raw("round.started", {"round": 1, "members": "node-0", "nproc_per_node": 1}),
     ["round.started.members: expected a list, got str"]),
    ("bad optional field", raw("node.started", {"node_id": "n", "incarnation": 1, "pid": "x"}),
     ["node.started.pid: expected an integer, got 'x'"]),
    ("bad enum value", raw("recovery.decided", {"round": 1, "action": "retry", "reason": "r"}),
     ["recovery.decided.action: 'retry' is not a valid RecoveryAction"]),
    ("missing field", raw(data={"incarnation": 1}), [WHERE, "node.joined: missing field 'node_id'"]),
    ("null for a required field", raw(data={"node_id": None, "incarnation": 1}),
     ["node.joined.node_id: expected str, got None"]),
    ("newer schema version", raw(v=2), [WHERE, "schema version 2", "reads 1", "upgrade stead"]),
    ("no seq", json.dumps({"type": "job.stopped", "v": 1, "at": 1.0, "data": {}}).encode(), [WHERE, "'seq'"]),
    ("seq not an integer", raw(seq="7"), [WHERE, "lacks an integer 'seq'"]),
    ("seq a bool", raw(seq=True), [WHERE, "lacks an integer 'seq'"]),
    ("time not a number", raw(at="noon"), [WHERE, "numeric 'at'"]),
]


@pytest.mark.parametrize(("body", "expected"), [r[1:] for r in BAD_RECORDS], ids=[r[0] for r in BAD_RECORDS])
def test_bad_record_fails_with_an_error_naming_where_and_what(body: bytes, expected: list[str]) -> None:
    with pytest.raises(CodecError) as info:
        decode_record(body, where=WHERE)
    for part in expected:
        assert part in str(info.value)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Kinds registered by a test vanish after it."""
    monkeypatch.setattr(events_base, "_REGISTRY", dict(events_base._REGISTRY))
    yield


class Tier(enum.Enum):
    MEMORY = "memory"
    DISK = "disk"


@dataclasses.dataclass(frozen=True)
class Shard:
    start: int
    stop: int


def test_a_plugin_kind_with_nested_fields_round_trips(registry: None) -> None:
    @event_kind("testplugin.leased", version=3)
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Leased(Event):
        shards: tuple[Shard, ...]
        tiers: frozenset[Tier]
        owner: Shard | None = None
        weights: dict[str, float] = dataclasses.field(default_factory=dict)

    event = Leased(shards=(Shard(start=0, stop=4), Shard(start=4, stop=8)), tiers=frozenset(Tier),
                   weights={"a": 0.5})
    encoded = encode_record(Record(seq=1, at=0.0, event=event))
    assert json.loads(encoded)["v"] == 3
    assert json.loads(encoded)["data"]["tiers"] == ["disk", "memory"]
    assert decode_record(encoded, where=WHERE).event == event
    older = encoded.replace(b'"v":3', b'"v":2')
    with pytest.raises(CodecError, match=r"'testplugin\.leased' has schema version 2, this stead reads 3"):
        decode_record(older, where=WHERE)


def test_unregistered_event_cannot_be_encoded(registry: None) -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Unregistered(Event):
        x: int = 0

    with pytest.raises(CodecError, match="Unregistered is not a registered event kind; decorate it with @event_kind"):
        encode_record(Record(seq=1, at=0.0, event=Unregistered()))


def test_a_type_name_cannot_be_taken_twice(registry: None) -> None:
    with pytest.raises(TypeError, match=r"'node\.joined' is already registered by NodeJoined"):
        @event_kind("node.joined")
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Impostor(Event):
            pass
    assert event_types()["node.joined"] is NodeJoined


def test_an_event_kind_must_be_a_frozen_dataclass(registry: None) -> None:
    class NotADataclass:
        x: int = 0

    with pytest.raises(TypeError, match="NotADataclass must be a frozen dataclass"):
        event_kind("testplugin.plain")(NotADataclass)  # type: ignore[type-var]
    assert "testplugin.plain" not in event_types()
