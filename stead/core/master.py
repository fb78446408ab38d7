"""The master: composition root of one job's control plane.

``async with Master(config) as master`` opens the state store (retrying with
backoff while it is unavailable), replays the job's event log, starts the RPC
server, the plugins and the platform, and finishes whatever a previous master
left undone. It can be embedded in any asyncio program::

    async with stead.Master(MasterConfig(job="demo", store_url="sqlite:///demo.db")) as master:
        await master.submit(JobSubmitted(job="demo", min_nodes=1, max_nodes=1, nproc_per_node=2))
        state = await master.wait()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import structlog

from stead.core.config import Settings
from stead.core.errors import ConfigError, PlatformError, RetryableError, StoreUnavailable
from stead.core.events import Event, JobSubmitted, Record
from stead.core.events.log import EventLog
from stead.core.hub import AgentHub
from stead.core.platform import NodeSpec, Platform
from stead.core.plugins import Plugin, PluginContext, PluginHost, load_plugins
from stead.core.reactor import Reactor
from stead.core.retry import retrying
from stead.core.rpc import AgentServicer, KvServicer, RpcServer, Servicer, new_token, write_token_file
from stead.core.statemachine import (
    Effect,
    JobState,
    KillNode,
    LaunchNode,
    StartWorkers,
    StopNode,
    StopWorkers,
)
from stead.core.store import StateStore, open_store
from stead.core.tracing import RecoveryTracer

__all__ = ["Master", "MasterConfig", "open_store_retrying"]

log = structlog.get_logger("stead.master")

NodeSpecFactory = Callable[[str, int, str, str], NodeSpec]
"""(node_id, incarnation, master address, token file) -> NodeSpec"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MasterConfig:
    job: str
    store_url: str = "memory://"
    settings: Settings = dataclasses.field(default_factory=Settings)
    #: the platform that runs nodes; None = nodes are started by someone else (tests, `stead agent` by hand)
    platform: Platform | None = None
    #: how to start a node's agent on the platform
    node_spec: NodeSpecFactory | None = None
    #: plugins to load: None = every installed one; ``plugin_objects`` are added as they are
    plugins: Sequence[str] | None = None
    disabled_plugins: Sequence[str] = ()
    plugin_objects: Sequence[Plugin] = ()
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    #: where the job token is written for agents; default: ``.stead/<job>.token``
    token_file: str | None = None
    #: host a torch TCPStore for the workers' process groups (needs torch)
    tcp_store: bool = True


async def open_store_retrying(url: str, settings: Settings) -> StateStore:
    """Open the store, retrying with exponential backoff while it is unavailable."""
    try:
        return await retrying(lambda: open_store(url, settings=settings), settings, what=f"state store {url}")
    except RetryableError as exc:
        raise StoreUnavailable(
            f"state store {url} still unavailable after {settings.retry_deadline_s:g} s ({exc}); "
            "start it, check the URL, or raise retry_deadline_s"
        ) from exc


