"""Fixtures for the agent tests: each worker test runs with a zygote and with plain spawn."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from stead.core.agent.zygote import Zygote


@pytest.fixture(params=["zygote", "spawn"])
async def zygote(request: pytest.FixtureRequest) -> AsyncIterator[Zygote | None]:
    """A ready zygote (nothing preloaded, so it starts fast), or None for the spawn path."""
    if request.param == "spawn":
        yield None
        return
    async with Zygote(preload=()) as warm:
        assert await warm.wait_ready()
        yield warm
