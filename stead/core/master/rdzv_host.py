"""The process that hosts the workers' rendezvous stores, so that they outlive the master.

``python -P .../rdzv_host.py HOST GONE_TIMEOUT_S AUTH_TIMEOUT_S MAX_PENDING`` (run as a file, so that it starts
without importing stead; the job token in ``STEAD_RDZV_HOST_TOKEN``) prints the port of its control socket on
stdout and closes it, then serves masters over that socket, each connection in a thread of its own, line by line.

First both sides prove that they hold the job token; the token itself never crosses the socket::

    host   -> HELLO stead-rdzv/1 <hn>      hn: a fresh random nonce (32 hex digits)
    master -> PROOF <mn> <mac(master)>    mn: the master's own fresh nonce
    host   -> PROOF <mac(host)>           only when the master's proof is right; otherwise it closes

    mac(side) = HMAC-SHA256(token, "stead-rdzv/1 <side>|<HOST>:<port>|<hn>|<mn>"), in hex

The address is the one the host listens on and the master dialled, so a process that relays between a master
and another host of the same job fails the proof; the side label keeps one side's answer from serving as the
other's. The host checks the master's proof (``hmac.compare_digest``) before it reads anything else, and the
master checks the host's before it sends any request: a process squatting on a dead host's port learns nothing
but a nonce and a MAC. Then requests, each with an id that its reply repeats (a reply is never taken for
another request's)::

    <id> ROUND <r>  -> <id> PORT <p>      the TCPStore of round r, created on first ask (the same one when asked again)
    <id> EXIT       -> <id> BYE           the job ended: free every store and exit
    anything else   -> <id> ERROR <why>

Limits: a line longer than :data:`MAX_LINE_BYTES` closes its connection at once (nothing beyond the bound is
read); a connection that has not proven the token within ``AUTH_TIMEOUT_S`` is closed, and a new one past
``MAX_PENDING`` unproven ones closes the oldest of them. A proven connection may stay idle: a master holds one
open for as long as it runs. When no proven master has been connected for ``GONE_TIMEOUT_S`` (it exited or was
killed) the process exits, serving the stores meanwhile (workers of a round that started just before the master
died still rendezvous). It runs no event loop and imports torch once, in the background, as soon as it starts.

The proof keeps out whoever lacks the token; it does not make a secure channel: the requests that follow are
plain text, and the TCPStores themselves have no authentication at all (see the README's Security section).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import select
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["HOST", "MASTER", "MAX_LINE_BYTES", "PROTOCOL", "TOKEN_ENV", "is_nonce", "main", "new_nonce", "proof"]

TOKEN_ENV = "STEAD_RDZV_HOST_TOKEN"
#: the protocol's name and version, in the host's greeting and in every MAC
PROTOCOL = "stead-rdzv/1"
#: the longest line either side reads, newline included (the protocol's longest is under 150 bytes): a longer one
#: closes the connection
MAX_LINE_BYTES = 256
#: the sides' labels in the MAC
MASTER, HOST = "master", "host"
_NONCE_BYTES = 16


def proof(token: str, side: str, address: str, host_nonce: str, master_nonce: str) -> str:
    """``side``'s proof that it holds ``token``, for the connection to ``address`` with these nonces."""
    message = f"{PROTOCOL} {side}|{address}|{host_nonce}|{master_nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(_NONCE_BYTES)


def is_nonce(text: str) -> bool:
    return len(text) == 2 * _NONCE_BYTES and all(c in "0123456789abcdef" for c in text)


def listen(host: str) -> socket.socket:
    """A socket listening on ``host`` (a free port)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def _tcpstore_class() -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore


class _Lines:
    """The lines a peer sends, none longer than MAX_LINE_BYTES: nothing beyond that bound is ever read."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""

    def next(self, deadline: float | None) -> str | None:
        """The next line, without its newline; None when the peer closed, the line is too long or time ran out."""
        while b"\n" not in self.buffer:
            room = MAX_LINE_BYTES - len(self.buffer)
            left = None if deadline is None else deadline - time.monotonic()
            if room <= 0 or (left is not None and left <= 0):
                return None
            self.conn.settimeout(left)
            try:
                chunk = self.conn.recv(room)
            except TimeoutError:
                return None
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("ascii", errors="replace")


