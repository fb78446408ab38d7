"""Plugins of the master: the contract and loading with typed settings (the master's host delivers to them).

A plugin (:class:`MasterPlugin`) has a ``name``, the event classes it
``subscriptions`` to, and async hooks that take keyword arguments only (so the
contract can grow without breaking plugins): ``start(*, ctx)``,
``handle(*, record, ctx)`` and ``stop(*, ctx)``. :class:`Plugin` gives every hook a
default. ``ctx`` is the plugin's own :class:`PluginContext`: its settings, its store
keys, the job's state at the record being handled, the ways a plugin acts (emit
events, request a restart or a relaunch, serve RPCs), and its task group
(``ctx.tasks``, :class:`PluginTasks`) for whatever it runs in the background.

Plugins are found through the ``stead.plugins`` entry-point group (see
:mod:`stead.core.entrypoints` for the rules); the entry point names a class or
factory called as ``factory(settings=<the plugin's settings>)``. A plugin is
validated when it is loaded, not when first called. The master's
:mod:`stead.core.master.plugin_host` guards every call: a
timeout, a structured log line with the plugin's name, a ``PluginFailed``
event, and the plugin disabled after ``plugin_max_failures`` failures in a row.
A background task that raises is recorded the same way and disables its plugin at
once (what it did is no longer done); a disabled plugin's tasks are cancelled, and
every plugin's tasks are cancelled and awaited when the master stops, before its
``stop()``. A faulty plugin never takes the master down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

import structlog

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings, load_settings
from stead.core.entrypoints import installed, load_group, load_named
from stead.core.errors import ConfigError, PluginError
from stead.core.events import Event, Record, RelaunchRequested, RestartRequested, StacksRequested
from stead.core.statemachine import JobState
from stead.core.store.base import StateStore
from stead.core.worker.numerics_settings import NAMESPACE as NUMERICS
from stead.core.worker.numerics_settings import NumericsSettings

__all__ = [
    "GROUP",
    "MasterPlugin",
    "NoSettings",
    "NodeTelemetry",
    "Plugin",
    "PluginContext",
    "PluginTasks",
    "check_plugin_settings",
    "load_plugins",
    "validate_plugin",
]

GROUP = "stead.plugins"
log = structlog.get_logger("stead.plugins")

S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a plugin that declares none."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeTelemetry:
    """What a node's last heartbeat said (never an event: heartbeats are not persisted)."""

    incarnation: int
    round: int
    #: the slowest local worker's last step; None before the first
    step: int | None
    #: seconds per step its slowest rank spends on its own work (outside backward()); None before enough steps
    step_compute_s: float | None
    rss_bytes: int | None
    cpu_percent: float | None
    #: when the heartbeat arrived (the master's clock, ``ctx.clock.now()``)
    seen: float
    #: memory in use on the node's fullest GPU, bytes, and its GPUs' mean utilisation, percent; None when unknown
    gpu_memory_bytes: int | None = None
    gpu_util_percent: float | None = None


TaskFailed = Callable[[str, Exception], Awaitable[None]]
"""What the host does when a plugin's task named so raised this (records a PluginFailed, disables the plugin)."""


