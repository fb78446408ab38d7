"""Typed events, their JSON codec and the append-only event log."""

from stead.core.events.base import Event, EventMark, Record, decode_record, encode_record, event_kind, event_types
from stead.core.events.kinds import *  # noqa: F403
from stead.core.events.kinds import __all__ as _kinds

__all__ = ["Event", "EventMark", "Record", "decode_record", "encode_record", "event_kind", "event_types", *_kinds]
