"""Plugin loading through entry points (as a third party ships them) and guarded calls."""

from __future__ import annotations

import asyncio
import textwrap
import uuid
from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.core.errors import ConfigError, PluginError
from stead.core.events import JobSubmitted, PluginFailed, PluginsStarted, Record, StepProgress
from stead.core.master import Master, MasterConfig
from stead.core.plugins import PluginTasks, check_plugin_settings, load_plugins, validate_plugin
from stead.plugin import NoSettings, Plugin, PluginContext
from stead.testing import make_plugin, plugin_master, settle

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
    with pytest.raises(ConfigError, match=r"plugin\(s\) 'nope' not installed \(installed: .*diagnosis"):
        load_plugins(settings=Settings(), enabled=["nope"])


def test_a_configured_plugin_that_fails_to_import_fails_fast_but_an_unused_one_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(tmp_path, monkeypatch, "broken", "raise ImportError('missing dependency xyz')\n")
    with pytest.raises(ConfigError, match=r"'broken' \(.*\) failed to load.*missing dependency xyz"):
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
        await anyio.sleep_forever()


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


# -- the SDK: typed settings, the bound context, guarded hooks --------------------------------------------------

THRESHOLD = """
import dataclasses
from stead.plugin import Plugin, PluginContext, Record, StepProgress, setting

@dataclasses.dataclass(frozen=True, kw_only=True)
class ThresholdSettings:
    limit: int = setting(10, min=1, help="steps")
    label: str = "x"
    loud: bool = False

class Threshold(Plugin[ThresholdSettings]):
    name = "threshold"
    subscriptions = (StepProgress,)
    settings_class = ThresholdSettings
    made = []

    def __init__(self, *, settings):
        super().__init__(settings=settings)
        Threshold.made.append(settings)

make = Threshold
"""


def test_a_plugin_gets_its_own_typed_settings_from_set_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _install(tmp_path, monkeypatch, "threshold", THRESHOLD)
    monkeypatch.setenv("STEAD_THRESHOLD_LABEL", "from-env")
    settings = Settings.from_mapping({"threshold.limit": "3", "threshold.loud": "true"})
    check_plugin_settings(settings)
    (plugin,) = load_plugins(settings=settings, enabled=["threshold"])
    made = __import__(module).Threshold.made[-1]
    assert (made.limit, made.label, made.loud) == (3, "from-env", True)
    assert plugin.settings is made


@pytest.mark.parametrize(("values", "message"), [
    ({"threshold.nope": "1"}, "unknown setting 'threshold.nope'; settings of the threshold plugin: "
                              "threshold.limit=10, threshold.label='x', threshold.loud=False"),
    ({"threshold.limit": "0"}, "setting threshold.limit='0' must be at least 1"),
    ({"threshold.limit": "many"}, "setting threshold.limit='many' is not a valid int"),
    ({"nosuchplugin.x": "1"}, "no plugin 'nosuchplugin' is installed"),
    ({"heartbeat_timeout_s": "nan"}, "heartbeat_timeout_s='nan' must be a finite number of seconds"),
])
def test_bad_plugin_settings_are_refused_with_the_known_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, values: dict[str, str], message: str
) -> None:
    _install(tmp_path, monkeypatch, "threshold", THRESHOLD)
    with pytest.raises(ConfigError) as caught:
        check_plugin_settings(Settings.from_mapping(values))
    assert message in str(caught.value).replace('"', "'")


class _Garbage(Plugin[NoSettings]):
    name = "garbage"
    subscriptions = (StepProgress,)

    async def handle(self, *, record: Record, ctx: PluginContext[NoSettings]) -> None:
        return 42  # type: ignore[return-value]


class _EmitsInStart(Plugin[NoSettings]):
    name = "early"

    async def start(self, *, ctx: PluginContext[NoSettings]) -> None:
        await ctx.emit(StepProgress(round=0, step=0))


class _Watcher(Plugin[NoSettings]):
    """Sees each StepProgress with the state at its record, however far the job has moved on."""

    name = "watcher"
    subscriptions = (StepProgress,)
    decides_recovery = True

    def __init__(self) -> None:
        super().__init__(settings=NoSettings())
        self.seen: list[tuple[int, int | None, int | None]] = []
        #: set once the job has moved on past every record given to the plugin
        self.moved_on = anyio.Event()

    async def handle(self, *, record: Record, ctx: PluginContext[NoSettings]) -> None:
        assert isinstance(record.event, StepProgress)
        await self.moved_on.wait()
        self.seen.append((record.event.step, ctx.state.step, ctx.current_state().step))
        assert ctx.key("notes") == "/stead/jobs/plug/plugins/watcher/notes"


