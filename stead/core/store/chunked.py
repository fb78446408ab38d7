"""One key's value of any size, on a store whose writes are bounded (etcd takes 1.5 MiB in one request).

:class:`ChunkedValue` writes a value that fits in one write to its key as it is, so
a key written by plain ``put`` (or by an older stead) reads back unchanged. A larger
value is cut into chunks of what one write takes, written under one of two slots::

    <key>                          "stead-chunked:" {"slot": s, "chunks": n, "size": b, "sha256": h}
    <key>/chunks/<s>/<index:06d>   the chunks, in order

and only then does the key get the head that names them; the other slot is
emptied after. So the key always names a complete value: a writer that dies
between chunks leaves the previous head and its chunks in place (the next write
clears what it left, its slot being the one written next). A reader checks the
count, size and SHA-256 of the chunks against the head; if they do not match and
the head has changed meanwhile (a writer replaced the value under it), it reads
again, so it never returns a torn value.

One writer per key (the job's master), as for the event log; a ``ChunkedValue``
serialises its own writes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

from stead.core.errors import CodecError
from stead.core.store._common import write_size
from stead.core.store.base import KeyValue, StateStore

__all__ = ["ChunkedValue"]

#: how a head starts: no JSON value does, and a plain value that starts so is written in chunks, never as is
_HEAD = b"stead-chunked:"
_SLOTS = (0, 1)


@dataclasses.dataclass(frozen=True)
class _Head:
    slot: int
    chunks: int
    size: int
    sha256: str

    def encode(self) -> bytes:
        return _HEAD + json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()


class ChunkedValue:
    """``await value.put(data)`` / ``await value.get()`` for the key ``key`` of ``store``, whatever ``data``'s size."""

    def __init__(self, store: StateStore, key: str) -> None:
        self.store = store
        self.key = key
        self._chunks = f"{key}/chunks/"
        self._lock = asyncio.Lock()
        #: the slot of the head this object wrote last (None: a plain value); unknown after a failed write
        self._slot: int | None = None
        #: whether no chunk is stored outside that slot (known only after a write of this object went through)
        self._tidy = False
        self._known = False

    def _chunk_key(self, slot: int, index: int) -> str:
        return f"{self._chunks}{slot}/{index:06d}"

    async def get(self) -> bytes | None:
        """The value, checked whole; None when the key is absent. CodecError when the chunks are torn for good."""
        return await self.value_of(await self.store.get(self.key))

    async def value_of(self, kv: KeyValue | None) -> bytes | None:
        """The value that ``kv``, this key as a ``get`` or ``range`` returned it, stands for (see :meth:`get`)."""
        while kv is not None:
            head = self._head(kv)
            if head is None:
                return kv.value
            value, wrong = await self._gather(head)
            if value is not None:
                return value
            again = await self.store.get(self.key)
            if again is not None and again.mod_revision == kv.mod_revision:
                raise CodecError(f"{self.key} names {head.chunks} chunks ({head.size} bytes) under "
                                 f"{self._chunks}{head.slot}/, but {wrong}; the value is lost: delete {self.key} "
                                 f"and {self._chunks} and write it again")
            kv = again  # a writer replaced the value while it was read: read the new one
        return None

    def _head(self, kv: KeyValue) -> _Head | None:
        if not kv.value.startswith(_HEAD):
            return None
        try:
            head = _Head(**json.loads(kv.value[len(_HEAD):]))
            if head.slot not in _SLOTS or head.chunks < 1 or head.size < 0 or not isinstance(head.sha256, str):
                raise ValueError(f"slot {head.slot}, {head.chunks} chunks, {head.size} bytes")
        except (ValueError, TypeError) as exc:
            raise CodecError(f"{self.key} holds a malformed chunked-value head ({exc}); delete {self.key} and "
                             f"{self._chunks} and write it again") from exc
        return head

    async def _gather(self, head: _Head) -> tuple[bytes | None, str]:
        """The value the head names, or None and what was wrong with its chunks."""
        found = await self.store.range(f"{self._chunks}{head.slot}/")
        expected = [self._chunk_key(head.slot, i) for i in range(head.chunks)]
        if [kv.key for kv in found] != expected:
            return None, f"{len(found)} chunks are there"
        value = b"".join(kv.value for kv in found)
        if len(value) != head.size or hashlib.sha256(value).hexdigest() != head.sha256:
            return None, f"they hold {len(value)} bytes that do not match its SHA-256"
        return value, ""

    async def put(self, value: bytes) -> None:
        """Replace the value: at once when it fits in one write, else chunks first and then the head."""
        async with self._lock:
            slot, tidy = await self._current()
            self._known = False  # until this write has gone through
            if write_size([(self.key, len(value))]) <= self.store.max_write_bytes and not value.startswith(_HEAD):
                await self.store.put(self.key, value)
                if slot is not None or not tidy:
                    await self.store.delete_prefix(self._chunks)
                written: int | None = None
            else:
                written = 0 if slot is None else 1 - slot
                if not tidy:  # what a writer that died left: every chunk but the stored head's
                    await self.store.delete_prefix(self._chunks if slot is None else f"{self._chunks}{written}/")
                await self._write_chunks(written, value)
                if slot is not None:
                    await self.store.delete_prefix(f"{self._chunks}{slot}/")
            self._slot, self._tidy, self._known = written, True, True

    async def _current(self) -> tuple[int | None, bool]:
        """The slot of the stored head (None: a plain value or none) and whether the other slot is known empty."""
        if self._known:
            return self._slot, self._tidy
        kv = await self.store.get(self.key)
        head = self._head(kv) if kv is not None else None
        return (head.slot if head is not None else None), False

    async def _write_chunks(self, slot: int, value: bytes) -> None:
        room = self.store.max_write_bytes - write_size([(self._chunk_key(slot, 0), 0)])
        count = max(1, -(-len(value) // room))
        for index in range(count):
            await self.store.put(self._chunk_key(slot, index), value[index * room:(index + 1) * room])
        head = _Head(slot=slot, chunks=count, size=len(value), sha256=hashlib.sha256(value).hexdigest())
        await self.store.put(self.key, head.encode())
