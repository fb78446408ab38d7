"""Typed JSON conversion of dataclasses: shapes, round trips and errors that name the bad field."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import Any, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stead.core.errors import CodecError
from stead.core.serde import from_json, to_json


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.Enum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    name: str
    color: Color
    points: tuple[Point, ...]
    tags: frozenset[str] = frozenset()
    meta: dict[str, int] = dataclasses.field(default_factory=dict)
    index: Mapping[str, Point] = dataclasses.field(default_factory=dict)
    parent: Point | None = None
    pair: tuple[int, str] = (0, "")
    ratio: float = 1.0
    flag: bool = False
    kind: Literal["a", "b"] = "a"
    level: Level | None = None
    levels: frozenset[Level] = frozenset()
    size: int | str = 0
    extra: Any = None
    derived: int = dataclasses.field(default=0, init=False)


SHAPE = Shape(name="tri", color=Color.BLUE, points=(Point(0, 0), Point(1, 2)), tags=frozenset({"b", "a"}),
              meta={"k": 1}, index={"p": Point(3, 4)}, parent=Point(9, 9), pair=(1, "one"), ratio=0.5, flag=True,
              kind="b", level=Level.HIGH, levels=frozenset(Level), size="big", extra={"free": [1, "x"]})


def test_to_json_writes_plain_json_values() -> None:
    assert to_json(SHAPE) == {
        "name": "tri", "color": "blue", "points": [{"x": 0, "y": 0}, {"x": 1, "y": 2}], "tags": ["a", "b"],
        "meta": {"k": 1}, "index": {"p": {"x": 3, "y": 4}}, "parent": {"x": 9, "y": 9}, "pair": [1, "one"],
        "ratio": 0.5, "flag": True, "kind": "b", "level": 2, "levels": [1, 2], "size": "big",
        "extra": {"free": [1, "x"]},
    }


def test_round_trip_through_json_text_gives_an_equal_value() -> None:
    assert from_json(Shape, json.loads(json.dumps(to_json(SHAPE)))) == SHAPE


def test_absent_optional_fields_take_their_defaults() -> None:
    shape = from_json(Shape, {"name": "n", "color": "red", "points": []})
    assert shape == Shape(name="n", color=Color.RED, points=())
    assert (shape.parent, shape.tags, shape.meta) == (None, frozenset(), {})


def test_null_optional_fields_are_none() -> None:
    assert from_json(Shape, {"name": "n", "color": "red", "points": [], "parent": None, "level": None}).parent is None


def test_integer_is_accepted_where_a_float_is_expected() -> None:
    ratio = from_json(Shape, {"name": "n", "color": "red", "points": [], "ratio": 2}).ratio
    assert ratio == 2.0 and isinstance(ratio, float)


def test_a_frozenset_is_written_sorted_so_equal_sets_give_equal_bytes() -> None:
    a = Shape(name="n", color=Color.RED, points=(), tags=frozenset(["z", "m", "a"]))
    b = Shape(name="n", color=Color.RED, points=(), tags=frozenset(["a", "z", "m"]))
    assert json.dumps(to_json(a)) == json.dumps(to_json(b))
    assert to_json(a)["tags"] == ["a", "m", "z"]


def test_fields_not_in_init_are_not_written() -> None:
    assert "derived" not in to_json(SHAPE)


def test_unknown_keys_are_ignored() -> None:
    assert from_json(Point, {"x": 1, "y": 2, "z": 3}) == Point(1, 2)


SHAPES = st.builds(
    Shape,
    name=st.text(max_size=8),
    color=st.sampled_from(Color),
    points=st.lists(st.builds(Point, st.integers(), st.integers()), max_size=3).map(tuple),
    tags=st.frozensets(st.text(max_size=4), max_size=4),
    meta=st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    index=st.dictionaries(st.text(max_size=4), st.builds(Point, st.integers(), st.integers()), max_size=2),
    parent=st.none() | st.builds(Point, st.integers(), st.integers()),
    pair=st.tuples(st.integers(), st.text(max_size=4)),
    ratio=st.floats(allow_nan=False, allow_infinity=False),
    flag=st.booleans(),
    kind=st.sampled_from(["a", "b"]),
    level=st.none() | st.sampled_from(Level),
    levels=st.frozensets(st.sampled_from(Level)),
    size=st.integers() | st.text(max_size=4),
)


@settings(max_examples=150, deadline=None)
@given(SHAPES)
def test_any_value_round_trips(shape: Shape) -> None:
    assert from_json(Shape, json.loads(json.dumps(to_json(shape)))) == shape


def shape_json(**changes: Any) -> dict[str, Any]:
    return {**to_json(SHAPE), **changes}


BAD: list[tuple[str, Any, str]] = [
    ("not an object", [1], "Shape: expected an object, got list"),
    ("missing required field", {"name": "n", "color": "red"}, "Shape: missing field 'points'"),
    ("wrong scalar", shape_json(name=3), "Shape.name: expected str, got 3"),
    ("bool is not an int", shape_json(meta={"k": True}), "Shape.meta.k: expected an integer, got True"),
    ("bool is not a float", shape_json(ratio=False), "Shape.ratio: expected a number, got False"),
    ("string is not a bool", shape_json(flag="yes"), "Shape.flag: expected bool, got 'yes'"),
    ("bad enum value", shape_json(color="green"), "Shape.color: 'green' is not a valid Color"),
    ("bad enum in a set", shape_json(levels=[1, 3]), "Shape.levels[1]: 3 is not a valid Level"),
    ("nested field", shape_json(points=[{"x": 0, "y": 0}, {"x": "a", "y": 0}]),
     "Shape.points[1].x: expected an integer, got 'a'"),
    ("nested missing field", shape_json(points=[{"x": 0}]), "Shape.points[0]: missing field 'y'"),
    ("tuple not a list", shape_json(points={"x": 0}), "Shape.points: expected a list, got dict"),
    ("fixed tuple length", shape_json(pair=[1]), "Shape.pair: expected 2 items, got 1"),
    ("fixed tuple item", shape_json(pair=[1, 2]), "Shape.pair[1]: expected str, got 2"),
    ("frozenset not a list", shape_json(tags="ab"), "Shape.tags: expected a list, got str"),
    ("dict not an object", shape_json(meta=[1]), "Shape.meta: expected an object, got list"),
    ("mapping value", shape_json(index={"p": {"x": 1}}), "Shape.index.p: missing field 'y'"),
    ("optional nested", shape_json(parent={"x": "1", "y": 1}), "Shape.parent.x: expected an integer, got '1'"),
    ("optional enum", shape_json(level=7), "Shape.level: 7 is not a valid Level"),
    ("union of scalars", shape_json(size=1.5),
     "Shape.size: expected an integer, got 1.5; Shape.size: expected str, got 1.5"),
    ("literal", shape_json(kind="c"), "Shape.kind: expected one of ('a', 'b'), got 'c'"),
    ("null for a required field", shape_json(name=None), "Shape.name: expected str, got None"),
]


@pytest.mark.parametrize(("data", "message"), [r[1:] for r in BAD], ids=[r[0] for r in BAD])
def test_bad_value_fails_naming_the_field_path(data: Any, message: str) -> None:
    with pytest.raises(CodecError) as info:
        from_json(Shape, data)
    assert message in str(info.value)


def test_path_prefix_can_be_given() -> None:
    with pytest.raises(CodecError, match=r"^snapshot\.x: expected an integer"):
        from_json(Point, {"x": None, "y": 1}, path="snapshot")


def test_unsupported_field_type_is_reported() -> None:
    @dataclasses.dataclass(frozen=True)
    class Blob:
        data: bytes

    with pytest.raises(CodecError, match=r"Blob\.data: unsupported field type"):
        from_json(Blob, {"data": "AA=="})


@pytest.mark.parametrize("value", [b"bytes", {1, 2}, object(), Point], ids=["bytes", "set", "object", "class"])
def test_unsupported_value_cannot_be_encoded(value: object) -> None:
    with pytest.raises(CodecError, match="cannot encode"):
        to_json(value)


def test_a_frozenset_of_dataclasses_is_encoded() -> None:
    @dataclasses.dataclass(frozen=True)
    class Corners:
        points: frozenset[Point]

    value = Corners(points=frozenset({Point(1, 2), Point(0, 5)}))
    assert from_json(Corners, json.loads(json.dumps(to_json(value)))) == value
