"""Plugin loading through entry points (as a third party ships them) and guarded calls."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

from stead.core.config import Settings
from stead.core.errors import PluginError
from stead.core.events import JobSubmitted, PluginFailed, StepProgress
from stead.core.master import Master, MasterConfig
from stead.core.plugins import load_plugins, validate_plugin

pytestmark = pytest.mark.anyio


def _install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    """Write a throwaway distribution (module + dist-info with entry_points.txt) onto sys.path."""
    module = f"thirdparty_{name}_{uuid.uuid4().hex[:6]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    info = tmp_path / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[stead.plugins]\n{name} = {module}:make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


COUNTER = """
from stead.core.events import StepProgress

class Counter:
    name = "counter"
    subscriptions = (StepProgress,)
    seen = []

    async def handle(self, *, record, ctx):
        Counter.seen.append(record.event.step)

def make(*, settings):
    return Counter()
"""


async def test_a_third_party_plugin_installed_by_entry_point_receives_its_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _install(tmp_path, monkeypatch, "counter", COUNTER)
    config = MasterConfig(job="p", plugins=["counter", "diagnosis"], token_file=str(tmp_path / "t"), tcp_store=False)
    async with Master(config) as master:
        assert master.plugin_host is not None and master.plugin_host.names == ["counter", "diagnosis"]
        await master.submit(JobSubmitted(job="p", min_nodes=1, max_nodes=1, nproc_per_node=1))
        await master.submit(StepProgress(round=1, step=5))
        await master.submit(StepProgress(round=1, step=6))
        await master.plugin_host.drain()
    counter = __import__(module).Counter
    assert counter.seen == [5, 6]


def test_a_configured_plugin_that_is_not_installed_fails_fast() -> None:
    with pytest.raises(PluginError, match=r"\['nope'\] are configured but not installed"):
        load_plugins(settings=Settings(), enabled=["nope"])


def test_a_configured_plugin_that_fails_to_import_fails_fast_but_an_unused_one_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(tmp_path, monkeypatch, "broken", "raise ImportError('missing dependency xyz')\n")
    with pytest.raises(PluginError, match=r"'broken' failed to load.*missing dependency xyz"):
        load_plugins(settings=Settings(), enabled=["broken"])
    names = [p.name for p in load_plugins(settings=Settings())]
    assert "broken" not in names and "diagnosis" in names


def test_plugins_can_be_disabled_by_name() -> None:
    assert "diagnosis" not in [p.name for p in load_plugins(settings=Settings(), disabled=["diagnosis"])]


class _Sync:
    name = "sync"
    subscriptions = (StepProgress,)

    def handle(self, *, record: object, ctx: object) -> None: ...


class _BadSubs:
    name = "bad"
    subscriptions = (int,)

    async def handle(self, *, record: object, ctx: object) -> None: ...


@pytest.mark.parametrize(
    ("plugin", "message"),
    [(_Sync(), "handle\\(\\) must be an 'async def'"), (_BadSubs(), "must be a tuple of stead event classes"),
     (object(), "has no 'name'")],
)
def test_invalid_plugins_are_refused_when_loaded(plugin: object, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        validate_plugin(plugin, source="test")


class _Slow:
    name = "slow"
    subscriptions = (StepProgress,)

    async def handle(self, *, record: object, ctx: object) -> None:
        import anyio

        await anyio.sleep(30)


async def test_a_slow_plugin_call_times_out_and_is_recorded(tmp_path: Path) -> None:
    settings = Settings(plugin_timeout_s=0.05)
    config = MasterConfig(job="slow", settings=settings, plugins=[], plugin_objects=[_Slow()],
                          token_file=str(tmp_path / "t"), tcp_store=False)
    async with Master(config) as master:
        await master.submit(JobSubmitted(job="slow", min_nodes=1, max_nodes=1, nproc_per_node=1))
        await master.submit(StepProgress(round=1, step=1))
        assert master.plugin_host is not None
        await master.plugin_host.drain()
        failures = [r.event for r in await master.reactor.log.read() if isinstance(r.event, PluginFailed)]
    assert failures and "timed out after 0.05 s" in failures[0].error
