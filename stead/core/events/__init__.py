"""Typed events, their JSON codec, the typed names of timers and effects, and the append-only event log."""

from stead.core.events.base import Event, EventMark, Record, decode_record, encode_record, event_kind, event_types
from stead.core.events.kinds import *  # noqa: F403
from stead.core.events.kinds import __all__ as _kinds
from stead.core.events.names import *  # noqa: F403
from stead.core.events.names import __all__ as _names
from stead.core.events.numerics import *  # noqa: F403
from stead.core.events.numerics import __all__ as _numerics
from stead.core.events.warnings import *  # noqa: F403
from stead.core.events.warnings import __all__ as _warnings

__all__ = ["Event", "EventMark", "Record", "decode_record", "encode_record", "event_kind", "event_types", *_kinds,
           *_names, *_numerics, *_warnings]
