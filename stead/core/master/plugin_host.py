"""The master's plugin host: starts the plugins, delivers each record to its subscribers in log order, stops them.

Every call is guarded: a timeout, a structured log line with the plugin's name, a ``PluginFailed`` event, and
the plugin disabled after ``plugin_max_failures`` failures in a row. A background task (``ctx.tasks``) that
raises is recorded the same way and disables its plugin at once; a disabled plugin's tasks are cancelled, and
every plugin's tasks are cancelled and awaited when the master stops, before its ``stop()``. A faulty plugin
never takes the master down. The contract plugins implement is :mod:`stead.core.plugins`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

import structlog

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings
from stead.core.errors import PluginError
from stead.core.events import Event, PluginFailed, Record
from stead.core.plugins import MasterPlugin, NodeTelemetry, NoSettings, PluginContext, PluginTasks
from stead.core.statemachine import JobState
from stead.core.store.base import StateStore

__all__ = ["PluginHost"]

log = structlog.get_logger("stead.plugins")


class Hook(Protocol):
    """A plugin's optional ``start`` or ``stop``: async, keyword arguments only."""

    def __call__(self, *, ctx: PluginContext[Any]) -> Awaitable[None]: ...


def _hook_of(plugin: MasterPlugin, hook: Literal["start", "stop"]) -> Hook | None:
    found: Hook | None = getattr(plugin, hook, None)
    return found



@dataclasses.dataclass
class _Slot:
    plugin: MasterPlugin
    ctx: PluginContext[Any]
    queue: asyncio.Queue[tuple[Record, JobState] | None]
    tasks: PluginTasks
    failures: int = 0
    disabled: bool = False


