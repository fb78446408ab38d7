"""Watch streams: the change records the store keeps, the per-watch queues, the HTTP stream.

Each write of the store is one :class:`Change` (new resourceVersion, type, new object, the
object before). The store keeps the last N of them as history (replayed to a watch that
starts at an older version) and offers each to the :class:`Watcher` s of that resource
only. A watcher with a selector turns a change into what the real server sends: an
object that stops matching is a DELETED (the previous content at the new version), one
that starts matching an ADDED. Encoded lines are cached on the change, so a hundred
watchers of the same kind serialize an object once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from tests.support.kube._selectors import FieldSelector, LabelSelector

__all__ = ["Change", "Watcher", "bookmark_line", "encode", "event_line", "stream_watch"]

log = structlog.get_logger("tests.support.kube.watch")

Obj = dict[str, Any]


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def event_line(kind: str, obj: Obj, encoded: bytes | None = None) -> bytes:
    return b'{"type":"' + kind.encode() + b'","object":' + (encoded or encode(obj)) + b"}\n"


def bookmark_line(kind: str, api_version: str, rv: int, *, initial_events_end: bool = False) -> bytes:
    meta: Obj = {"resourceVersion": str(rv), "creationTimestamp": None}
    if initial_events_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return event_line("BOOKMARK", {"kind": kind, "apiVersion": api_version, "metadata": meta})


@dataclass
class Change:
    rv: int
    key: tuple[str, str]
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None
    _lines: dict[str, bytes] = field(default_factory=dict, repr=False)
    _encoded: bytes | None = field(default=None, repr=False)

    @property
    def encoded(self) -> bytes:
        """The new object as JSON, encoded once for every watcher and for the response to the write."""
        if self._encoded is None:
            self._encoded = encode(self.obj)
        return self._encoded

    def line(self, kind: str) -> bytes:
        """The event line of type ``kind``; ``"DELETED_PREVIOUS"`` is the previous content at the new version
        (what a watch whose selector the object stopped matching receives)."""
        cached = self._lines.get(kind)
        if cached is None:
            if kind == "DELETED_PREVIOUS":
                assert self.old is not None
                previous = dict(self.old)
                previous["metadata"] = dict(previous["metadata"], resourceVersion=str(self.rv))
                cached = event_line("DELETED", previous)
            else:
                cached = event_line(kind, self.obj, self.encoded)
            self._lines[kind] = cached
        return cached


class Watcher:
    """One watch request: which objects it sees, and the queue of lines still to send (None ends the stream)."""

    def __init__(self, key: tuple[str, str], kind: str, api_version: str, namespace: str | None,
                 labels: LabelSelector, fields: FieldSelector) -> None:
        self.key, self.kind, self.api_version = key, kind, api_version
        self.namespace, self.labels, self.fields = namespace, labels, fields
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    def matches(self, obj: Obj) -> bool:
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    def offer(self, change: Change) -> None:
        if change.type == "MODIFIED" and change.old is not None and (self.labels or self.fields):
            was, now = self.matches(change.old), self.matches(change.obj)
            if was and now:
                self.queue.put_nowait(change.line("MODIFIED"))
            elif was:
                self.queue.put_nowait(change.line("DELETED_PREVIOUS"))
            elif now:
                self.queue.put_nowait(change.line("ADDED"))
        elif self.matches(change.obj):
            self.queue.put_nowait(change.line(change.type))

    def close(self) -> None:
        self.queue.put_nowait(None)


async def stream_watch(request: web.Request, watcher: Watcher, *, current_rv: Any, timeout_s: float | None,
                       bookmark_interval_s: float | None) -> web.StreamResponse:
    """Send ``watcher``'s lines as a chunked JSON-lines response until it closes, the client goes, or
    ``timeout_s`` passes; a BOOKMARK at ``current_rv()`` every ``bookmark_interval_s`` when the queue is empty
    (so every change up to that version has been sent)."""
    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s if timeout_s else None
    next_bookmark = loop.time() + bookmark_interval_s if bookmark_interval_s else None
    with contextlib.suppress(ConnectionError):
        while True:
            waits = [t - loop.time() for t in (deadline, next_bookmark) if t is not None]
            try:
                async with asyncio.timeout(max(0.0, min(waits)) if waits else None):
                    line = await watcher.queue.get()
            except TimeoutError:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    break
                if next_bookmark is not None and now >= next_bookmark and bookmark_interval_s:
                    await response.write(bookmark_line(watcher.kind, watcher.api_version, current_rv()))
                    next_bookmark = now + bookmark_interval_s
                continue
            if line is None:
                break
            lines = [line]
            while not watcher.queue.empty():
                more = watcher.queue.get_nowait()
                if more is None:
                    watcher.queue.put_nowait(None)
                    break
                lines.append(more)
            await response.write(b"".join(lines))
        await response.write_eof()
    return response
