"""The replica port's wire (:mod:`._replicas`): one TCP connection (TLS when the job has certificates), the proof
that both sides hold the job's token, JSON lines and raw bytes; and the answer to a read of a slot's parts, bounded.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import mmap
import secrets
import socket
import ssl
from collections.abc import Callable
from typing import Any, Protocol

from stead.plugins.ckpt.errors import CheckpointError

__all__ = ["Conn", "ReplicaError", "connect", "read_ranges", "send_parts"]

#: the protocol's name and version (2: a slot's checksums and layout document travel before its tensors)
_PROTOCOL = "stead-replica"
_GREETING = f"{_PROTOCOL} 2"
_REFUSED = "refused"
_MAX_LINE = 64 << 10
#: the piece of a slot sent (and copied out of it, :mod:`._peers`) at a time
_CHUNK = 8 << 20
#: the ranges one read may ask for and the bytes it may ask for: a peer asks for one tensor at a time (DCP's
#: chunks), so these only stop a request that would make the holder send without end
_MAX_RANGES = 1024
_MAX_READ_BYTES = 4 << 30


class Described(Protocol):
    """What a read of a slot's parts needs of its description (:class:`._replicas.ReplicaMeta`)."""

    @property
    def rank(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def checks_off(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def to_json(self) -> dict[str, int]: ...


class ReplicaError(CheckpointError):
    """A replica could not be sent, fetched or taken (the message says what and why)."""


class _Closed(ReplicaError):
    """The peer closed the connection between two requests (a reader done with its reads)."""


def _proof(token: str, side: str, job: str, server_nonce: str, client_nonce: str) -> str:
    message = f"{_GREETING}|{side}|{job}|{server_nonce}|{client_nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


class Conn:
    """Lines and raw bytes over one (TLS) socket, with a buffer of what came after the last line."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def line(self) -> str:
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                raw = bytes(self._buf[:end])
                del self._buf[:end + 1]
                return raw.decode("utf-8", "replace")
            if len(self._buf) > _MAX_LINE:
                raise ReplicaError("a peer sent a line longer than any of the replica protocol's")
            chunk = self.sock.recv(_MAX_LINE)
            if not chunk:
                raise (_Closed if not self._buf else ReplicaError)("the peer closed the connection")
            self._buf += chunk

    def json(self) -> dict[str, Any]:
        text = self.line()
        try:
            value = json.loads(text)
        except ValueError:
            raise ReplicaError(f"a peer sent {text[:80]!r}, not a replica request; run every node with the same "
                               "stead") from None
        if not isinstance(value, dict):
            raise ReplicaError("a peer sent a JSON value that is not an object")
        return value

    def send_line(self, value: str | dict[str, Any]) -> None:
        text = value if isinstance(value, str) else json.dumps(value)
        self.sock.sendall(text.encode() + b"\n")

    def read_into(self, target: memoryview, *, progress: Callable[[int], None] | None = None, step: int = 0) -> None:
        """Fill ``target``; ``progress(n)`` (if given) each time ``step`` more bytes are in, and at the end."""
        done = min(len(self._buf), len(target))
        target[:done] = self._buf[:done]
        del self._buf[:done]
        told = 0
        while done < len(target):
            got = self.sock.recv_into(target[done:done + _CHUNK])
            if not got:
                raise ReplicaError(f"the peer closed the connection after {done} of {len(target)} bytes")
            done += got
            if progress is not None and done - told >= step:
                progress(done)
                told = done
        if progress is not None and told < done:
            progress(done)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def connect(address: str, *, token: str, job: str, tls: ssl.SSLContext | None, timeout_s: float) -> Conn:
    host, port = _split(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
    except (OSError, ssl.SSLError) as exc:
        raise ReplicaError(f"cannot reach the agent at {address} ({exc})") from None
    conn = Conn(sock)
    try:
        try:
            words = conn.line().rsplit(" ", 1)
        except (OSError, ReplicaError) as exc:
            raise ReplicaError(f"the agent at {address} sent no greeting ({exc}): it may serve TLS and this node not "
                               "(give every host the same tls_* settings), or it is not a stead agent's replica "
                               "port") from None
        if len(words) == 2 and words[0] != _GREETING and words[0].startswith(f"{_PROTOCOL} "):
            raise ReplicaError(f"the agent at {address} speaks {words[0]!r}, this node {_GREETING!r}: run every node "
                               "with the same stead")
        if len(words) != 2 or words[0] != _GREETING:
            raise ReplicaError(f"{address} is not a stead agent's replica port")
        server_nonce, client_nonce = words[1], secrets.token_hex(16)
        conn.send_line(f"{client_nonce} {_proof(token, 'client', job, server_nonce, client_nonce)}")
        answer = conn.line()
        if answer == _REFUSED:
            raise ReplicaError(f"the agent at {address} refused this node: it did not prove it holds this job's token "
                               "(give every host the same job token: STEAD_JOB_TOKEN or the token file)")
        if not hmac.compare_digest(answer.encode(), _proof(token, "server", job, server_nonce,
                                                           client_nonce).encode()):
            raise ReplicaError(f"the agent at {address} did not prove it holds this job's token (another job, or "
                               "a process that took a dead agent's port): nothing was sent to it")
    except (OSError, ReplicaError) as exc:
        conn.close()
        raise exc if isinstance(exc, ReplicaError) else ReplicaError(f"{address}: {exc}") from None
    return conn


def send_parts(conn: Conn, meta: Described, view: mmap.mmap, ranges: list[tuple[int, int]],
                unchanged: Callable[[], bool]) -> None:
    """A head (``ranges`` empty: the checksums and layout document) or the bytes of ``ranges``, each inside the
    slot's tensor data, then whether the slot was left unchanged meanwhile."""
    if len(view) < meta.nbytes:
        conn.send_line({"ok": False, "error": f"rank {meta.rank}'s slot of step {meta.step} is smaller than it says "
                                              "(its segment was replaced): refused"})
        return
    if ranges:
        outside = next(((o, n) for o, n in ranges if o + n > meta.checks_off), None)
        if outside is not None:
            conn.send_line({"ok": False, "error": f"bytes {outside[0]}..{sum(outside)} are outside the "
                                                  f"{meta.checks_off} bytes of tensor data of rank {meta.rank}'s "
                                                  f"step {meta.step}: refused"})
            return
        conn.send_line({"ok": True, "bytes": sum(n for _, n in ranges)})
    else:
        conn.send_line({"ok": True, "meta": meta.to_json()})
        ranges = [(meta.checks_off, meta.nbytes - meta.checks_off)]
    memory = memoryview(view)
    try:
        for offset, nbytes in ranges:
            for start in range(offset, offset + nbytes, _CHUNK):
                conn.sock.sendall(memory[start:min(start + _CHUNK, offset + nbytes)])
    finally:
        memory.release()
    conn.send_line({"intact": bool(unchanged())})


def read_ranges(value: Any) -> list[tuple[int, int]] | str:
    """A read's ranges, bounded; why they are refused (a str) otherwise."""
    if not isinstance(value, list) or not value:
        return "a read names no ranges ([[offset, length], ...])"
    if len(value) > _MAX_RANGES:
        return (f"a read of {len(value)} ranges is refused: at most {_MAX_RANGES} in one request (ask for the rest "
                "in another)")
    ranges = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                  and v >= 0 for v in item)):
            return f"a read's range {str(item)[:40]} is not [offset, length] (two non-negative integers)"
        ranges.append((int(item[0]), int(item[1])))
    total = sum(n for _, n in ranges)
    if total > _MAX_READ_BYTES:
        return (f"a read of {total} bytes is refused: at most {_MAX_READ_BYTES} in one request (ask for the rest in "
                "another)")
    return ranges