class PluginTasks:
    """A plugin's background tasks, owned by its plugin host: ``self._watch = ctx.tasks.start(self._watch_job, ctx,
    name="watch")`` in ``start()``, never a bare ``asyncio.create_task``.

    A task runs until it returns, its plugin is disabled, or the master stops; then the host cancels it and waits
    for it, before the plugin's ``stop()``. A task that raises is a failure of its plugin, as a hook's is: logged
    with the plugin's name, recorded as ``PluginFailed`` (``event_type`` ``task:<name>``), and the plugin is
    disabled at once (what the task did is no longer done), its other tasks cancelled. :meth:`end` cancels and
    awaits some of them earlier. A context made outside a host (a plugin's own tests) has tasks of its own,
    ended by :meth:`aclose` or :meth:`end`; a failure there is logged only.
    """

    def __init__(self, plugin: str, *, failed: TaskFailed | None = None) -> None:
        self.plugin = plugin
        self._failed = failed
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self, run: Callable[..., Coroutine[Any, Any, None]], *args: object, name: str) -> asyncio.Task[None]:
        """Run ``run(*args)`` in the background as task ``name``; the task, to :meth:`end` it early."""
        if self._closed:
            raise PluginError(f"plugin {self.plugin!r}: task {name!r} cannot start: the plugin was disabled or the "
                              "master is stopping")
        task = asyncio.get_running_loop().create_task(self._guarded(run, args, name),
                                                      name=f"plugin:{self.plugin}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guarded(self, run: Callable[..., Coroutine[Any, Any, None]], args: tuple[object, ...],
                       name: str) -> None:
        try:
            await run(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._failed is None:
                log.exception("plugin_task_failed", plugin=self.plugin, task=name, error=repr(exc))
            else:
                await self._failed(name, exc)

    async def end(self, *tasks: asyncio.Task[None] | None) -> None:
        """Cancel ``tasks`` (None: skipped) and wait until they have ended."""
        running = {t for t in tasks if t is not None}
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)

    def cancel(self) -> None:
        """Cancel every task (but the one calling); no task starts from now on."""
        self._closed = True
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def aclose(self) -> None:
        """Cancel every task and wait until they have ended."""
        self.cancel()
        current = asyncio.current_task()
        waiting = {t for t in self._tasks if t is not current}
        if waiting:
            await asyncio.wait(waiting)


class PluginContext(Generic[S]):
    """What one plugin may see and do. Each hook call gets one; in ``handle`` its ``state`` is the record's."""

    def __init__(self, *, plugin: str, job: str, settings: S, stead_settings: Settings, store: StateStore,
                 state: Callable[[], JobState], emit: Callable[[Event], Awaitable[Record]],
                 add_rpc_handler: Callable[[object], None] | None,
                 live: Callable[[], JobState] | None = None,
                 telemetry: Callable[[], Mapping[str, NodeTelemetry]] | None = None,
                 clock: Clock = WALL_CLOCK, tasks: PluginTasks | None = None) -> None:
        self.plugin = plugin
        self.job = job
        #: the plugin's own typed settings (``--set <plugin>.<name>=value``, ``STEAD_<PLUGIN>_<NAME>``)
        self.settings = settings
        #: stead's settings (timeouts, intervals)
        self.stead_settings = stead_settings
        #: the job's state store; keep your own data under :meth:`key`
        self.store = store
        #: the master's clock: wait on it (``await ctx.clock.sleep(s)``, ``async with ctx.clock.fail_after(s)``)
        #: rather than on asyncio, so that a test's :class:`stead.testing.FakeClock` moves the plugin's waits too
        self.clock = clock
        self.log = structlog.get_logger(f"stead.plugins.{plugin}").bind(plugin=plugin)
        self._state = state
        self._live = live or state
        self._emit = emit
        self._add_rpc_handler = add_rpc_handler
        self._telemetry = telemetry
        #: the plugin's background tasks (see :class:`PluginTasks`)
        self.tasks = tasks if tasks is not None else PluginTasks(plugin)

    @property
    def state(self) -> JobState:
        """The job's state: in ``handle``, as it was right after the record; elsewhere, as it is now."""
        return self._state()

    def current_state(self) -> JobState:
        """The job's state now (in ``handle`` it may have moved on since the record)."""
        return self._live()

    def node_telemetry(self) -> Mapping[str, NodeTelemetry]:
        """node id -> what its last heartbeat said (step, step compute time, memory, CPU); live, not persisted."""
        return self._telemetry() if self._telemetry is not None else {}

    def key(self, name: str) -> str:
        """A store key private to this plugin within this job."""
        return f"/stead/jobs/{self.job}/plugins/{self.plugin}/{name}"

    async def emit(self, event: Event) -> Record:
        """Record ``event`` in the job's log (persisted, folded, delivered to subscribers); its record."""
        return await self._emit(event)

    async def request_restart(self, *, round: int, reason: str) -> Record:
        """Ask to restart the workers of the running ``round`` (spends one restart); refused unless it runs."""
        return await self._emit(RestartRequested(round=round, reason=reason, by=self.plugin))

    async def request_stacks(self, *, round: int, reason: str) -> Record:
        """Ask every node of the running ``round`` for its workers' Python stacks; each answers ``StacksDumped``."""
        return await self._emit(StacksRequested(round=round, reason=reason, by=self.plugin))

    async def request_relaunch(self, *, node_id: str, incarnation: int, reason: str) -> Record:
        """Ask to replace a node: killed and relaunched (within its relaunch budget)."""
        return await self._emit(RelaunchRequested(node_id=node_id, incarnation=incarnation, reason=reason,
                                                  by=self.plugin))

    def add_rpc_handler(self, servicer: object) -> None:
        """Serve a grpclib servicer on the master's RPC server (authenticated with the job token); in start()."""
        if self._add_rpc_handler is None:
            raise PluginError(f"plugin {self.plugin!r}: add_rpc_handler() works only in start(), before the "
                              "master's RPC server starts")
        self._add_rpc_handler(servicer)

    def at(self, state: JobState) -> PluginContext[S]:
        """This context with ``state`` fixed (the state at one record)."""
        return PluginContext(plugin=self.plugin, job=self.job, settings=self.settings,
                             stead_settings=self.stead_settings, store=self.store, state=lambda: state,
                             emit=self._emit, add_rpc_handler=None, live=self._live, telemetry=self._telemetry,
                             clock=self.clock, tasks=self.tasks)


