"""The workers' rendezvous store: one torch TCPStore per round, hosted by the master.

Workers connect to ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``)
instead of rank 0 hosting a store that dies with it; a fresh store per round
means no round ever reads a previous round's keys. torch's TCPStore has no
authentication, so it listens only on the master's own address (loopback when every
node runs on this machine), never on every interface as it does by default: stead
binds the socket itself and hands it over.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import anyio.to_thread

__all__ = ["RoundStores"]


class RoundStores:
    """Hosts (and frees) the TCPStore of each round; ``enabled=False`` hosts none (tests without torch)."""

    def __init__(self, host: str, *, enabled: bool) -> None:
        self.host = host
        self.enabled = enabled
        self._stores: dict[int, Any] = {}
        self._latest: tuple[str, int] = (host, 0)
        #: the round's start effects run concurrently: every node of a round must get the same store
        self._creating = asyncio.Lock()

    @property
    def latest(self) -> tuple[str, int]:
        """The address of the newest store (what a registering agent is told)."""
        return self._latest

    async def for_round(self, round_: int) -> tuple[str, int]:
        """The store of ``round_``, created on first use; stores older than the previous round are freed."""
        if not self.enabled:
            return self._latest
        async with self._creating:
            if round_ not in self._stores:
                # torch's import is slow: off the loop; the store is made here, so that no worker
                # thread keeps a reference to it (its server stops listening when the last one goes)
                store_class = await anyio.to_thread.run_sync(_tcpstore_class)
                fd = _listen(self.host)
                try:
                    self._stores[round_] = store_class(self.host, 0, is_master=True, wait_for_workers=False,
                                                       use_libuv=True, master_listen_fd=fd)
                except BaseException:
                    socket.close(fd)
                    raise
                for old in sorted(self._stores)[:-2]:  # keep this round's and the previous one's
                    del self._stores[old]
            address = (self.host, int(self._stores[round_].port))
            if round_ == max(self._stores):
                self._latest = address
            return address

    def close(self) -> None:
        """Free every store (a TCPStore server stops when its last reference goes)."""
        self._stores.clear()


def _listen(host: str) -> int:
    """A socket listening on ``host`` (a free port), as a file descriptor the TCPStore takes over."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def _tcpstore_class() -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore
