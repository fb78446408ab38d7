"""Plugin contract, entry-point loading and guarded delivery.

A plugin is any object with a ``name``, a tuple of event classes it
``subscriptions`` to, and an ``async def handle(self, *, record, ctx)``; it may
also have ``async def start(self, *, ctx)`` and ``async def stop(self)``. Hooks
take keyword arguments only so the contract can grow without breaking plugins.

Plugins are found through the ``stead.plugins`` entry-point group; the entry
point names a factory called as ``factory(settings=...)``. A plugin is validated
when it is loaded, not when first called. Every call is guarded: a timeout, a
structured log line with the plugin's name, a ``PluginFailed`` event, and the
plugin disabled after ``plugin_max_failures`` failures in a row. A faulty plugin
never takes the master down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol, runtime_checkable

import structlog

from stead.core.config import Settings
from stead.core.errors import PluginError
from stead.core.events import Event, PluginFailed, Record
from stead.core.statemachine import JobState
from stead.core.store.base import StateStore

__all__ = ["Plugin", "PluginContext", "PluginHost", "load_plugins", "validate_plugin"]

GROUP = "stead.plugins"
log = structlog.get_logger("stead.plugins")


@dataclasses.dataclass(frozen=True)
class PluginContext:
    """What a plugin may use: the job's state, event emission, its own keys, the settings."""

    job: str
    settings: Settings
    store: StateStore
    get_state: Callable[[], JobState]
    emit: Callable[[Event], Awaitable[Record | None]]
    #: plugins that serve RPCs (e.g. data sharding) add grpclib handlers here before the server starts
    add_rpc_handler: Callable[[object], None]

    @property
    def state(self) -> JobState:
        return self.get_state()

    def key(self, plugin: str, name: str) -> str:
        """A store key private to ``plugin`` within this job."""
        return f"/stead/jobs/{self.job}/plugins/{plugin}/{name}"


@runtime_checkable
class Plugin(Protocol):
    name: str
    subscriptions: tuple[type[Event], ...]

    async def handle(self, *, record: Record, ctx: PluginContext) -> None: ...


def validate_plugin(plugin: object, *, source: str) -> Plugin:
    """Check the plugin contract now, with an error that says what is missing."""
    name = getattr(plugin, "name", None)
    if not isinstance(name, str) or not name:
        raise PluginError(f"plugin from {source} has no 'name' string attribute; give the plugin class a name")
    subs = getattr(plugin, "subscriptions", None)
    if not isinstance(subs, tuple) or not all(isinstance(s, type) and issubclass(s, Event) for s in subs):
        raise PluginError(
            f"plugin {name!r} ({source}): 'subscriptions' must be a tuple of stead event classes, got {subs!r}"
        )
    for hook, required in (("handle", True), ("start", False), ("stop", False)):
        fn = getattr(plugin, hook, None)
        if fn is None and not required:
            continue
        if not inspect.iscoroutinefunction(fn):
            raise PluginError(f"plugin {name!r} ({source}): {hook}() must be an 'async def' method")
    params = inspect.signature(plugin.handle).parameters  # type: ignore[attr-defined]
    if not {"record", "ctx"} <= set(params) or any(p.kind is p.POSITIONAL_ONLY for p in params.values()):
        raise PluginError(f"plugin {name!r} ({source}): handle() must accept keyword arguments record= and ctx=")
    return plugin  # type: ignore[return-value]


def _entry_points() -> list[EntryPoint]:
    return sorted(entry_points(group=GROUP), key=lambda ep: ep.name)


