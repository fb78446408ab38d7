"""Request bodies with a repeated field at a chosen count, written on the protobuf wire: what a hostile client sends.

betterproto would take seconds to encode two million heartbeats; the wire format of the cheapest entries (an
empty message is two bytes, a packed zero one) is a byte string repeated::

    for path, owner in repeated_fields(ReportSavedRequest):          # (("ranks", "held_steps"), ("RankSaved", 3))
        body = body_with(ReportSavedRequest, path, count=3)           # one RankSaved holding three held steps
        frame = grpc_frame(body)                                       # what RawPeer.call sends as its prefix
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stead.core.rpc import length_delimited

__all__ = ["body_with", "grpc_frame", "repeated_fields"]

_FIXED_WIDTHS = {"double": 8, "fixed64": 8, "sfixed64": 8, "float": 4, "fixed32": 4, "sfixed32": 4}


def repeated_fields(cls: type, depth: int = 0) -> Iterator[tuple[tuple[str, ...], tuple[str, int]]]:
    """Every repeated field (a map included) of ``cls`` and of the messages in it: its path of field names from
    ``cls``, and its owner message's name and field number."""
    meta = _meta(cls)
    for number, name in meta.field_name_by_number.items():
        field = meta.meta_by_field_name[name]
        if field.repeated or field.proto_type == "map":
            yield (name,), (cls.__name__, number)
        if field.proto_type == "message" and depth < 8:
            for path, owner in repeated_fields(meta.cls_by_field[name], depth + 1):
                yield (name, *path), owner


def body_with(cls: type, path: tuple[str, ...], count: int) -> bytes:
    """A ``cls`` message whose repeated field at ``path`` holds ``count`` of its cheapest entries (an empty message
    or map entry, a zero, an empty string), inside one entry of every message on the way."""
    meta = _meta(cls)
    name, rest = path[0], path[1:]
    field = meta.meta_by_field_name[name]
    number = field.number
    if rest:
        return length_delimited(number, body_with(meta.cls_by_field[name], rest, count))
    if field.proto_type in ("message", "map", "string", "bytes"):
        return length_delimited(number, b"") * count
    return length_delimited(number, b"\x00" * (count * _FIXED_WIDTHS.get(field.proto_type, 1)))


def grpc_frame(body: bytes) -> bytes:
    """``body`` as a gRPC message: uncompressed, its length before it."""
    return b"\x00" + len(body).to_bytes(4, "big") + body


def _meta(cls: type) -> Any:
    return cls._betterproto  # type: ignore[attr-defined]  # what betterproto generated