class PluginHost:
    """Starts the plugins, delivers ``(record, state at the record)`` to subscribers, stops them.

    One ordered queue and task per plugin: a slow plugin delays only itself. Each plugin's background tasks
    (``ctx.tasks``) are the host's too: cancelled and awaited when it stops, before the plugins' ``stop()``.
    """

    def __init__(self, plugins: Sequence[MasterPlugin], *, job: str, settings: Settings, store: StateStore,
                 state: Callable[[], JobState], emit: Callable[[Event], Awaitable[Record]],
                 add_rpc_handler: Callable[[object], None],
                 telemetry: Callable[[], Mapping[str, NodeTelemetry]] | None = None,
                 clock: Clock = WALL_CLOCK) -> None:
        self.settings = settings
        self._emit = emit
        self._starting = True
        #: what went wrong while the plugins started (the log is not open for events yet): record after resume
        self.start_failures: list[PluginFailed] = []

        def adder(handler: object) -> None:
            if not self._starting:
                raise PluginError("add_rpc_handler() works only in start(), before the RPC server starts")
            add_rpc_handler(handler)

        async def emit_after_start(event: Event) -> Record:
            if self._starting:
                raise PluginError("emit() cannot be used in start(): the job's log opens after every plugin "
                                  "started; emit from handle() or from a task started in start()")
            return await emit(event)

        self._slots: list[_Slot] = []
        for p in plugins:
            tasks = PluginTasks(p.name, failed=functools.partial(self._task_failed, len(self._slots)))
            ctx: PluginContext[Any] = PluginContext(
                plugin=p.name, job=job, settings=getattr(p, "settings", NoSettings()), stead_settings=settings,
                store=store, state=state, emit=emit_after_start, add_rpc_handler=adder, telemetry=telemetry,
                clock=clock, tasks=tasks)
            self._slots.append(_Slot(p, ctx, asyncio.Queue(), tasks))
        self._group: asyncio.TaskGroup | None = None
        self._runners: list[asyncio.Task[None]] = []

    @property
    def names(self) -> list[str]:
        return [s.plugin.name for s in self._slots if not s.disabled]

    @property
    def deciders(self) -> list[str]:
        """The running plugins that decide worker failures."""
        return [s.plugin.name for s in self._slots if not s.disabled and getattr(s.plugin, "decides_recovery", False)]

    async def __aenter__(self) -> PluginHost:
        try:
            for slot in self._slots:
                await self._hook(slot, "start")
        except BaseException:  # (a hook's own failure is recorded, not raised: this is a cancellation)
            await self._close_tasks()
            raise
        self._starting = False
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        self._runners = [self._group.create_task(self._run(slot), name=f"plugin:{slot.plugin.name}")
                         for slot in self._slots]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._group is not None
        for slot in self._slots:
            slot.queue.put_nowait(None)
        if self._runners:  # every plugin handles what it was given, then its tasks end
            await asyncio.wait(self._runners)
        await self._close_tasks()
        await self._group.__aexit__(None, None, None)
        for slot in self._slots:
            if not slot.disabled:
                await self._hook(slot, "stop")

    async def _close_tasks(self) -> None:
        for slot in self._slots:
            await slot.tasks.aclose()

    async def _hook(self, slot: _Slot, hook: Literal["start", "stop"]) -> None:
        fn = _hook_of(slot.plugin, hook)
        if fn is not None:
            await self._guarded(slot, hook, lambda: fn(ctx=slot.ctx), hook=hook)

    def deliver(self, record: Record, state: JobState) -> None:
        for slot in self._slots:
            if not slot.disabled and isinstance(record.event, slot.plugin.subscriptions):
                slot.queue.put_nowait((record, state))

    async def drain(self) -> None:
        """Wait until every plugin has handled everything delivered so far."""
        for slot in self._slots:
            await slot.queue.join()

    async def _run(self, slot: _Slot) -> None:
        while True:
            item = await slot.queue.get()
            try:
                if item is None:
                    return
                record, state = item
                if not slot.disabled:
                    ctx = slot.ctx.at(state)
                    await self._guarded(slot, record.event.type_name,
                                        functools.partial(slot.plugin.handle, record=record, ctx=ctx), hook="handle")
            finally:
                slot.queue.task_done()

    async def _guarded(self, slot: _Slot, what: str, call: Callable[[], Awaitable[Any]], *, hook: str) -> None:
        name = slot.plugin.name
        timeout = self.settings.plugin_timeout_s
        try:
            async with asyncio.timeout(timeout):
                returned = await call()
            if returned is not None:
                raise PluginError(f"{hook}() returned {returned!r:.80}; a plugin hook must return None")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = f"timed out after {timeout:g} s (plugin_timeout_s)" if isinstance(exc, TimeoutError) else repr(exc)
            slot.failures += 1
            if slot.failures >= self.settings.plugin_max_failures:
                self._disable(slot)
            log.error("plugin_failed", plugin=name, call=what, error=error, failures=slot.failures,
                      disabled=slot.disabled, exc_info=not isinstance(exc, (TimeoutError, PluginError)))
            await self._record(PluginFailed(plugin=name, event_type=what, error=error, disabled=slot.disabled))
        else:
            slot.failures = 0

    async def _task_failed(self, index: int, task: str, exc: Exception) -> None:
        """A plugin's background task raised: the plugin is disabled (what the task did is no longer done)."""
        slot = self._slots[index]
        slot.failures += 1
        self._disable(slot)
        log.error("plugin_failed", plugin=slot.plugin.name, call=f"task:{task}", error=repr(exc),
                  failures=slot.failures, disabled=True, exc_info=exc)
        await self._record(PluginFailed(plugin=slot.plugin.name, event_type=f"task:{task}", error=repr(exc),
                                        disabled=True))

    @staticmethod
    def _disable(slot: _Slot) -> None:
        slot.disabled = True
        slot.tasks.cancel()  # a disabled plugin does nothing more

    async def _record(self, failed: PluginFailed) -> None:
        if self._starting:
            self.start_failures.append(failed)
            return
        try:
            await self._emit(failed)
        except Exception:  # the log line before already tells the story
            log.exception("plugin_failure_not_recorded", plugin=failed.plugin)
