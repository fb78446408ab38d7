"""The event base class, the registry of event kinds and the JSON codec.

Every event kind is a frozen dataclass registered under a dotted type name
(``node.joined``) and a schema version. The codec writes
``{"type": ..., "v": ..., "seq": ..., "at": ..., "data": {...}}`` and refuses
unknown types and malformed records with an error that names the record.
Plugins add their own kinds under their own namespace (``diagnosis.hang``). A kind may say how a
timeline (``stead report``) marks it (:class:`EventMark`), so readers of the log find what it
means from its class, not from its name.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from stead.core.errors import CodecError
from stead.core.serde import from_json, to_json

__all__ = ["EncodedEvent", "Event", "EventMark", "Record", "decode_record", "encode", "encode_record", "event_kind",
           "event_types"]

_REGISTRY: dict[str, type[Event]] = {}

E = TypeVar("E", bound="Event")


class EventMark(enum.StrEnum):
    """What an event of a kind says happened, as a timeline marks it (``stead report``)."""

    FAILURE = "failure"
    DIAGNOSIS = "diagnosis"
    DECISION = "decision"
    CHECKPOINT = "checkpoint"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every event kind. Subclasses are registered with :func:`event_kind`."""

    type_name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    #: how a timeline marks events of this kind; None: it does not
    mark: ClassVar[EventMark | None] = None


def event_kind(name: str, *, version: int = 1, mark: EventMark | None = None) -> Callable[[type[E]], type[E]]:
    """Register an event class under ``name`` (dotted, namespaced by owner); ``mark``: how a timeline marks it."""

    def register(cls: type[E]) -> type[E]:
        params = cls.__dict__.get("__dataclass_params__")  # the class itself, not only a base, is a dataclass
        if params is None or not params.frozen:
            raise TypeError(f"event {cls.__name__} must be a frozen dataclass: decorate it with "
                            "@dataclasses.dataclass(frozen=True, kw_only=True)")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise TypeError(f"event type {name!r} is already registered by {existing.__qualname__}")
        cls.type_name = name
        cls.version = version
        cls.mark = mark
        _REGISTRY[name] = cls
        return cls

    return register


def event_types() -> dict[str, type[Event]]:
    """All registered event kinds by type name."""
    return dict(_REGISTRY)


@dataclasses.dataclass(frozen=True)
class Record:
    """An event as stored in the log: its sequence number and append time."""

    seq: int
    at: float
    event: Event


def encode_event(event: Event) -> dict[str, Any]:
    cls = type(event)
    if not cls.type_name:
        raise CodecError(f"{cls.__qualname__} is not a registered event kind; decorate it with @event_kind")
    return {"type": cls.type_name, "v": cls.version, "data": to_json(event)}


def decode_event(obj: Any, *, where: str) -> Event:
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str) or "data" not in obj:
        raise CodecError(f"{where}: not an event record (needs 'type' and 'data'): {str(obj)[:200]}")
    name = obj["type"]
    cls = _REGISTRY.get(name)
    if cls is None and _load_plugin_kinds():
        cls = _REGISTRY.get(name)
    if cls is None:
        raise CodecError(f"{where}: unknown event type {name!r}; is the plugin that defines it installed?")
    version = obj.get("v", 1)
    if version != cls.version:
        raise CodecError(f"{where}: event {name!r} has schema version {version!r}, this stead reads {cls.version}; "
                         "upgrade stead to read this log")
    try:
        return from_json(cls, obj["data"], path=f"{where} {name}")
    except TypeError as exc:
        raise CodecError(f"{where}: {name}: {exc}") from exc


_plugins_imported = False


def _load_plugin_kinds() -> bool:
    """Import the installed plugins (``stead.plugins`` entry points) once, registering their event kinds.

    A reader of the log (``stead events``, ``stead status``) meets ``ckpt.persisted`` and the
    like without having loaded the plugins the master ran. True when this call imported them.
    """
    global _plugins_imported
    if _plugins_imported:
        return False
    _plugins_imported = True
    from stead.core.entrypoints import load_group

    load_group("stead.plugins", what="plugin")  # a broken one is logged and skipped: its events stay unknown
    return True


#: the most bytes a record adds to its event's type name and data: the keys and punctuation, a ``seq`` of 20 digits
#: (the log's keys have 20), an ``at`` of 24 characters (the longest repr of a float) and a version of 6 digits
_RECORD_FRAME_BYTES = len(b'{"at":,"data":,"seq":,"type":,"v":}') + 20 + 24 + 6


@dataclasses.dataclass(frozen=True)
class EncodedEvent:
    """An event encoded once, before it has a seq and a time: its records are spliced around ``data``."""

    event: Event
    #: the JSON of the event's fields, keys sorted
    data: bytes
    #: the JSON string of its type name
    type_json: bytes

    @property
    def record_bytes(self) -> int:
        """The most bytes a record of this event takes, whatever its seq and time."""
        return len(self.data) + len(self.type_json) + _RECORD_FRAME_BYTES


def encode(event: Event) -> EncodedEvent:
    """Encode ``event`` for :func:`encode_record`; CodecError if it is not a registered kind."""
    body = encode_event(event)
    return EncodedEvent(event=event, data=json.dumps(body["data"], separators=(",", ":"), sort_keys=True).encode(),
                        type_json=json.dumps(body["type"]).encode())


def encode_record(record: Record, encoded: EncodedEvent | None = None) -> bytes:
    """The stored bytes of ``record`` (``encoded``: its event, encoded already), as JSON with sorted keys."""
    if encoded is None:
        encoded = encode(record.event)
    return b"".join((b'{"at":', _number(record.at), b',"data":', encoded.data, b',"seq":', _number(record.seq),
                     b',"type":', encoded.type_json, b',"v":', _number(type(record.event).version), b"}"))


def _number(value: float) -> bytes:
    """``value`` as json.dumps writes it (the repr of an int or a finite float), without its call's cost."""
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return repr(value).encode()
    return json.dumps(value).encode()


def decode_record(raw: bytes, *, where: str) -> Record:
    """Decode one stored record; ``where`` names it (the store key) in errors."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"{where}: corrupt event record, not JSON ({exc}); "
                         "restore the key from a backup or delete the job's log") from exc
    event = decode_event(obj, where=where)
    seq, at = obj.get("seq"), obj.get("at")
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(at, (int, float)):
        raise CodecError(f"{where}: event record lacks an integer 'seq' or numeric 'at'")
    return Record(seq=seq, at=float(at), event=event)