def load_plugins(
    *, settings: Settings, enabled: Sequence[str] | None = None, disabled: Iterable[str] = ()
) -> list[Plugin]:
    """Instantiate the installed plugins.

    ``enabled=None`` loads every installed plugin; an import error in one of those is
    logged and the plugin skipped. A plugin named in ``enabled`` must load, or this
    raises :class:`PluginError`.
    """
    off = set(disabled)
    eps = {ep.name: ep for ep in _entry_points()}
    if enabled is not None:
        unknown = [n for n in enabled if n not in eps]
        if unknown:
            raise PluginError(
                f"plugin(s) {unknown} are configured but not installed (installed: {sorted(eps) or 'none'}); "
                "install the package that provides them or remove them from the configuration"
            )
    wanted = [n for n in (enabled if enabled is not None else eps) if n not in off]
    plugins: list[Plugin] = []
    for name in wanted:
        ep = eps[name]
        try:
            factory = ep.load()
            plugin = validate_plugin(factory(settings=settings), source=f"entry point {ep.value}")
        except PluginError:
            if enabled is not None:
                raise
            log.warning("plugin_invalid", plugin=name, entry_point=ep.value, exc_info=True)
            continue
        except Exception as exc:
            if enabled is not None:
                raise PluginError(
                    f"plugin {name!r} failed to load from {ep.value}: {exc!r}; fix or disable it"
                ) from exc
            log.warning("plugin_import_failed", plugin=name, entry_point=ep.value, error=repr(exc))
            continue
        plugins.append(plugin)
    return plugins


@dataclasses.dataclass
class _Slot:
    plugin: Plugin
    queue: asyncio.Queue[Record]
    failures: int = 0
    disabled: bool = False


class PluginHost:
    """Delivers records to subscribed plugins, one ordered queue and task per plugin."""

    def __init__(self, plugins: Sequence[Plugin], *, ctx: PluginContext) -> None:
        self.ctx = ctx
        self._slots = [_Slot(p, asyncio.Queue()) for p in plugins]
        self._group: asyncio.TaskGroup | None = None

    @property
    def names(self) -> list[str]:
        return [s.plugin.name for s in self._slots if not s.disabled]

    async def __aenter__(self) -> PluginHost:
        for slot in self._slots:
            start = getattr(slot.plugin, "start", None)
            if start is not None:
                await self._guarded(slot, "start", start(ctx=self.ctx))
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        for slot in self._slots:
            self._group.create_task(self._run(slot), name=f"plugin:{slot.plugin.name}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._group is not None
        for slot in self._slots:
            slot.disabled = True
            slot.queue.put_nowait(_STOP)
        await self._group.__aexit__(None, None, None)
        for slot in self._slots:
            stop = getattr(slot.plugin, "stop", None)
            if stop is not None:
                await self._guarded(slot, "stop", stop())

    def deliver(self, record: Record) -> None:
        for slot in self._slots:
            if not slot.disabled and isinstance(record.event, slot.plugin.subscriptions):
                slot.queue.put_nowait(record)

    async def drain(self) -> None:
        """Wait until every plugin has handled everything delivered so far."""
        for slot in self._slots:
            await slot.queue.join()

    async def _run(self, slot: _Slot) -> None:
        while True:
            record = await slot.queue.get()
            try:
                if record is _STOP:
                    return
                if not slot.disabled:
                    await self._guarded(slot, record.event.type_name, slot.plugin.handle(record=record, ctx=self.ctx))
            finally:
                slot.queue.task_done()

    async def _guarded(self, slot: _Slot, what: str, call: Awaitable[Any]) -> None:
        name = slot.plugin.name
        try:
            async with asyncio.timeout(self.ctx.settings.plugin_timeout_s):
                await call
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            timeout = self.ctx.settings.plugin_timeout_s
            error = f"timed out after {timeout:g} s" if isinstance(exc, TimeoutError) else repr(exc)
            slot.failures += 1
            slot.disabled = slot.failures >= self.ctx.settings.plugin_max_failures
            log.error("plugin_failed", plugin=name, call=what, error=error, failures=slot.failures,
                      disabled=slot.disabled, exc_info=not isinstance(exc, TimeoutError))
            try:
                await self.ctx.emit(PluginFailed(plugin=name, event_type=what, error=error, disabled=slot.disabled))
            except Exception:  # the log line above already tells the story
                log.exception("plugin_failure_not_recorded", plugin=name)
        else:
            slot.failures = 0


_STOP: Any = Record(seq=-1, at=0.0, event=PluginFailed(plugin="", event_type="", error=""))