class Plugin(Generic[S]):
    """Base class of a master plugin; every hook is optional. Subclass with your settings type, e.g.
    ``class MyPlugin(Plugin[MySettings])`` and ``settings_class = MySettings``."""

    #: the plugin's name: its entry point's name, its settings' namespace, its store keys' folder
    name: ClassVar[str] = ""
    #: the event classes whose records ``handle`` receives
    subscriptions: ClassVar[tuple[type[Event], ...]] = ()
    #: a frozen dataclass of the plugin's settings (None: it has none)
    settings_class: ClassVar[type | None] = None
    #: True when the plugin decides worker failures (emits RecoveryDecided); the job waits for it
    #: up to ``decision_timeout_s`` before the default policy decides
    decides_recovery: ClassVar[bool] = False

    def __init__(self, *, settings: S) -> None:
        self.settings = settings

    async def start(self, *, ctx: PluginContext[S]) -> None:
        """The master starts: load your state, register RPC handlers."""

    async def handle(self, *, record: Record, ctx: PluginContext[S]) -> None:
        """One record of a subscribed event kind, in log order."""

    async def stop(self, *, ctx: PluginContext[S]) -> None:
        """The master stops."""


class MasterPlugin(Protocol):
    """What a master plugin is, as the host calls it (:func:`validate_plugin` checks it when the plugin is loaded).

    ``name``, ``subscriptions`` and ``handle`` it must have; ``start(*, ctx)`` and ``stop(*, ctx)`` (async, see
    :class:`Hook`), ``decides_recovery`` (a bool) and ``settings`` it may. :class:`Plugin` has them all.
    """

    @property
    def name(self) -> str: ...

    @property
    def subscriptions(self) -> tuple[type[Event], ...]: ...

    async def handle(self, *, record: Record, ctx: PluginContext[Any]) -> None: ...


_HOOKS = (("handle", ("record", "ctx")), ("start", ("ctx",)), ("stop", ("ctx",)))