class Master:
    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.settings = config.settings
        self.token = config.token or new_token()
        self.token_file = Path(config.token_file or Path(".stead") / f"{config.job}.token")
        self._stack = contextlib.AsyncExitStack()
        self._store: StateStore | None = None
        self._reactor: Reactor | None = None
        self._rpc: RpcServer | None = None
        #: one torch TCPStore per round, so no round ever reads a previous round's keys
        self._tcp_stores: dict[int, Any] = {}
        self._tcp_addr: tuple[str, int] = (config.host, 0)
        self.tracer = RecoveryTracer(job=config.job)
        self.plugin_host: PluginHost | None = None
        self.hub = AgentHub(
            job=config.job, settings=self.settings, submit=self.submit,
            get_state=lambda: self.state, store_addr=lambda: self._tcp_addr,
        )

    # -- public API --------------------------------------------------------------

    @property
    def state(self) -> JobState:
        return self._reactor.state if self._reactor else JobState()

    @property
    def address(self) -> str:
        assert self._rpc is not None, "the master is not running"
        return self._rpc.address

    @property
    def store(self) -> StateStore:
        assert self._store is not None, "the master is not running"
        return self._store

    @property
    def reactor(self) -> Reactor:
        assert self._reactor is not None, "the master is not running"
        return self._reactor

    async def submit(self, event: Event) -> Record:
        """Record an event and apply it (the way plugins and the RPC layer feed the master)."""
        return await self.reactor.submit(event)

    async def submit_job(self, spec: JobSubmitted) -> None:
        """Submit the job unless this store already holds it (then the master simply resumes it)."""
        if self.state.spec is None:
            await self.submit(spec)
        elif self.state.spec != spec:
            log.info("job_resumed_with_stored_spec", job=self.config.job)

    async def wait(self) -> JobState:
        """Wait until the job has ended; return its final state."""
        return await self.reactor.wait_until(lambda s: s.phase.terminal)

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Master:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        cfg = self.config
        structlog.contextvars.bind_contextvars(job=cfg.job)
        self._store = await open_store_retrying(cfg.store_url, self.settings)
        self._stack.push_async_callback(self._store.close)
        if cfg.tcp_store:
            await self._start_tcp_store()
        event_log = EventLog(self._store, cfg.job)
        self._reactor = await self._stack.enter_async_context(
            Reactor(event_log, self, settings=self.settings, observers=[self.tracer])
        )
        handlers: list[Servicer] = [AgentServicer(self.hub), KvServicer()]
        ctx = PluginContext(
            job=cfg.job, settings=self.settings, store=self._store, get_state=lambda: self.state,
            emit=self.submit, add_rpc_handler=lambda handler: handlers.append(handler),  # type: ignore[arg-type]
        )
        plugins = [*load_plugins(settings=self.settings, enabled=cfg.plugins, disabled=cfg.disabled_plugins),
                   *cfg.plugin_objects]
        self.plugin_host = await self._stack.enter_async_context(PluginHost(plugins, ctx=ctx))
        self._reactor.add_observer(lambda record, _state: self._deliver(record))
        self.token_file.parent.mkdir(parents=True, exist_ok=True)
        write_token_file(self.token_file, self.token)
        self._stack.callback(self.token_file.unlink, missing_ok=True)
        self._rpc = await self._stack.enter_async_context(
            RpcServer(handlers, token=self.token, host=cfg.host, port=cfg.port, token_file=self.token_file)
        )
        if cfg.platform is not None:
            await self._stack.enter_async_context(_as_context(cfg.platform))
        tasks = await self._stack.enter_async_context(_TaskGroup())
        if cfg.platform is not None:
            tasks.start(self._pump_platform(cfg.platform), "platform-events")
        tasks.start(self.hub.watch_heartbeats(), "heartbeats")
        state = await self._reactor.resume()
        log.info("master_ready", address=self.address, token_file=str(self.token_file), phase=state.phase.value,
                 plugins=self.plugin_host.names, store=cfg.store_url)

    def _deliver(self, record: Record) -> None:
        if self.plugin_host is not None:
            self.plugin_host.deliver(record)

    async def _start_tcp_store(self) -> None:
        """Warm up torch's import and host the store of the next round."""
        await self._round_store(self.state.rdzv.round + 1)
        self._stack.callback(self._tcp_stores.clear)  # a TCPStore server stops when its last reference goes

    async def _round_store(self, round_: int) -> tuple[str, int]:
        if not self.config.tcp_store:
            return self._tcp_addr
        if round_ not in self._tcp_stores:

            def create() -> Any:
                from torch.distributed import TCPStore  # type: ignore[attr-defined]

                return TCPStore(self.config.host, 0, is_master=True, wait_for_workers=False, use_libuv=True)

            self._tcp_stores[round_] = await asyncio.to_thread(create)
            for old in sorted(self._tcp_stores)[:-2]:  # keep this round's and the previous one's
                del self._tcp_stores[old]
        self._tcp_addr = (self.config.host, int(self._tcp_stores[round_].port))
        return self._tcp_addr

    async def _pump_platform(self, platform: Platform) -> None:
        async for event in platform.events():
            await self.submit(event)

    # -- EffectRunner ----------------------------------------------------------------

    async def run(self, effect: Effect) -> None:
        match effect:
            case LaunchNode():
                platform, factory = self.config.platform, self.config.node_spec
                if platform is None or factory is None:
                    log.info("node_wanted", node=effect.node_id, incarnation=effect.incarnation,
                             hint="start its agent with `stead agent`")
                    return
                spec = factory(effect.node_id, effect.incarnation, self.address, str(self.token_file.resolve()))
                try:
                    await platform.launch(spec)
                except OSError as exc:
                    raise PlatformError(f"could not launch {effect.node_id}: {exc}") from exc
            case KillNode():
                if self.config.platform is not None:
                    await self.config.platform.kill(effect.node_id, effect.incarnation)
            case StartWorkers():
                self.hub.send(effect, store_addr=await self._round_store(effect.round))
            case StopWorkers() | StopNode():
                self.hub.send(effect)
            case _:
                raise ConfigError(f"the master cannot run effect {effect!r}")


@contextlib.asynccontextmanager
async def _as_context(platform: Platform) -> AsyncIterator[Platform]:
    enter = getattr(platform, "__aenter__", None)
    if enter is None:
        yield platform
        return
    async with platform:  # type: ignore[attr-defined]
        yield platform


class _TaskGroup:
    """Background tasks owned by the master: cancelled (not awaited to completion) on exit."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> _TaskGroup:
        return self

    def start(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._report)

    @staticmethod
    def _report(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("master_task_failed", task=task.get_name(), error=repr(task.exception()))

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
