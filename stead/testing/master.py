"""Test a plugin against a real master: :func:`plugin_master` and :func:`make_plugin`.

::

    from stead.testing import make_plugin, plugin_master
    from stead.plugin import JobSubmitted

    plugin = make_plugin(MyPlugin, {"threshold": "2"})      # as `--set my-plugin.threshold=2` would
    async with plugin_master(plugin) as master:
        await master.submit(JobSubmitted(job="test", min_nodes=1, max_nodes=1, nproc_per_node=1))
        ...                                                  # feed the events your plugin reacts to
        await settle(master)                                 # every plugin has handled everything
        records = await master.reactor.log.read()

The master is the real one (reactor, job machine, plugin host with its guards)
on an in-memory store, with no platform, no torch store and only the plugins
given: nodes join when the test submits their events.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings
from stead.core.master import Master, MasterConfig
from stead.core.plugins import instantiate, validate_plugin

__all__ = ["make_plugin", "plugin_master", "settle"]

P = TypeVar("P")


def make_plugin(factory: type[P], settings: Mapping[str, Any] | None = None, *,
                stead_settings: Settings | None = None) -> P:
    """``factory`` built as the master would: its typed settings from ``settings`` (``name -> value``)."""
    name = getattr(factory, "name", "")
    values = {f"{name}.{key}": value for key, value in (settings or {}).items()}
    merged = Settings.from_mapping(values, base=stead_settings or Settings())
    plugin = instantiate(name, factory, f"{factory!r}", merged)
    validate_plugin(plugin, source=repr(factory))
    built: P = plugin  # (instantiate called ``factory``: a P)
    return built


@contextlib.asynccontextmanager
async def plugin_master(*plugins: Any, job: str = "test", settings: Settings | None = None,
                        store_url: str = "memory://", clock: Clock = WALL_CLOCK) -> AsyncIterator[Master]:
    """A real master running only ``plugins`` (objects, e.g. from :func:`make_plugin`); see the module docstring.

    ``clock``: a :class:`~stead.testing.FakeClock` holds the job's timers and the plugins' waits (``ctx.clock``)
    until the test advances it.
    """
    with tempfile.TemporaryDirectory(prefix="stead-test-") as tmp:
        config = MasterConfig(job=job, store_url=store_url, settings=settings or Settings(), plugins=[],
                              plugin_objects=plugins, tcp_store=False, token_file=str(Path(tmp) / "token"),
                              clock=clock)
        async with Master(config) as master:
            yield master


async def settle(master: Master) -> None:
    """Return once every plugin has handled every record so far, including the records their events caused."""
    host = master.plugin_host
    assert host is not None, "the master is not running"
    while True:
        seq = master.state.seq
        await host.drain()
        if master.state.seq == seq:
            return