def validate_plugin(plugin: object, *, source: str) -> MasterPlugin:
    """Check the plugin contract now, with an error that says what is missing."""
    name = getattr(plugin, "name", None)
    if not isinstance(name, str) or not name:
        raise PluginError(f"plugin from {source} has no 'name' string attribute; give the plugin class a name")
    subs = getattr(plugin, "subscriptions", None)
    if not isinstance(subs, tuple) or not all(isinstance(s, type) and issubclass(s, Event) for s in subs):
        raise PluginError(
            f"plugin {name!r} ({source}): 'subscriptions' must be a tuple of stead event classes, got {subs!r}"
        )
    for hook, params in _HOOKS:
        fn = getattr(plugin, hook, None)
        if fn is None:
            continue
        if not inspect.iscoroutinefunction(fn):
            raise PluginError(f"plugin {name!r} ({source}): {hook}() must be an 'async def' method")
        signature = inspect.signature(fn).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in signature.values())
        if not takes_all and not set(params) <= set(signature):
            raise PluginError(f"plugin {name!r} ({source}): {hook}() must accept the keyword arguments "
                              f"{', '.join(p + '=' for p in params)}")
        if any(p.kind is p.POSITIONAL_ONLY for p in signature.values()):
            raise PluginError(f"plugin {name!r} ({source}): {hook}() must take keyword arguments only")
    if getattr(plugin, "handle", None) is None:
        raise PluginError(f"plugin {name!r} ({source}) has no handle() method; subclass stead.plugin.Plugin")
    return cast(MasterPlugin, plugin)


def _settings_class(name: str, factory: object) -> type | None:
    cls = getattr(factory, "settings_class", None)
    if cls is not None and not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise PluginError(f"plugin {name!r}: settings_class must be a dataclass, got {cls!r}")
    return cls


def instantiate(name: str, factory: object, source: str, settings: Settings) -> Any:
    """Build a plugin (or agent extension) from its entry point with its own typed settings."""
    cls = _settings_class(name, factory)
    own = load_settings(cls, name, settings) if cls is not None else NoSettings()
    if not callable(factory):
        raise PluginError(f"entry point {source} of {name!r} is not a class or factory")
    try:
        return factory(settings=own)
    except (ConfigError, PluginError):
        raise
    except Exception as exc:
        raise PluginError(f"plugin {name!r} ({source}) failed to start: {exc!r}; fix it or disable it "
                          f"with --no-plugin {name}") from exc


def load_plugins(*, settings: Settings, enabled: Sequence[str] | None = None,
                 disabled: Iterable[str] = ()) -> list[MasterPlugin]:
    """Instantiate the installed plugins (see :mod:`stead.core.entrypoints` for which, and what fails)."""

    def build(name: str, factory: object, source: str) -> MasterPlugin:
        plugin = validate_plugin(instantiate(name, factory, source, settings), source=f"entry point {source}")
        if plugin.name != name:
            raise PluginError(f"plugin {plugin.name!r} is registered under the entry point name {name!r}; "
                              "use the same name for both (it is the settings' namespace)")
        return plugin

    return load_group(GROUP, what="plugin", enabled=enabled, disabled=disabled, validate=build)


#: where the platforms' entry points are: a platform's factory may declare a settings_class like a plugin
PLATFORM_GROUP = "stead.platforms"


def check_plugin_settings(settings: Settings, *, group: str = GROUP) -> None:
    """Every ``--set plugin.name=value`` names an installed plugin (or platform with settings), or ``numerics``
    (the workers' :mod:`stead.numerics`), and one of its settings, with a valid value."""
    names = installed(group)
    platforms = installed(PLATFORM_GROUP) if group == GROUP else []
    for plugin in settings.plugin_values:
        if plugin == NUMERICS and group == GROUP:  # the workers' (and the diagnosis') settings, not a plugin's
            load_settings(NumericsSettings, NUMERICS, settings)
            continue
        if plugin not in names and plugin not in platforms:
            raise ConfigError(f"--set {plugin}.…: no plugin {plugin!r} is installed (installed: "
                              f"{', '.join(names) or 'none'}; platforms: {', '.join(platforms) or 'none'})")
        where = group if plugin in names else PLATFORM_GROUP
        _, factory, _ = load_named(where, plugin, what="plugin" if where == group else "platform")
        cls = _settings_class(plugin, factory)
        if cls is None:
            raise ConfigError(f"--set {plugin}.{next(iter(settings.plugin_values[plugin]))}: the {plugin} plugin "
                              "has no settings")
        load_settings(cls, plugin, settings)
