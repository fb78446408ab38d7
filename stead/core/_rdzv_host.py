"""The process that hosts the workers' rendezvous stores, so that they outlive the master.

``python -P .../_rdzv_host.py HOST GONE_TIMEOUT_S`` (run as a file, so that it starts
without importing stead; the job token in ``STEAD_RDZV_HOST_TOKEN``) prints the port of its control socket on stdout and
closes it, then serves one master at a time over that socket, line by line::

    TOKEN <job token>          (first; anything else closes the connection)
    ROUND <r>   -> PORT <p>    the TCPStore of round r, created on first ask (the same one when asked again)
    EXIT        -> BYE         the job ended: free every store and exit

A master holds its connection open for as long as it runs: when it closes (the master
exited or was killed), the process waits ``GONE_TIMEOUT_S`` for another master to
connect, serving the stores meanwhile (workers of a round that started just before
the master died still rendezvous), and exits if none comes. It runs no event loop and
imports torch once, in the background, as soon as it starts.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["TOKEN_ENV", "main"]

TOKEN_ENV = "STEAD_RDZV_HOST_TOKEN"


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


class _Host:
    def __init__(self, host: str, token: str) -> None:
        self.host = host
        self.token = token
        self.stores: dict[int, Any] = {}

    def store_port(self, round_: int) -> int:
        if round_ not in self.stores:
            sock = listen(self.host)  # bound here: only on the workers' interface, never on every one
            fd = sock.detach()
            try:
                self.stores[round_] = _tcpstore_class()(self.host, 0, is_master=True, wait_for_workers=False,
                                                        use_libuv=True, master_listen_fd=fd)
            except BaseException:
                socket.close(fd)
                raise
            for old in sorted(r for r in self.stores if r)[:-2]:  # keep the newest round's, the one before and
                # round 0's (the health checks')
                del self.stores[old]
        return int(self.stores[round_].port)

    def serve(self, conn: socket.socket) -> bool:
        """Answer one master until it goes; False when it said EXIT."""
        with conn, conn.makefile("rwb") as stream:
            if stream.readline().decode(errors="replace").strip() != f"TOKEN {self.token}":
                return True
            for raw in stream:
                verb, _, arg = raw.decode(errors="replace").strip().partition(" ")
                if verb == "ROUND" and arg.isdigit():
                    reply = f"PORT {self.store_port(int(arg))}"
                elif verb == "EXIT":
                    stream.write(b"BYE\n")
                    stream.flush()
                    return False
                else:
                    reply = f"ERROR unknown request {raw[:40]!r}"
                stream.write(reply.encode() + b"\n")
                stream.flush()
        return True


def main(argv: list[str]) -> int:
    host, gone_timeout_s = argv[0], float(argv[1])
    token = os.environ.pop(TOKEN_ENV, "")
    control = listen(host)
    print(control.getsockname()[1], flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the master reads the port to EOF: let go of its pipe
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    threading.Thread(target=_tcpstore_class, daemon=True).start()  # torch's import, before the first round asks
    served = _Host(host, token)
    deadline = time.monotonic() + gone_timeout_s
    with control:
        while True:
            control.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                conn, _ = control.accept()
            except TimeoutError:
                if time.monotonic() >= deadline:
                    return 0  # no master for gone_timeout_s: the job is over or abandoned
                continue
            conn.settimeout(None)
            if not served.serve(conn):
                return 0
            deadline = time.monotonic() + gone_timeout_s


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
