"""The master: composition root of one job's control plane. It only wires; the reactor is the loop.

``async with Master(config) as master`` opens the state store (retrying with
backoff while it is unavailable), builds the reactor with its effect executor
and the plugin host, starts the plugins, the RPC server, the platform and the
background tasks, then resumes the job from its log. It can be embedded in any
asyncio program (:mod:`stead.embed` builds one from a job spec)::

    async with stead.Master(MasterConfig(job="demo", store_url="sqlite:///demo.db")) as master:
        await master.submit(JobSubmitted(job="demo", min_nodes=1, max_nodes=1, nproc_per_node=2))
        state = await master.wait()

Background tasks (the heartbeat watcher, the platform's events) run in the
master's task group under supervision: one that fails is restarted, and one
that fails ``master_task_max_failures`` times stops the master with
:class:`MasterTaskFailed` instead of leaving a job that no longer notices lost
nodes. A task that failed because the state store is away does not count: it
waits for the store to answer and starts again; a store away for longer than
``retry_deadline_s`` stops the master.

A master that stops on a retryable failure (the store away past its deadline, a
task that kept failing, the reactor stopped) leaves the job's nodes and their
rendezvous stores running when ``leave_nodes_on_failure`` is set (``stead run``'s
and ``stead master``'s masters): the workers keep stepping and the next master
adopts them. Any other end (the job ended, a stop, a bug) stops the nodes. That
policy, and the adoption, are :mod:`stead.core.master.takeover`'s; the job token's life
(given, written for the agents, forgotten at the job's end) is
:func:`stead.core.jobtoken.held_job_token`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import structlog

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings
from stead.core.errors import MasterTaskFailed, RetryableError, StoreUnavailable
from stead.core.events import Event, JobSubmitted, PluginsStarted, Record
from stead.core.events.log import EventLog, job_prefix
from stead.core.jobtoken import JOB_TOKEN_ENV, default_token_file, held_job_token
from stead.core.master.executor import Executor, NodeSpecFactory
from stead.core.master.gateway import AgentGateway
from stead.core.master.gcsteward import steward_gc
from stead.core.master.plugin_host import PluginHost
from stead.core.master.rdzv_stores import RoundStores
from stead.core.master.reactor import Reactor
from stead.core.master.takeover import Takeover, leaf_errors
from stead.core.master.tasks import MasterTasks
from stead.core.platform import Platform
from stead.core.plugins import MasterPlugin, load_plugins
from stead.core.retry import retrying
from stead.core.rpc import AgentServicer, RpcServer, server_context, tls_files
from stead.core.statemachine import JobPhase, JobState
from stead.core.store import StateStore, open_store, public_store_url
from stead.core.views.metrics import JobMetrics, MetricsServer, read_metrics_token
from stead.core.views.tracing import RecoveryTracer

__all__ = ["JOB_TOKEN_ENV", "Master", "MasterConfig", "MasterTaskFailed", "NodeSpecFactory", "open_store_retrying"]

log = structlog.get_logger("stead.master")


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
    plugin_objects: Sequence[MasterPlugin] = ()
    host: str = "127.0.0.1"
    port: int = 0
    #: a listening socket to serve on instead of binding ``host:port`` (``stead run`` keeps one for every master
    #: it starts, so that agents find a restarted master where the one that died was)
    listen_fd: int | None = None
    #: the job's token when it is given (``STEAD_JOB_TOKEN``: a Kubernetes Secret, `stead run`'s supervisor);
    #: None: the one in ``token_file`` if that exists, else a new one (see :mod:`stead.core.jobtoken`)
    token: str | None = None
    #: where the job token is written for agents, kept until the job ends; default: ``.stead/<job>.token``
    token_file: str | None = None
    #: host a torch TCPStore for the workers' process groups (needs torch)
    tcp_store: bool = True
    #: serve Prometheus metrics on ``settings.metrics_host``: -1 not at all, 0 on a free port, else on this port
    metrics_port: int = -1
    #: how long the master waits for the state store at start; None: ``store_connect_timeout_s`` (a master that
    #: takes over a running job waits ``retry_deadline_s``: its nodes are running, a store outage is worth riding out)
    store_wait_s: float | None = None
    #: a master that fails with a retryable error leaves its nodes running for the next master to adopt (instead of
    #: stopping them, as it does when the job ends or a bug stops it)
    leave_nodes_on_failure: bool = False
    #: what the reactor's timers, the log's record times and the plugins' waits go by (a test's FakeClock)
    clock: Clock = WALL_CLOCK
    #: more services for the master's RPC server (a platform's: the hosts of a job over several machines offer
    #: themselves on one), authenticated with the job token like the agents' service
    rpc_handlers: Sequence[Any] = ()


async def open_store_retrying(url: str, settings: Settings, *, deadline_s: float | None = None) -> StateStore:
    """Open the store, retrying for ``deadline_s`` (default ``store_connect_timeout_s``) while it is unavailable.

    At start-up nothing runs yet that waiting would save: a store that is not there
    is said in seconds, not after the minute a running master rides out an outage.
    A master taking over a running job passes ``retry_deadline_s``: its nodes train on meanwhile.
    """
    limit = settings.store_connect_timeout_s if deadline_s is None else deadline_s
    setting = "store_connect_timeout_s" if deadline_s is None else "retry_deadline_s"
    shown = public_store_url(url)
    try:
        return await retrying(lambda: open_store(url, settings=settings), settings, what=f"state store {shown}",
                              deadline_s=limit)
    except RetryableError as exc:
        raise StoreUnavailable(
            f"state store {shown} is unreachable (tried for {limit:g} s: {exc}); "
            f"start it, check the URL, or raise {setting}"
        ) from exc


class Master:
    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.settings = config.settings
        #: the job's token (see :func:`~stead.core.jobtoken.job_token`); set when the master starts
        self.token = config.token or ""
        self.token_file = Path(config.token_file or default_token_file(config.job))
        self._stack = contextlib.AsyncExitStack()
        self._store: StateStore | None = None
        self._reactor: Reactor | None = None
        self._rpc: RpcServer | None = None
        # a round's store is asked for by the round's start effect: the effect's bound is the request's
        self.rounds = RoundStores(config.host, enabled=config.tcp_store,
                                  gone_timeout_s=config.settings.master_gone_timeout_s,
                                  timeout_s=config.settings.effect_timeout_s,
                                  auth_timeout_s=config.settings.rdzv_host_auth_timeout_s,
                                  max_pending=config.settings.rdzv_host_max_pending, settings=config.settings)
        self.tracer = RecoveryTracer(job=config.job)
        self.metrics: JobMetrics | None = None
        #: where the Prometheus metrics are served; None when they are not
        self.metrics_url: str | None = None
        self.plugin_host: PluginHost | None = None
        self.gateway = AgentGateway(job=config.job, settings=self.settings, submit=self.submit,
                                    get_state=lambda: self.state, store_addr=lambda: self.rounds.latest,
                                    round_store=self.rounds.for_round, clock=config.clock)
        self.gateway.liveness.serving = False  # until the log is replayed (see _start)

    # -- public API --------------------------------------------------------------

    @property
    def state(self) -> JobState:
        """The job's state now (a fresh job's before the master started)."""
        return self._reactor.state if self._reactor else JobState()

    @property
    def phase(self) -> JobPhase:
        return self.state.phase

    def _largest_world(self) -> int | None:
        """The most ranks the job can have (MAX nodes x processes per node); None before it is submitted."""
        spec = self.state.spec
        return spec.max_nodes * spec.nproc_per_node if spec is not None else None

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

    async def wait(self, until: JobPhase | Callable[[JobState], bool] | None = None, *,
                   timeout_s: float | None = None) -> JobState:
        """Wait until the job is in phase ``until`` (or it ended), ``until(state)`` holds, or (None) it ended.

        Returns the state then; TimeoutError after ``timeout_s``.
        """
        predicate: Callable[[JobState], bool]
        if until is None:
            predicate = _ended
        elif isinstance(until, JobPhase):
            phase = until
            predicate = lambda s: s.phase is phase or s.phase.terminal  # noqa: E731
        else:
            predicate = until
        return await self.reactor.wait_until(predicate, timeout_s=timeout_s if timeout_s is not None else float("inf"))

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> Master:
        try:
            await self._start()
        except BaseException:  # the exit callbacks judge the failure: a retryable one leaves the nodes running
            await self.__aexit__(*sys.exc_info())
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        # the exit callbacks see what stopped the master: a retryable failure leaves the nodes to the next one
        given = exc[1] if len(exc) > 1 else None
        try:
            await self._stack.__aexit__(*exc)
        except BaseExceptionGroup as group:  # a supervised task or the reactor failed: say which, plainly
            errors = [e for e in leaf_errors(group)
                      if not isinstance(e, anyio.get_cancelled_exc_class()) and e is not given]
            if errors:
                raise errors[0] from group
            if given is not None:
                return  # only what stopped the master: it goes on as itself
            raise

    async def _announce(self) -> None:
        """Record which process is the job's master now (``stead status --json``: ``master_pid``, ...)."""
        about = {"pid": os.getpid(), "host": socket.gethostname(), "address": self.address,
                 "started_at": time.time(), "metrics": self.metrics_url}
        await retrying(lambda: self.store.put(f"{job_prefix(self.config.job)}master", json.dumps(about).encode()),
                       self.settings, what=f"master record of {self.config.job}")

    async def _start(self) -> None:
        cfg = self.config
        structlog.contextvars.bind_contextvars(job=cfg.job)
        files = tls_files(self.settings)  # bad TLS settings fail before anything starts
        tls = server_context(files) if files is not None else None
        self._store = await open_store_retrying(cfg.store_url, self.settings, deadline_s=cfg.store_wait_s)
        self._stack.push_async_callback(self._store.close)
        handlers: list[Any] = [AgentServicer(self.gateway), *cfg.rpc_handlers]
        plugins = [*load_plugins(settings=self.settings, enabled=cfg.plugins, disabled=cfg.disabled_plugins),
                   *cfg.plugin_objects]
        self.plugin_host = PluginHost(plugins, job=cfg.job, settings=self.settings, store=self._store,
                                      state=lambda: self.state, emit=self.submit, add_rpc_handler=handlers.append,
                                      telemetry=self.gateway.telemetry, clock=cfg.clock)
        observers: list[Any] = [self.tracer]
        if cfg.metrics_port >= 0:  # the log so far first: a master that takes over counts the whole job
            self.metrics = JobMetrics(cfg.job, lambda: self.state)
            events = EventLog(self._store, cfg.job)
            self.metrics.seed(await retrying(events.scan, self.settings, what=f"event log of {cfg.job}"))
            observers.append(self.metrics.observe)
        executor = Executor(platform=cfg.platform, node_spec=cfg.node_spec, commands=self.gateway.command_streams,
                            rounds=self.rounds, address=lambda: self.address, token_file=self.token_file)
        self._reactor = await self._stack.enter_async_context(Reactor(
            EventLog(self._store, cfg.job, clock=cfg.clock.now), executor, settings=self.settings,
            plugins=self.plugin_host, observers=observers, clock=cfg.clock))
        takeover = Takeover(
            job=cfg.job, platform=cfg.platform, rounds=self.rounds, leave_nodes_on_failure=cfg.leave_nodes_on_failure,
            spec_for=executor.spec_for, state=lambda: self.state, reactor_failure=lambda: self.reactor.failure)
        await self._stack.enter_async_context(self.plugin_host)
        self.token = await self._stack.enter_async_context(held_job_token(
            self._store, cfg.job, given=cfg.token, token_file=self.token_file, settings=self.settings,
            ended=lambda: self.state.phase.terminal))
        # the workers' rendezvous stores: a process of their own, found again (or started) here; it imports
        # torch while the nodes start
        await self.rounds.start(self._store, cfg.job, self.token)
        self._stack.push_async_exit(takeover.close_rounds)
        self._rpc = await self._stack.enter_async_context(
            RpcServer(handlers, token=self.token, host=cfg.host, port=cfg.port, token_file=self.token_file,
                      max_message_bytes=self.settings.rpc_max_message_bytes,
                      max_connections=self.settings.rpc_max_connections,
                      idle_timeout_s=self.settings.rpc_idle_timeout_s, auth_timeout_s=self.settings.rpc_auth_timeout_s,
                      listen_fd=cfg.listen_fd, world_size=self._largest_world, tls=tls))
        if self.metrics is not None:
            token = read_metrics_token(self.settings.metrics_token_file) if self.settings.metrics_token_file else None
            server = MetricsServer(self.metrics, host=self.settings.metrics_host, port=cfg.metrics_port, token=token,
                                   request_timeout_s=self.settings.metrics_request_timeout_s,
                                   max_connections=self.settings.metrics_max_connections)
            self.metrics_url = server.url
            self._stack.callback(server.close)
        await self._announce()
        if cfg.platform is not None:
            await self._stack.enter_async_context(_as_context(cfg.platform))
            self._stack.push(takeover.leave_nodes_if_failed)
        tasks = await self._stack.enter_async_context(MasterTasks(self.settings, store=self._store))
        if cfg.platform is not None:
            platform = cfg.platform
            tasks.start("platform-events", lambda: self._pump_platform(platform))
        tasks.start("heartbeats", self.gateway.liveness.watch)
        tasks.start("progress", self.gateway.progress.watch)
        tasks.start("acks", self.gateway.command_streams.record_acks)
        tasks.start("gc", lambda: steward_gc(self.settings, clock=cfg.clock))
        await self._reactor.resume(before_acting=takeover.adopt_nodes)
        self.gateway.liveness.serving = True
        host = self.plugin_host
        await self._reactor.submit_many([*host.start_failures, PluginsStarted(plugins=tuple(host.names),
                                                                              deciders=tuple(host.deciders))])
        log.info("master_ready", address=self.address, token_file=str(self.token_file), phase=self.state.phase.value,
                 plugins=host.names, deciders=host.deciders, store=public_store_url(cfg.store_url))

    async def _pump_platform(self, platform: Platform) -> None:
        async for event in platform.events():  # an event taken from the platform is recorded, store outage or not
            await retrying(lambda: self.submit(event), self.settings, what=f"platform event {event.type_name}")  # noqa: B023


def _ended(state: JobState) -> bool:
    return state.phase.terminal


@contextlib.asynccontextmanager
async def _as_context(platform: Platform) -> AsyncIterator[Platform]:
    enter = getattr(platform, "__aenter__", None)
    if enter is None:
        yield platform
        return
    async with platform:  # type: ignore[attr-defined]
        yield platform
