"""A fast checksum over tensor bytes: the wrapping sum of little-endian 64-bit words.

It is not cryptographic: it catches torn copies (a slot or file that mixes two
states), truncation and flipped bits, at memory speed (numpy's reduction, which
releases the GIL, so the agent computes it off the training thread).
"""

from __future__ import annotations

import numpy as np

__all__ = ["sum64"]

_MASK = (1 << 64) - 1
_LENGTH_MIX = 0x9E3779B97F4A7C15


def sum64(buf: memoryview | bytes | bytearray) -> int:
    """Checksum of ``buf`` (its length is mixed in, so trailing zeros count)."""
    view = memoryview(buf).cast("B")
    n = len(view)
    words = n // 8
    total = int(np.add.reduce(np.frombuffer(view, dtype="<u8", count=words))) if words else 0
    if n % 8:
        total += int.from_bytes(view[words * 8:], "little")
    return (total + n * _LENGTH_MIX) & _MASK
