"""Typed conversion between frozen dataclasses and JSON-safe values.

Events, effects and state snapshots are stored as JSON, never pickled. This
module turns a dataclass into plain dicts/lists/scalars and back, checking every
value against the field's type hint so that a malformed record fails loudly with
the path of the bad field.

Supported field types: ``str``, ``int``, ``float``, ``bool``, ``None``, ``Enum``
subclasses, ``tuple[X, ...]``, ``tuple[X, Y]``, ``frozenset[X]``, ``dict[str, X]``,
nested dataclasses, and ``X | None`` / unions of those.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, TypeVar, Union, get_args, get_origin

from stead.core.errors import CodecError

__all__ = ["from_json", "to_json"]

T = TypeVar("T")
JsonValue = Any


def to_json(value: Any) -> JsonValue:
    """Convert a dataclass (or supported value) to JSON-safe Python values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in _fields(type(value))}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, frozenset):  # sorted by their JSON text, so any item type has a stable order
        return sorted((to_json(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise CodecError(f"cannot encode {type(value).__name__!r} value {value!r}: "
                     "only dataclasses, enums, tuples, dicts and scalars are supported")


def from_json(cls: type[T], data: JsonValue, *, path: str = "") -> T:
    """Build ``cls`` from JSON values, validating every field against its hint."""
    result: T = _convert(cls, data, path or cls.__name__)
    return result


@cache
def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(tp: Any, data: Any, path: str) -> Any:
    if tp is Any:
        return data
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = get_args(tp)
        if data is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, data, path)
            except CodecError as exc:
                errors.append(str(exc))
        raise CodecError("; ".join(errors) or f"{path}: unexpected null")
    if origin is typing.Literal:
        if data in get_args(tp):
            return data
        raise CodecError(f"{path}: expected one of {get_args(tp)!r}, got {data!r}")
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(data, list):
            raise CodecError(f"{path}: expected a list, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise CodecError(f"{path}: expected {len(args)} items, got {len(data)}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
    if origin is frozenset:
        (arg,) = get_args(tp)
        if not isinstance(data, list):
            raise CodecError(f"{path}: expected a list, got {type(data).__name__}")
        return frozenset(_convert(arg, v, f"{path}[{i}]") for i, v in enumerate(data))
    if origin in (dict, Mapping, typing.Mapping):
        key_tp, val_tp = get_args(tp)
        if not isinstance(data, dict):
            raise CodecError(f"{path}: expected an object, got {type(data).__name__}")
        return {_convert(key_tp, k, f"{path}.<key>"): _convert(val_tp, v, f"{path}.{k}")
                for k, v in data.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise CodecError(f"{path}: expected an object, got {type(data).__name__}")
        hints = _hints(tp)
        kwargs = {}
        for f in _fields(tp):
            if f.name in data:
                kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{path}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise CodecError(f"{path}: missing field {f.name!r}")
        return tp(**kwargs)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise CodecError(f"{path}: {data!r} is not a valid {tp.__name__}") from None
    if tp is float:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return float(data)
        raise CodecError(f"{path}: expected a number, got {data!r}")
    if tp is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
        raise CodecError(f"{path}: expected an integer, got {data!r}")
    if tp in (str, bool):
        if isinstance(data, tp):
            return data
        raise CodecError(f"{path}: expected {tp.__name__}, got {data!r}")
    if tp is type(None):
        if data is None:
            return None
        raise CodecError(f"{path}: expected null, got {data!r}")
    raise CodecError(f"{path}: unsupported field type {tp!r}")
