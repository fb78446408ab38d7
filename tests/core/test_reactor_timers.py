"""The reactor's timers: a timer name armed again after it fired fires again."""

from __future__ import annotations

import pytest

from stead.core.config import Settings
from stead.core.events import JobSubmitted, NodeJoined, NodeLost, RoundStarted
from stead.core.events.log import EventLog
from stead.core.reactor import Reactor
from stead.core.statemachine import Effect
from stead.core.store import open_store

pytestmark = pytest.mark.anyio


class _Nothing:
    async def run(self, effect: Effect) -> None:
        return None


async def test_a_last_call_timer_armed_again_after_firing_starts_the_round() -> None:
    store = await open_store("memory://")
    spec = JobSubmitted(job="t", min_nodes=2, max_nodes=3, nproc_per_node=1, last_call_timeout_s=0.05)
    async with Reactor(EventLog(store, "t"), _Nothing(), settings=Settings()) as reactor:
        await reactor.resume()
        await reactor.submit(spec)
        await reactor.submit(NodeJoined(node_id="node-0", incarnation=1))
        await reactor.submit(NodeJoined(node_id="node-1", incarnation=1))  # MIN joined: last call armed
        await reactor.submit(NodeLost(node_id="node-1", incarnation=1))  # fires with one node: no round
        await reactor.wait_until(lambda s: "last-call/1" not in reactor._timers)
        await reactor.submit(NodeJoined(node_id="node-1", incarnation=2))  # MIN again: armed again
        state = await reactor.wait_until(lambda s: s.rdzv.round == 1)
        records = await reactor.log.read()
    await store.close()
    assert state.rdzv.members == ("node-0", "node-1")
    assert sum(isinstance(r.event, RoundStarted) for r in records) == 1