async def test_garbage_returned_and_emit_in_start_are_plugin_failures_and_the_state_is_the_records(
    tmp_path: Path,
) -> None:
    watcher = _Watcher()
    async with plugin_master(_Garbage(settings=NoSettings()), _EmitsInStart(settings=NoSettings()), watcher,
                             job="plug") as master:
        await master.submit(JobSubmitted(job="plug", min_nodes=1, max_nodes=1, nproc_per_node=1))
        for step in (1, 2, 3):
            await master.submit(StepProgress(round=1, step=step))
        watcher.moved_on.set()  # while the plugin still handles the first step
        await settle(master)
        records = await master.reactor.log.read()
    failures = {r.event.plugin: r.event.error for r in records if isinstance(r.event, PluginFailed)}
    assert "start() returned" not in failures["early"] and "emit() cannot be used in start()" in failures["early"]
    assert "handle() returned 42" in failures["garbage"]
    started = next(r.event for r in records if isinstance(r.event, PluginsStarted))
    assert started.deciders == ("watcher",) and set(started.plugins) == {"garbage", "early", "watcher"}
    assert [(step, at) for step, at, _ in watcher.seen] == [(1, 1), (2, 2), (3, 3)]
    assert watcher.seen[0][2] == 3  # current_state() is the live one


def test_make_plugin_builds_a_plugin_with_typed_settings_as_the_master_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _install(tmp_path, monkeypatch, "threshold", THRESHOLD)
    plugin = make_plugin(__import__(module).Threshold, {"limit": 7})
    assert plugin.settings.limit == 7
    with pytest.raises(ConfigError, match="must be at least 1"):
        make_plugin(__import__(module).Threshold, {"limit": 0})


# -- the plugin's task group (ctx.tasks) ------------------------------------------------------------------------


class _Tasked(Plugin[NoSettings]):
    """Runs two background tasks from start(): ``idle`` waits for ever, ``boom`` raises once a step arrives."""

    name = "tasked"
    subscriptions = (StepProgress,)
    decides_recovery = True

    def __init__(self) -> None:
        super().__init__(settings=NoSettings())
        self.told = asyncio.Event()
        self.idle_ended = asyncio.Event()
        self.said: list[str] = []

    async def start(self, *, ctx: PluginContext[NoSettings]) -> None:
        self.idle = ctx.tasks.start(self._idle, name="idle")
        ctx.tasks.start(self._boom, name="boom")

    async def _idle(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.said.append("idle cancelled")
            self.idle_ended.set()

    async def _boom(self) -> None:
        await self.told.wait()
        raise RuntimeError("the watch broke")

    async def handle(self, *, record: Record, ctx: PluginContext[NoSettings]) -> None:
        self.said.append(f"step {getattr(record.event, 'step', '?')}")

    async def stop(self, *, ctx: PluginContext[NoSettings]) -> None:
        self.said.append(f"stop (idle done: {self.idle.done()})")


async def test_a_plugin_task_that_raises_is_a_plugin_failure_that_disables_the_plugin_and_its_tasks() -> None:
    plugin = _Tasked()
    async with plugin_master(plugin, job="tasks") as master:
        await master.submit(JobSubmitted(job="tasks", min_nodes=1, max_nodes=1, nproc_per_node=1))
        await master.reactor.wait_until(lambda s: s.deciders == frozenset({"tasked"}))
        await master.submit(StepProgress(round=1, step=1))
        await settle(master)
        plugin.told.set()
        with anyio.fail_after(30):
            await plugin.idle_ended.wait()  # its other task is cancelled with it
        state = await master.reactor.wait_until(lambda s: s.deciders == frozenset(), timeout_s=30)
        await master.submit(StepProgress(round=1, step=2))  # a disabled plugin is handed nothing more
        await settle(master)
        records = await master.reactor.log.read()
    (failed,) = [r.event for r in records if isinstance(r.event, PluginFailed)]
    assert (failed.plugin, failed.event_type, failed.disabled) == ("tasked", "task:boom", True)
    assert "RuntimeError('the watch broke')" in failed.error
    assert state.deciders == frozenset()  # the job's failures go to the default policy from now on
    assert plugin.said == ["step 1", "idle cancelled"]  # no step 2, and no stop() for a disabled plugin


async def test_a_plugins_tasks_are_cancelled_and_awaited_when_the_master_stops_before_its_stop() -> None:
    plugin = _Tasked()
    async with plugin_master(plugin, job="tasks") as master:
        await master.submit(JobSubmitted(job="tasks", min_nodes=1, max_nodes=1, nproc_per_node=1))
        await settle(master)
    # the task ended first; a cancellation is no failure (a failure would have disabled it: no stop())
    assert plugin.said == ["idle cancelled", "stop (idle done: True)"]


async def test_no_task_starts_once_the_tasks_are_closed_and_end_waits_for_the_ones_named() -> None:
    tasks = PluginTasks("p")
    ended: list[str] = []

    async def forever(label: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(label)

    first, second = tasks.start(forever, "first", name="a"), tasks.start(forever, "second", name="b")
    await asyncio.sleep(0)  # both run
    await tasks.end(first)
    assert first.done() and not second.done() and ended == ["first"]
    await tasks.aclose()
    assert second.done() and ended == ["first", "second"]
    with pytest.raises(PluginError, match="plugin 'p': task 'c' cannot start: the plugin was disabled or the master "
                                          "is stopping"):
        tasks.start(forever, "third", name="c")
