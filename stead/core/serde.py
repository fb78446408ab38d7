"""Typed conversion between frozen dataclasses and JSON-safe values.

Events, effects and state snapshots are stored as JSON, never pickled. This
module turns a dataclass into plain dicts/lists/scalars and back, checking every
value against the field's type hint so that a malformed record fails loudly with
the path of the bad field.

Supported field types: ``str``, ``int``, ``float``, ``bool``, ``None``, ``Enum``
subclasses, ``tuple[X, ...]``, ``tuple[X, Y]``, ``frozenset[X]``, ``dict[str, X]``,
nested dataclasses, and ``X | None`` / unions of those. A :class:`WireName` (a timer's
or an effect's typed name) is stored as one string, ``kind/field/...``: the form the
log has always had, so a typed name reads old records; a union of them, a dict keyed
by them, reads each string as the one kind it names.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, ClassVar, Self, TypeVar, Union, get_args, get_origin

from stead.core.errors import CodecError

__all__ = ["WireName", "from_json", "to_json"]

T = TypeVar("T")
JsonValue = Any


class WireName:
    """Base of a frozen dataclass stored as one string: its ``prefix``, then its fields' values, ``/`` between.

    Its fields are ``int``s (written in decimal) and at most one ``str`` or :class:`WireName` (union), which takes
    whatever lies between the ints before and after it (a node id, an emission key, a timer's name). ``str()`` gives
    the stored form, :meth:`parse` reads it back; a subclass with another form overrides both.
    """

    prefix: ClassVar[str]

    @classmethod
    def form(cls) -> str:
        """The stored form, for an error that lists what a name may be (``decision/ROUND``)."""
        kind: type = cls
        return "/".join((cls.prefix, *(f.name.upper() for f in _fields(kind))))

    def __str__(self) -> str:
        kind: type = type(self)
        return "/".join((self.prefix, *(str(getattr(self, f.name)) for f in _fields(kind))))

    @classmethod
    def parse(cls, text: str) -> Self | None:
        """``text`` read as a name of this kind; None when it is not one."""
        head, sep, rest = text.partition("/")
        kind: type = cls
        fields = _fields(kind)
        if head != cls.prefix or bool(sep) != bool(fields):
            return None
        parts = rest.split("/") if sep else []
        hints = _hints(kind)
        wide = [i for i, f in enumerate(fields) if hints[f.name] is not int]  # the one field that may hold a "/"
        if len(parts) < len(fields) or (not wide and len(parts) != len(fields)):
            return None
        if wide:  # the ints after it take the last parts, the wide field what is left between
            w, after = wide[0], len(fields) - wide[0] - 1
            parts = [*parts[:w], "/".join(parts[w:len(parts) - after]), *parts[len(parts) - after:]]
        values: dict[str, Any] = {}
        for f, part in zip(fields, parts, strict=True):
            hint = hints[f.name]
            if hint is int:
                try:
                    number = int(part)
                except ValueError:
                    return None
                if str(number) != part:  # only the form str() writes: "+1", "01", "1_0" are no names of ours
                    return None
                values[f.name] = number
            elif hint is str:
                values[f.name] = part
            else:
                inner = _parse_name(_wire_names(hint), part)
                if inner is None:
                    return None
                values[f.name] = inner
        return cls(**values)


@cache
def _wire_names(tp: Any) -> tuple[type[WireName], ...]:
    """The WireName kinds ``tp`` is (one, or a union of them); () when it is anything else."""
    args = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
    kinds = tuple(a for a in args if a is not type(None))
    if kinds and all(isinstance(a, type) and issubclass(a, WireName) for a in kinds):
        return kinds
    return ()


def _parse_name(kinds: tuple[type[WireName], ...], text: str) -> WireName | None:
    for kind in kinds:
        value = kind.parse(text)
        if value is not None:
            return value
    return None


def to_json(value: Any) -> JsonValue:
    """Convert a dataclass (or supported value) to JSON-safe Python values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, WireName):
            return str(value)
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
    if isinstance(data, str) and (names := _wire_names(tp)):
        value = _parse_name(names, data)
        if value is None:
            raise CodecError(f"{path}: {data!r} is not a name this stead reads (expected "
                             f"{' or '.join(kind.form() for kind in names)}); read it with the stead that wrote it")
        return value
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
