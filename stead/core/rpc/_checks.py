"""What a request may hold, checked before any servicer sees it: bounded strings, finite floats, clean names.

Every string field of every request is bounded: :data:`FIELD_BOUNDS` names the ones
whose bound is not :data:`MAX_TEXT_CHARS` (a stderr tail, a stack dump, a phase name),
and every other string, a plugin's own messages' included, gets :data:`MAX_TEXT_CHARS`.
Every float (a duration, a percentage, a time) must be finite. The server's codec runs
:func:`check_request` on each message it decodes, so a 2 MiB heartbeat phase or a NaN
time never reaches the event log.

Ids that end up in store keys, file paths, process names or Kubernetes labels (node
ids, dataset names, ...) are checked by the servicers with :func:`check_name`; the
rule itself is :func:`name_problem`, which a plugin's own checks reuse. A refusal is
INVALID_ARGUMENT naming the field, the bound and what to send.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Mapping
from typing import Any, Literal

from stead.core.events import MAX_WARNING_SAID_CHARS
from stead.core.rpc._status import invalid
from stead.core.rpc.backend import MAX_ERROR_TAIL_CHARS, MAX_EVIDENCE_CHARS, MAX_HOST_CHARS

__all__ = [
    "FIELD_BOUNDS",
    "MAX_NODE_ID_CHARS",
    "MAX_PHASE_CHARS",
    "MAX_STACK_CHARS",
    "MAX_TEXT_CHARS",
    "check_name",
    "check_request",
    "name_problem",
]

#: the longest string a request field may hold unless :data:`FIELD_BOUNDS` (or its servicer) says otherwise: a
#: name, a label, a short reason
MAX_TEXT_CHARS = 256
#: the longest node id (a DNS name, so that a Kubernetes pod name always fits)
MAX_NODE_ID_CHARS = 253
#: the longest phase name a heartbeat carries: the agent reads 24 bytes of UTF-8 per worker (``stead.phase``)
MAX_PHASE_CHARS = 24
#: the longest stack dump of one worker a StacksReport carries
MAX_STACK_CHARS = 64 * 1024
#: the longest command id an agent acknowledges: a node id and a kind, a round or a check number
MAX_COMMAND_ID_CHARS = MAX_NODE_ID_CHARS + 64
#: the longest file system path a request carries (Linux's PATH_MAX)
MAX_PATH_CHARS = 4096

#: ``Message.field`` -> (its longest value, what to send), for the strings whose bound is not MAX_TEXT_CHARS
FIELD_BOUNDS: Mapping[str, tuple[int, str]] = {
    "RegisterRequest.host": (MAX_HOST_CHARS, "the agent's host name or address"),
    "HeartbeatRequest.phase": (MAX_PHASE_CHARS, "the phase's name, as stead.phase() keeps it"),
    "HeartbeatRequest.acked": (MAX_COMMAND_ID_CHARS, "the command's id, as the master sent it"),
    "FailureReport.error_tail": (MAX_ERROR_TAIL_CHARS, "the end of the worker's stderr"),
    "FailureReport.oom": (MAX_EVIDENCE_CHARS, "the record itself, not a log"),
    "FailureReport.gpu": (MAX_EVIDENCE_CHARS, "the record itself, not a log"),
    "WorkerStack.stack": (MAX_STACK_CHARS, "cut the dump"),
    "StacksReport.method": (64, "how the stacks were taken, e.g. faulthandler"),
    "StacksReport.error": (MAX_EVIDENCE_CHARS, "what went wrong, not a log"),
    "HealthReport.error": (MAX_EVIDENCE_CHARS, "what went wrong, not a log"),
    "PeerCollective.error": (MAX_EVIDENCE_CHARS, "what went wrong, not a log"),
    "ReportSavedRequest.path": (MAX_PATH_CHARS, "the step's directory"),
    "ReportCorruptRequest.detail": (MAX_EVIDENCE_CHARS, "what failed, in a line or a few"),
    "WarnedReport.said": (MAX_WARNING_SAID_CHARS, "the warning's source's words, in a line"),
    "ScaleRequest.by": (200, "who asks, in a few words"),
    "ScaleRequest.reason": (500, "why, in a sentence"),
}

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_NAME_RULE = "letters, digits, '.', '_' or '-', starting with a letter or digit"
#: how much of a refused value a message quotes
_QUOTED_CHARS = 40


def name_problem(where: str, value: str, *, max_chars: int, what: str = "") -> str | None:
    """Why ``value`` is not a name (an id that may become a store key, a file name, a process name or a
    Kubernetes label), or None when it is one: 1 to ``max_chars`` of :data:`_NAME_RULE`."""
    if value and len(value) <= max_chars and _NAME.fullmatch(value):
        return None
    send = f"pass {what}: " if what else "use "
    if not value:
        return f"{where} is empty: {send}1-{max_chars} {_NAME_RULE}"
    shown = repr(value) if len(value) <= _QUOTED_CHARS else f"{value[:_QUOTED_CHARS]!r}... ({len(value)} characters)"
    return f"{where} {shown} is not a valid name: {send}1-{max_chars} {_NAME_RULE}"


def check_name(where: str, value: str, *, max_chars: int, what: str = "") -> str:
    """``value`` itself when it is a name (see :func:`name_problem`); INVALID_ARGUMENT otherwise."""
    problem = name_problem(where, value, max_chars=max_chars, what=what)
    if problem is not None:
        invalid(problem)
    return value


def check_request(message: Any) -> None:
    """INVALID_ARGUMENT unless every string of ``message`` (nested messages, lists and maps included) is within
    its bound and every float is finite."""
    _walk(message, type(message).__name__)


_Shape = Literal["one", "list", "map"]


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    kind: Literal["str", "float", "message"]
    #: "one" value, a "list" of them, or the values of a "map"
    shape: _Shape
    #: a string's bound and what to send instead
    longest: int = MAX_TEXT_CHARS
    send: str = ""
    #: the nested message's type
    nested: type | None = None


def _walk(message: Any, path: str) -> None:
    for field in _plan(type(message)):
        value = getattr(message, field.name)
        if value is None:
            continue
        where = f"{path}.{field.name}"
        if field.shape == "one":
            _check_one(field, value, where)
        elif field.shape == "list":
            for i, item in enumerate(value):
                _check_one(field, item, f"{where}[{i}]")
        else:
            for key, item in value.items():
                _check_one(field, item, f"{where}[{key!r}]")


def _check_one(field: _Field, value: Any, where: str) -> None:
    if field.kind == "str":
        if len(value) > field.longest:
            invalid(f"{where} has {len(value)} characters: send at most {field.longest} ({field.send})")
    elif field.kind == "float":
        if not math.isfinite(value):
            invalid(f"{where} is {value!r}: send a finite number")
    elif value is not None:
        _walk(value, where)


_PLANS: dict[type, tuple[_Field, ...]] = {}
_SHORT_TEXT = (MAX_TEXT_CHARS, "a name or a short label")
_FLOATS = frozenset({"double", "float"})


def _plan(cls: type) -> tuple[_Field, ...]:
    """The fields of ``cls`` that need a look: strings, floats, and messages (worked out once per type)."""
    plan = _PLANS.get(cls)
    if plan is not None:
        return plan
    hints = typing.get_type_hints(cls)
    fields = []
    for field in dataclasses.fields(cls):
        meta = field.metadata.get("betterproto")
        if meta is None:
            continue
        kind: str = meta.proto_type
        shape: _Shape = "list" if meta.repeated else "one"
        if kind == "map" and meta.map_meta is not None:
            kind, shape = meta.map_meta[1].proto_type, "map"
        nested = _message_type(hints[field.name]) if kind == "message" else None
        if kind == "string":
            longest, send = FIELD_BOUNDS.get(f"{cls.__name__}.{field.name}", _SHORT_TEXT)
            fields.append(_Field(field.name, "str", shape, longest, send))
        elif kind in _FLOATS:
            fields.append(_Field(field.name, "float", shape))
        elif nested is not None:
            fields.append(_Field(field.name, "message", shape, nested=nested))
    plan = _PLANS[cls] = tuple(fields)
    return plan


def _message_type(hint: Any) -> type | None:
    """``X`` from ``X``, ``X | None``, ``list[X]`` or ``dict[K, X]``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if not args:
        return hint if isinstance(hint, type) else None
    return _message_type(args[-1])
