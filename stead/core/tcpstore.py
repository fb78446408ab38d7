"""The workers' rendezvous store: one torch TCPStore per round, hosted by the master.

Workers connect to ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``)
instead of rank 0 hosting a store that dies with it; a fresh store per round
means no round ever reads a previous round's keys. torch's TCPStore has no
authentication.
"""

from __future__ import annotations

import asyncio
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

                def create() -> Any:
                    from torch.distributed import TCPStore  # type: ignore[attr-defined]

                    return TCPStore(self.host, 0, is_master=True, wait_for_workers=False, use_libuv=True)

                self._stores[round_] = await anyio.to_thread.run_sync(create)
                for old in sorted(self._stores)[:-2]:  # keep this round's and the previous one's
                    del self._stores[old]
            address = (self.host, int(self._stores[round_].port))
            if round_ == max(self._stores):
                self._latest = address
            return address

    def close(self) -> None:
        """Free every store (a TCPStore server stops when its last reference goes)."""
        self._stores.clear()
