"""Checksums over checkpoint bytes: XXH3-64 of every tensor and of every document.

XXH3 (the ``xxhash`` package) is a real hash: any reordering, shifted or swapped
words, or offsetting changes across words changes it with overwhelming likelihood,
where a sum of words misses them. It runs at several times memory bandwidth and
releases the GIL, so the agent computes it off the training thread.

:func:`sum64`, the wrapping sum of 64-bit words, is what stead wrote before
(manifest format 1): it is kept to read those checkpoints, never to write.
"""

from __future__ import annotations

import numpy as np
import xxhash

__all__ = ["checksum", "hasher", "sum64", "with_digest", "without_digest"]

_MASK = (1 << 64) - 1
_LENGTH_MIX = 0x9E3779B97F4A7C15
#: the key of a document's own digest; always the document's last key
_DIGEST = b',"digest":"'


def checksum(buf: memoryview | bytes | bytearray) -> int:
    """XXH3-64 of ``buf``'s bytes."""
    state = hasher()
    state.update(memoryview(buf).cast("B"))
    return state.intdigest()


def hasher() -> xxhash.xxh3_64:
    """An XXH3-64 state to feed piece by piece (``update``, then ``intdigest``): :func:`checksum` of the whole."""
    return xxhash.xxh3_64()


def sum64(buf: memoryview | bytes | bytearray) -> int:
    """The checksum of manifest format 1: wrapping sum of little-endian 64-bit words, length mixed in."""
    view = memoryview(buf).cast("B")
    n = len(view)
    words = n // 8
    total = int(np.add.reduce(np.frombuffer(view, dtype="<u8", count=words))) if words else 0
    if n % 8:
        total += int.from_bytes(view[words * 8:], "little")
    return (total + n * _LENGTH_MIX) & _MASK


def with_digest(document: bytes) -> bytes:
    """``document`` (a JSON object) with a last key ``digest``: the XXH3-64 of the object without it.

    The document stays JSON; :func:`without_digest` finds the key again even when
    the tree holds a key of the same name, because ours is the last one.
    """
    if not document.endswith(b"}"):
        raise ValueError("a digest is added to a JSON object")
    return document[:-1] + _DIGEST + f'{checksum(document):016x}"}}'.encode()


def without_digest(raw: bytes) -> bytes | None:
    """The document that :func:`with_digest` sealed, if ``raw`` is one and its digest matches; else None."""
    at = raw.rfind(_DIGEST)
    tail = raw[at + len(_DIGEST):].rstrip()
    if at < 0 or len(tail) != 18 or not tail.endswith(b'"}'):
        return None
    document = raw[:at] + b"}"
    try:
        return document if int(tail[:16], 16) == checksum(document) else None
    except ValueError:
        return None
