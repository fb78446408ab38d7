"""KvService: a small in-memory key-value store the master serves to workers.

Workers coordinate through it (torch's rendezvous needs one), so no training
node hosts a store that dies with it. Values are bytes; ``add`` keeps a counter
as decimal ASCII, as torch's stores do, so ``get`` of a counter reads ``b"3"``.
"""

from __future__ import annotations

import asyncio
import math

from stead.core.rpc._proto.stead.v1 import (
    Ack,
    KvAddReply,
    KvAddRequest,
    KvDeleteReply,
    KvDeleteRequest,
    KvGetReply,
    KvGetRequest,
    KvServiceBase,
    KvSetRequest,
)
from stead.core.rpc._status import invalid

__all__ = ["KvServicer"]

_MAX_KEY = 1024
_INT64 = range(-(2**63), 2**63)


def _check_key(where: str, key: str) -> str:
    if not key:
        invalid(f"{where}.key is empty: pass the key to use")
    if len(key) > _MAX_KEY:
        invalid(f"{where}.key is {len(key)} characters long: use at most {_MAX_KEY}")
    return key


class KvServicer(KvServiceBase):
    """Serves KvService from a dict held in memory (it lives as long as the master)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        # One condition for every key: waiters are few (one per worker at most) and wake rarely.
        self._changed = asyncio.Condition()

    async def set(self, message: KvSetRequest) -> Ack:
        key = _check_key("KvSetRequest", message.key)
        async with self._changed:
            self._data[key] = message.value
            self._changed.notify_all()
        return Ack()

    async def get(self, message: KvGetRequest) -> KvGetReply:
        key = _check_key("KvGetRequest", message.key)
        wait_s = message.wait_timeout_s
        if not (math.isfinite(wait_s) and wait_s >= 0):
            invalid(f"KvGetRequest.wait_timeout_s is {wait_s}: send a finite number of seconds >= 0 (0: do not wait)")
        if key not in self._data and wait_s > 0:
            try:
                async with asyncio.timeout(wait_s), self._changed:
                    await self._changed.wait_for(lambda: key in self._data)
            except TimeoutError:
                pass
        value = self._data.get(key)
        return KvGetReply(found=value is not None, value=value or b"")

    async def add(self, message: KvAddRequest) -> KvAddReply:
        key = _check_key("KvAddRequest", message.key)
        async with self._changed:
            raw = self._data.get(key, b"0")
            try:
                current = int(raw.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                invalid(f"KvAddRequest.key {key!r} holds {raw[:32]!r}, not an integer: "
                        "use add only on keys that hold counters")
            total = current + message.delta
            if total not in _INT64:
                invalid(f"KvAddRequest.delta {message.delta} makes {key!r} overflow a 64-bit integer")
            self._data[key] = str(total).encode("ascii")
            self._changed.notify_all()
        return KvAddReply(value=total)

    async def delete(self, message: KvDeleteRequest) -> KvDeleteReply:
        key = _check_key("KvDeleteRequest", message.key)
        return KvDeleteReply(deleted=self._data.pop(key, None) is not None)

    def __repr__(self) -> str:
        return f"KvServicer({len(self._data)} keys)"
