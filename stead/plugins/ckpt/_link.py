"""The worker's side of its agent's checkpoint socket: JSON lines over a unix stream socket.

Notifications (``saved``, ``skipped``, ``restored``, ``corrupt``) get no answer
and are sent by a background thread: waking the agent up (which, on a busy node,
may run on the caller's CPU at once) is not on the training thread's path.
Requests (``hello``, ``reserve``, ``persisted``) carry an ``id``, go out after
every notification queued before them, and wait for the answer with that id.
"""

from __future__ import annotations

import collections
import itertools
import json
import socket
import threading
import time
from typing import Any

from stead.plugins.ckpt.errors import CheckpointError, SharedMemoryTooSmall

__all__ = ["AgentLink", "SOCKET_ENV"]

SOCKET_ENV = "STEAD_CKPT_SOCKET"
_MAX_LINE = 1 << 20


class AgentLink:
    """One connection to the agent's checkpoint socket."""

    def __init__(self, path: str, *, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise CheckpointError(f"cannot reach the stead agent's checkpoint socket {path} ({exc}); "
                                  "is the worker running under `stead run`?") from exc
        self._lock = threading.Lock()  # held while sending: notifications and requests stay in order
        self._ids = itertools.count(1)
        self._buffer = b""
        self._queue: collections.deque[bytes] = collections.deque()
        self._wakeup = threading.Event()
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="stead-ckpt-notify", daemon=True)
        self._sender.start()

    def close(self) -> None:
        with self._lock:
            self._flush()
            self._closed = True
        self._wakeup.set()
        self._sender.join()
        self._sock.close()

    def notify(self, message: dict[str, Any]) -> None:
        """Queue ``message`` for the agent; returns at once."""
        self._queue.append((json.dumps(message, separators=(",", ":")) + "\n").encode())
        self._wakeup.set()

    def _send_loop(self) -> None:
        while not self._closed:
            self._wakeup.wait()
            self._wakeup.clear()
            with self._lock:
                if self._closed:
                    return
                try:
                    self._flush()
                except OSError:
                    return  # the agent is gone; requests report it

    def _flush(self) -> None:
        while self._queue:
            self._sock.sendall(self._queue.popleft())

    def request(self, message: dict[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        ident = next(self._ids)
        data = (json.dumps({**message, "id": ident}, separators=(",", ":")) + "\n").encode()
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        with self._lock:
            try:
                self._flush()
                self._sock.sendall(data)
                while True:
                    reply = self._read_line(deadline)
                    if reply.get("id") == ident:
                        break
            except TimeoutError as exc:
                raise CheckpointError(f"the stead agent did not answer {message.get('op')!r} within {limit:g} s; "
                                      "raise the setting ckpt_agent_timeout_s if /dev/shm is slow to allocate") \
                    from exc
            except OSError as exc:
                raise CheckpointError(f"the stead agent's checkpoint socket {self.path} failed ({exc}); "
                                      "the agent has exited") from exc
        if not reply.get("ok", False):
            kind = SharedMemoryTooSmall if reply.get("kind") == "shm_too_small" else CheckpointError
            raise kind(str(reply.get("error") or f"the agent refused {message.get('op')!r}"))
        return reply

    def _read_line(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._sock.settimeout(remaining)
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("the agent closed the connection")
            self._buffer += chunk
            if len(self._buffer) > _MAX_LINE:
                raise ConnectionResetError("the agent sent an oversized line")
        line, self._buffer = self._buffer.split(b"\n", 1)
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ConnectionResetError("the agent sent a non-object line")
        return obj
