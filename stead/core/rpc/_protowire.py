"""The few pieces of the protobuf wire format stead reads and writes by hand, without a schema.

:mod:`._wire` reads a request's fields before betterproto decodes it; :mod:`._refusals` writes and reads a
``google.rpc.Status`` (whose types stead does not generate); ``tests/support/wire.py`` writes what a hostile
client sends. A field is a tag (its number and wire type, a varint) and a value: a varint, 8 bytes, 4 bytes, or
a length (a varint) and that many bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["FIXED32", "FIXED64", "LEN", "MAX_VARINT_BYTES", "VARINT", "WIDTHS", "encode_varint", "fields",
           "length_delimited", "read_varint", "tag", "varint_field"]

#: the wire types protobuf 3 uses (3 and 4, groups, are protobuf 2's)
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5
#: the fixed-width wire types' widths in bytes
WIDTHS = {FIXED64: 8, FIXED32: 4}
#: the longest varint (a 64-bit number, 7 bits a byte)
MAX_VARINT_BYTES = 10


def encode_varint(value: int) -> bytes:
    """``value`` (>= 0) as a varint: 7 bits a byte, lowest first, the high bit set on every byte but the last."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number: int, wire: int) -> bytes:
    return encode_varint(number << 3 | wire)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field ``number`` holding ``payload`` (a string, bytes, a message or packed numbers)."""
    return tag(number, LEN) + encode_varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    """Field ``number`` holding ``value``; nothing for 0, as protobuf 3 leaves a default out."""
    return tag(number, VARINT) + encode_varint(value) if value else b""


def read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``data[pos]`` (read no further than ``end``) and the position after it; ValueError for one
    that is cut off or longer than :data:`MAX_VARINT_BYTES`."""
    value = shift = 0
    for at in range(pos, min(end, pos + MAX_VARINT_BYTES)):
        byte = data[at]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at + 1
        shift += 7
    raise ValueError("a varint is cut off or longer than 10 bytes")


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """The fields of a message: (number, a varint's value or a length-delimited field's bytes); fixed-width fields
    are skipped. ValueError for what is not a message."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = read_varint(data, pos, end)
        wire = key & 7
        if wire == VARINT:
            value, pos = read_varint(data, pos, end)
            yield key >> 3, value
        elif wire == LEN:
            length, pos = read_varint(data, pos, end)
            if pos + length > end:
                raise ValueError("a field runs past the end of its message")
            yield key >> 3, data[pos:pos + length]
            pos += length
        elif wire in WIDTHS:
            pos += WIDTHS[wire]
            if pos > end:
                raise ValueError("a field runs past the end of its message")
        else:
            raise ValueError(f"wire type {wire}, which protobuf 3 does not use")