class _Host:
    def __init__(self, host: str, port: int, token: str, *, gone_timeout_s: float, auth_timeout_s: float,
                 max_pending: int) -> None:
        self.host = host
        self.address = f"{host}:{port}"
        self.token = token
        self.gone_timeout_s = gone_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self.max_pending = max_pending
        self.stores: dict[int, Any] = {}
        self._stores_lock = threading.Lock()  # held while a store is made (the first waits for torch's import)
        self._lock = threading.Lock()  # the connections' bookkeeping below
        self._pending: dict[socket.socket, None] = {}  # unproven connections, oldest first
        self._masters = 0
        self._alone_since = time.monotonic()
        self._exiting = False
        #: the main thread's select wakes on it when the job ended or the last master left
        self.wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)

    def gone_in(self) -> float | None:
        """Seconds until the process should exit (<= 0: now); None while a master is connected."""
        with self._lock:
            if self._exiting:
                return 0.0
            if self._masters:
                return None
            return self._alone_since + self.gone_timeout_s - time.monotonic()

    def admit(self, conn: socket.socket) -> None:
        """Serve a new connection, closing the oldest unproven one when there are MAX_PENDING already."""
        with self._lock:
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                del self._pending[oldest]
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread's recv returns: it closes it
            self._pending[conn] = None
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        proven = False
        try:
            lines = _Lines(conn)
            proven = self._prove(conn, lines) and self._promote(conn)
            if proven:
                self._answer(conn, lines)
        except OSError:
            pass  # the peer went away, or it is being closed
        finally:
            self._release(conn, proven)
            conn.close()

    def _prove(self, conn: socket.socket, lines: _Lines) -> bool:
        deadline = time.monotonic() + self.auth_timeout_s
        host_nonce = new_nonce()
        conn.settimeout(self.auth_timeout_s)
        conn.sendall(f"HELLO {PROTOCOL} {host_nonce}\n".encode())
        words = (lines.next(deadline) or "").split(" ")
        if len(words) != 3 or words[0] != "PROOF" or not is_nonce(words[1]):
            return False
        expected = proof(self.token, MASTER, self.address, host_nonce, words[1])
        if not hmac.compare_digest(words[2].encode(), expected.encode()):
            return False
        conn.sendall(f"PROOF {proof(self.token, HOST, self.address, host_nonce, words[1])}\n".encode())
        return True

    def _promote(self, conn: socket.socket) -> bool:
        """Count a proven connection as a master's; False when it was closed as the oldest unproven meanwhile."""
        with self._lock:
            if conn not in self._pending:
                return False
            del self._pending[conn]
            self._masters += 1
        conn.settimeout(None)  # a master may stay idle for as long as it runs
        return True

    def _release(self, conn: socket.socket, proven: bool) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            if proven:
                self._masters -= 1
                if not self._masters:
                    self._alone_since = time.monotonic()
                    self._wake()

    def _answer(self, conn: socket.socket, lines: _Lines) -> None:
        """Answer a proven master's requests until it goes or says EXIT."""
        while (line := lines.next(None)) is not None:
            request_id, _, request = line.partition(" ")
            verb, _, arg = request.partition(" ")
            if not (request_id.isascii() and request_id.isdigit() and len(request_id) <= 20):
                reply = "- ERROR a request starts with its id: <id> ROUND <r>, or <id> EXIT"
            elif verb == "ROUND" and arg.isascii() and arg.isdigit() and len(arg) <= 12:
                reply = f"{request_id} {self._round_reply(int(arg))}"
            elif verb == "EXIT" and not arg:
                conn.sendall(f"{request_id} BYE\n".encode())
                with self._lock:
                    self._exiting = True
                    self._wake()
                return
            else:
                reply = f"{request_id} ERROR unknown request {request[:24]!a}: ROUND <r> or EXIT"
            conn.sendall(reply.encode("ascii", errors="replace")[:MAX_LINE_BYTES - 1] + b"\n")

    def _round_reply(self, round_: int) -> str:
        try:
            return f"PORT {self.store_port(round_)}"
        except Exception as exc:  # torch missing, no port left: the master reports it
            return f"ERROR round {round_}'s store could not be made: {exc!r}"

    def store_port(self, round_: int) -> int:
        with self._stores_lock:
            if round_ not in self.stores:
                sock = listen(self.host)  # bound here: only on the workers' interface, never on every one
                fd = sock.detach()
                try:
                    self.stores[round_] = _tcpstore_class()(self.host, 0, is_master=True, wait_for_workers=False,
                                                            use_libuv=True, master_listen_fd=fd)
                except BaseException:
                    socket.close(fd)
                    raise
                for old in sorted(r for r in self.stores if r)[:-2]:  # keep the newest round's, the one before
                    # and round 0's (the health checks')
                    del self.stores[old]
            return int(self.stores[round_].port)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # it is awake already
            self._wake_w.send(b"!")


def main(argv: list[str]) -> int:
    host, gone_timeout_s, auth_timeout_s, max_pending = argv[0], float(argv[1]), float(argv[2]), int(argv[3])
    token = os.environ.pop(TOKEN_ENV, "")
    if not token:
        print(f"stead: the rendezvous host needs the job's token in {TOKEN_ENV}; stead's master starts it with one",
              file=sys.stderr)
        return 2
    control = listen(host)
    control.setblocking(False)
    port = control.getsockname()[1]
    print(port, flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the master reads the port to EOF: let go of its pipe
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    threading.Thread(target=_tcpstore_class, daemon=True).start()  # torch's import, before the first round asks
    served = _Host(host, port, token, gone_timeout_s=gone_timeout_s, auth_timeout_s=auth_timeout_s,
                   max_pending=max_pending)
    with control:
        while (wait := served.gone_in()) is None or wait > 0:
            readable, _, _ = select.select([control, served.wake_r], [], [], wait)
            if served.wake_r in readable:
                served.wake_r.recv(4096)
            if control in readable:
                try:
                    conn, _ = control.accept()
                except (BlockingIOError, ConnectionError):  # it went away before it was accepted
                    continue
                served.admit(conn)
    return 0  # the job ended, or no master came back for gone_timeout_s: it is over or abandoned


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
