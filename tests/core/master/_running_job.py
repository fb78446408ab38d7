"""A job whose round 1 runs on node-0 and node-1, in a real reactor (a memory store) on a fake clock's time: what the
master's parts beside the reactor (liveness, step progress) are tested against."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from stead.core.config import Settings
from stead.core.events import JobSubmitted, NodeJoined
from stead.core.events.log import EventLog
from stead.core.master.reactor import Reactor
from stead.core.statemachine import Effect
from stead.core.store import open_store
from stead.testing import FakeClock

#: the nodes of the job
NODES = ("node-0", "node-1")


class _NoEffects:
    """Effects run as nothing: no node is launched or told anything (the test plays the agents)."""

    async def run(self, effect: Effect) -> None:
        return None


@contextlib.asynccontextmanager
async def running_job(clock: FakeClock, settings: Settings) -> AsyncIterator[Reactor]:
    """The reactor of job ``t`` on ``clock``'s time, its nodes (:data:`NODES`) joined and round 1 running."""
    store = await open_store("memory://")
    try:
        async with Reactor(EventLog(store, "t", clock=clock.now), _NoEffects(), settings=settings,
                           clock=clock) as reactor:
            await reactor.resume()
            await reactor.submit(JobSubmitted(job="t", min_nodes=len(NODES), max_nodes=len(NODES), nproc_per_node=1))
            for node in NODES:
                await reactor.submit(NodeJoined(node_id=node, incarnation=1))
            assert reactor.state.rdzv.active and reactor.state.rdzv.round == 1
            yield reactor
    finally:
        await store.close()
