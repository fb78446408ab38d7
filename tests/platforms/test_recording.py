"""The RecordingPlatform test double: what it records and how a test drives it."""

from __future__ import annotations

import contextlib
import signal

import pytest
from _platform_helpers import SLEEP, agent, next_event, remaining_events

from stead.core.errors import PlatformError
from stead.core.events import NodeExited, NodeStarted
from stead.testing.platforms import RecordingPlatform

pytestmark = pytest.mark.anyio


async def test_records_every_launch_and_kill_call_in_order() -> None:
    async with RecordingPlatform() as platform:
        await platform.launch(agent(SLEEP, node="a"))
        await platform.launch(agent(SLEEP, node="a"))
        await platform.launch(agent(SLEEP, node="b", incarnation=2))
        await platform.kill("a", 1)
        await platform.kill("zz", 9)
    assert platform.launches == [("a", 1), ("a", 1), ("b", 2)]
    assert platform.kills == [("a", 1), ("zz", 9)]
    assert set(platform.specs) == {("a", 1), ("b", 2)}
    assert platform.specs[("b", 2)].command == agent(SLEEP).command


async def test_pushed_events_reach_the_stream_and_update_running() -> None:
    async with RecordingPlatform(auto_start=False) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.launch(agent(SLEEP))
        assert platform.running == frozenset()
        platform.start("n1", 1, pid=42)
        assert await next_event(events) == NodeStarted(node_id="n1", incarnation=1, host="recording", pid=42)
        assert platform.running == {("n1", 1)}
        platform.exit("n1", 1, exit_code=3)
        assert await next_event(events) == NodeExited(node_id="n1", incarnation=1, exit_code=3)
        assert platform.running == frozenset()


async def test_kill_without_exit_on_kill_leaves_the_exit_to_the_test() -> None:
    async with RecordingPlatform(exit_on_kill=False) as platform:
        events = platform.events()
        await platform.launch(agent(SLEEP))
        await platform.kill("n1", 1)
        assert platform.running == {("n1", 1)}
    assert await remaining_events(events) == [
        NodeStarted(node_id="n1", incarnation=1, host="recording"),
        NodeExited(node_id="n1", incarnation=1, signal=signal.SIGTERM),
    ]


async def test_closed_platform_refuses_launches_and_pushes() -> None:
    async with RecordingPlatform() as platform:
        pass
    with pytest.raises(PlatformError, match="closed"):
        await platform.launch(agent(SLEEP))
    with pytest.raises(PlatformError, match="closed"):
        platform.exit("n1", 1, exit_code=0)
