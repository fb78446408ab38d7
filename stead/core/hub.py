"""The master's side of the agent protocol: registration, heartbeats, commands.

The hub turns agent calls into events (a registration into NodeJoined; a report
arrives as the event it reports, WorkerFailed, ..., recorded once its node
incarnation is known live), keeps one ordered command queue per node
incarnation, watches heartbeats to declare silent nodes lost, and aggregates
step progress into StepProgress events. Heartbeats
themselves are not events: only what they change is recorded.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import structlog

from stead.core.config import Settings
from stead.core.errors import InvalidRequest, Overloaded, RpcUnavailable
from stead.core.events import (
    Event,
    NodeHealthReported,
    NodeJoined,
    NodeLost,
    Record,
    StacksDumped,
    StepProgress,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.plugins import NodeTelemetry
from stead.core.rpc.backend import (
    AgentCommand,
    AgentReport,
    CheckHealthCmd,
    DumpStacksCmd,
    HeartbeatInfo,
    RegisterInfo,
    RegisterResult,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
)
from stead.core.statemachine import (
    CheckHealth,
    DumpStacks,
    JobState,
    NodePhase,
    StartWorkers,
    StopNode,
    StopWorkers,
)

__all__ = ["AgentHub"]

log = structlog.get_logger("stead.hub")

#: the longest the heartbeat watcher sleeps between two looks at the nodes
_WATCH_MAX_S = 0.5
#: registrations are shed while the loop ran late within this many seconds
_SHED_WINDOW_S = 2.0
#: a shedding master logs it at most this often (a storm of refusals is one line a second, with the count)
_SHED_LOG_EVERY_S = 1.0
#: the longest wait a shedding master asks for
_RETRY_AFTER_MAX_S = 30.0
#: progress is recorded at most once per progress_interval_s, give or take the jitter of the timer that looks
_PROGRESS_SLACK = 0.9


@dataclasses.dataclass
class _Node:
    incarnation: int
    queue: asyncio.Queue[AgentCommand]
    seen: float
    last: AgentCommand | None = None
    round: int = 0
    step: int | None = None
    #: a long phase one of its workers declared; "" when none
    phase: str = ""
    #: its phase changed since the progress was last looked at
    phase_changed: bool = False
    #: what its last heartbeat said (resources, its own time per step), for plugins; None before the first
    telemetry: NodeTelemetry | None = None


class AgentHub:
    def __init__(
        self,
        *,
        job: str,
        settings: Settings,
        submit: Callable[[Event], Awaitable[Record]],
        get_state: Callable[[], JobState],
        store_addr: Callable[[], tuple[str, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.settings = settings
        self._submit = submit
        self._state = get_state
        self._store_addr = store_addr
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._progress_round = 0
        self._progress_step: int | None = None
        self._progress_at = 0.0
        self._progress_phase = ""
        #: the members of round ``_unstepped_round`` that have not reported a step yet
        self._unstepped: set[str] = set()
        self._unstepped_round = 0
        #: False while the master replays its log: agents are told to retry, not that their node is unknown
        self.serving = True
        #: how late the master's loop ran recently (the heartbeat watcher measures it); registrations are shed
        #: (refused with a retry-after) while it is over shed_lag_s
        self.lag_s = 0.0
        #: registrations refused so far, shedding load
        self.shed = 0
        self._shed_logged = -math.inf
        #: the worker failures this master recorded or is recording, by (node, incarnation, round, rank): done
        #: True once on record, False if recording failed (a retry then records it)
        self._failures: dict[tuple[str, int, int, int], asyncio.Future[bool]] = {}
        #: the rounds before this one are forgotten from ``_failures``
        self._failures_from = 0

    def _node(self, node_id: str, incarnation: int) -> _Node:
        node = self._nodes.get(node_id)
        if node is None or node.incarnation != incarnation:
            node = _Node(incarnation=incarnation, queue=asyncio.Queue(), seen=self._clock())
            self._nodes[node_id] = node
        return node

    def _check(self, node_id: str, incarnation: int) -> bool:
        """Whether the node incarnation is live; RpcUnavailable (the agent retries) until the master serves."""
        if not self.serving:
            raise RpcUnavailable(f"the master of job {self.job!r} is starting (replaying the job's log); "
                                 "try again in a moment")
        node = self._state().nodes.get(node_id)
        return node is not None and node.incarnation == incarnation and node.phase.alive

    # -- AgentBackend ---------------------------------------------------------------

    async def register(self, info: RegisterInfo) -> RegisterResult:
        if not self._check(info.node_id, info.incarnation):
            known = self._state().nodes.get(info.node_id)
            current = f"current incarnation {known.incarnation} is {known.phase.value}" if known else "unknown node"
            raise InvalidRequest(
                f"node {info.node_id} incarnation {info.incarnation} is not a live node of job {self.job!r} "
                f"({current}); this agent is stale and should exit"
            )
        joining = self._state().nodes[info.node_id].phase is not NodePhase.JOINED
        if joining:  # a join is an event; an agent registering again (a new master, a lost reply) is not, and is
            self._shed_if_late()  # never refused: the master counts it as joined and waits for its heartbeats
        self._node(info.node_id, info.incarnation).seen = self._clock()
        if joining:
            await self._submit(NodeJoined(node_id=info.node_id, incarnation=info.incarnation, host=info.host,
                                          nproc=info.nproc))
        host, port = self._store_addr()
        return RegisterResult(
            job=self.job,
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            heartbeat_timeout_s=self.settings.heartbeat_timeout_s,
            store_host=host,
            store_port=port,
            progress_interval_s=self.settings.progress_interval_s,
        )

    def _shed_if_late(self) -> None:
        """Refuse (Overloaded, with a retry-after) while the master's loop runs more than shed_lag_s late."""
        if self.lag_s <= self.settings.shed_lag_s:
            return
        self.shed += 1
        now = self._clock()
        if now - self._shed_logged >= _SHED_LOG_EVERY_S:
            self._shed_logged = now
            log.warning("master_shedding_load", lag_s=round(self.lag_s, 2), refused=self.shed,
                        action="new nodes' registrations are refused with a retry-after until the master catches up")
        raise Overloaded(f"the master of job {self.job!r} is overloaded (its loop runs {self.lag_s:.1f} s late); "
                         "register again after the time it says", retry_after_s=min(_RETRY_AFTER_MAX_S, 2 * self.lag_s))

    async def heartbeat(self, info: HeartbeatInfo) -> bool:
        known = self._beat(info)
        if known and self._progress_due(info):
            await self._maybe_progress()
        return known

    async def heartbeats(self, beats: Sequence[HeartbeatInfo]) -> list[str]:
        unknown, due = [], False
        for info in beats:
            if self._beat(info):
                due = self._progress_due(info) or due  # every beat is looked at: it may be a member's first step
            else:
                unknown.append(info.node_id)
        if due:
            await self._maybe_progress()
        return unknown

    def _beat(self, info: HeartbeatInfo) -> bool:
        """Take one heartbeat in (no event: only what it changes is recorded); False for an unknown node."""
        if not self._check(info.node_id, info.incarnation):
            return False
        node = self._node(info.node_id, info.incarnation)
        node.seen = self._clock()
        node.phase_changed = node.phase_changed or info.phase != node.phase
        node.round, node.step, node.phase = info.round, info.step, info.phase
        node.telemetry = NodeTelemetry(incarnation=node.incarnation, round=info.round, step=info.step,
                                       step_compute_s=info.step_compute_s, rss_bytes=info.rss_bytes,
                                       cpu_percent=info.cpu_percent, seen=node.seen,
                                       gpu_memory_bytes=info.gpu_memory_bytes, gpu_util_percent=info.gpu_util_percent)
        return True

    def _progress_due(self, info: HeartbeatInfo) -> bool:
        """Whether this heartbeat may complete a record of progress that should not wait for the next tick of
        :meth:`watch_progress`: the round's first step (its time ends a recovery) or a phase's start or end.

        Cheap for every heartbeat: the members still to report a first step are kept as a set.
        """
        node = self._nodes.get(info.node_id)
        if node is not None and node.phase_changed:
            node.phase_changed = False
            return True
        rdzv = self._state().rdzv
        if not rdzv.active or self._progress_round == rdzv.round or info.step is None or info.round != rdzv.round:
            return False
        if self._unstepped_round != rdzv.round:
            self._unstepped_round = rdzv.round
            self._unstepped = {m for m in rdzv.members if not self._stepped(m, rdzv.round)}
        self._unstepped.discard(info.node_id)
        return not self._unstepped

    def _stepped(self, node_id: str, round_: int) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.round == round_ and node.step is not None

    def telemetry(self) -> dict[str, NodeTelemetry]:
        """node id -> what its last heartbeat said (for plugins: stragglers, resources).

        Each node's record is made when its heartbeat arrives, not here: plugins ask every second, and at
        10,000 nodes making them all at each ask cost more than the heartbeats themselves."""
        return {node_id: node.telemetry for node_id, node in self._nodes.items() if node.telemetry is not None}

    async def commands(self, node_id: str, incarnation: int) -> AsyncIterator[AgentCommand]:
        if not self._check(node_id, incarnation):
            raise InvalidRequest(f"node {node_id} incarnation {incarnation} is not a live node of job {self.job!r}")
        node = self._node(node_id, incarnation)
        if node.last is not None and node.queue.empty():  # a reconnecting agent gets the command in force again
            yield node.last
        while True:
            command = await node.queue.get()
            yield command
            if isinstance(command, StopNodeCmd):
                return

    async def report_failure(self, report: AgentReport[WorkerFailed]) -> None:
        """Record a worker's failure once: the same failure reported again (the agent retried because the reply
        was lost or slow) is acknowledged without a second record.

        A failure is known by (node, incarnation, round, rank). This master remembers the ones it recorded, and
        the ones it is recording (a retry waits for the first report's record, and records it itself if that
        one failed); a master that took over finds the round's first failure, the one its decision is about, in
        the job state (``last_failure``).
        """
        failure = report.event
        if not self._check(report.node_id, report.incarnation):
            raise InvalidRequest(f"node {report.node_id} incarnation {report.incarnation} is not a live node")
        key = (failure.node_id, report.incarnation, failure.round, failure.rank)
        while (recording := self._failures.get(key)) is not None:
            if await asyncio.shield(recording):
                log.info("worker_failure_repeated", node=failure.node_id, rank=failure.rank, round=failure.round)
                return
            # the first report of it could not be recorded: this one tries
        last = self._state().last_failure
        if last is not None and (last.node_id, last.round, last.rank) == (failure.node_id, failure.round, failure.rank):
            log.info("worker_failure_repeated", node=failure.node_id, rank=failure.rank, round=failure.round)
            return  # (the live-node check above ties it to this incarnation: a relaunched node joins a later round)
        self._forget_failures_before(failure.round - 1)
        recorded = self._failures[key] = asyncio.get_running_loop().create_future()
        log.warning("worker_failed", node=failure.node_id, rank=failure.rank, local_rank=failure.local_rank,
                    exit_code=failure.exit_code, signal=failure.signal, round=failure.round)
        # recorded (True) or not (False) once the reactor has written it or failed to: not when the caller goes
        # away (its RPC deadline passed while the store was slow), for the append may still fail after that
        submitting = asyncio.ensure_future(self._submit(failure))

        def settle(done: asyncio.Task[Record]) -> None:
            ok = not done.cancelled() and done.exception() is None
            if not ok and self._failures.get(key) is recorded:
                del self._failures[key]  # the retry of this report records it
            recorded.set_result(ok)

        submitting.add_done_callback(settle)
        await asyncio.shield(submitting)

    def _forget_failures_before(self, round_: int) -> None:
        """Drop what this master remembers of the failures of rounds before ``round_`` (whose retries are long
        over): the memory holds about two rounds' failures."""
        if round_ <= self._failures_from:
            return
        self._failures_from = round_
        for key in [k for k, recording in self._failures.items() if k[2] < round_ and recording.done()]:
            del self._failures[key]

    async def report_workers(self, report: AgentReport[WorkersStarted | WorkersSucceeded]) -> None:
        if not self._check(report.node_id, report.incarnation):
            raise InvalidRequest(f"node {report.node_id} incarnation {report.incarnation} is not a live node")
        node = self._node(report.node_id, report.incarnation)
        if isinstance(report.event, WorkersStarted):
            node.round, node.step = report.event.round, None
        await self._submit(report.event)

    async def report_stacks(self, report: AgentReport[StacksDumped]) -> None:
        if not self._check(report.node_id, report.incarnation):
            raise InvalidRequest(f"node {report.node_id} incarnation {report.incarnation} is not a live node of job "
                                 f"{self.job!r}; this agent is stale and should exit")
        await self._submit(report.event)

    async def report_health(self, report: AgentReport[NodeHealthReported]) -> None:
        if not self._check(report.node_id, report.incarnation):
            raise InvalidRequest(f"node {report.node_id} incarnation {report.incarnation} is not a live node of job "
                                 f"{self.job!r}; this agent is stale and should exit")
        health = report.event
        log.info("node_health", node=health.node_id, check=health.check, matmul_s=health.matmul_s,
                 collectives=[(c.peer, c.seconds, c.error) for c in health.collectives], error=health.error)
        await self._submit(health)

    # -- effects -----------------------------------------------------------------

    def send(self, effect: StartWorkers | StopWorkers | StopNode | DumpStacks | CheckHealth, *,
             store_addr: tuple[str, int] | None = None) -> None:
        """Queue the command an effect stands for on its node's stream.

        ``store_addr`` is the TCPStore the round's workers (or a health check's nodes) rendezvous in (default:
        the latest).
        """
        node = self._node(effect.node_id, effect.incarnation)
        command: AgentCommand
        match effect:
            case StartWorkers():
                host, port = store_addr or self._store_addr()
                command = StartWorkersCmd(
                    id=effect.id, round=effect.round, node_rank=effect.node_rank, nnodes=effect.nnodes,
                    nproc_per_node=effect.nproc_per_node, world_size=effect.world_size,
                    restart_count=effect.restart_count, master_addr=host, master_port=port,
                )
            case StopWorkers():
                command = StopWorkersCmd(id=effect.id, round=effect.round, reason=effect.reason)
            case StopNode():
                command = StopNodeCmd(id=effect.id, reason=effect.reason)
            case DumpStacks():  # a one-off: not the command in force a reconnecting agent is given again
                node.queue.put_nowait(DumpStacksCmd(id=effect.id, round=effect.round, reason=effect.reason))
                return
            case CheckHealth():  # a one-off too: its report reaches whichever master runs by then
                host, port = store_addr or self._store_addr()
                node.queue.put_nowait(CheckHealthCmd(id=effect.id, check=effect.check, nodes=effect.nodes,
                                                     store_host=host, store_port=port, timeout_s=effect.timeout_s))
                return
        node.last = command
        node.queue.put_nowait(command)

    def resend_round(self, state: JobState, *, store_addr: tuple[str, int]) -> None:
        """After a takeover: queue the running round's start command for each member that has not reported its
        workers started (a duplicate is harmless: an agent whose workers run that round says so again)."""
        rdzv, spec = state.rdzv, state.spec
        if not rdzv.active or spec is None:
            return
        for rank, member in enumerate(rdzv.members):
            node = state.nodes.get(member)
            if member in rdzv.started or node is None or node.phase is not NodePhase.JOINED:
                continue
            log.info("round_command_resent", node=member, round=rdzv.round)
            self.send(StartWorkers(node_id=member, incarnation=node.incarnation, round=rdzv.round, node_rank=rank,
                                   nnodes=len(rdzv.members), nproc_per_node=spec.nproc_per_node,
                                   restart_count=state.restarts), store_addr=store_addr)

    # -- monitoring ----------------------------------------------------------------

    async def watch_heartbeats(self) -> None:
        """Declare a joined node lost when it has been silent for ``heartbeat_timeout_s``.

        It looks every heartbeat interval, and at least every ``_WATCH_MAX_S``: a node is declared lost within
        that much of its timeout, whatever the interval (a scan of 10,000 nodes takes a few milliseconds).
        """
        for node_id, state in self._state().nodes.items():  # after a master restart: everyone gets a full timeout
            self._node(node_id, state.incarnation).seen = self._clock()
        period = min(self.settings.heartbeat_interval_s, _WATCH_MAX_S)
        lags: collections.deque[tuple[float, float]] = collections.deque()
        while True:
            before = self._clock()
            await asyncio.sleep(period)
            now = self._clock()
            # a master too busy to read its heartbeats (a round of thousands of nodes starting) must not blame the
            # nodes: its own lateness over the last timeout is added to every node's allowance
            lags.append((now, max(0.0, now - before - period)))
            while lags[0][0] < now - self.settings.heartbeat_timeout_s:
                lags.popleft()
            self.lag_s = max(lag for at, lag in lags if at >= now - _SHED_WINDOW_S)
            allowance = self.settings.heartbeat_timeout_s + max(lag for _, lag in lags)
            if self._state().phase.terminal:
                continue  # the job ended: its nodes stop (and go quiet) within shutdown_grace_s, not lost
            # one cheap pass over the hub's own records; the job state is looked at for the few that are late
            late = [node_id for node_id, node in self._nodes.items() if now - node.seen > allowance]
            nodes = self._state().nodes
            for node_id in late:
                known = nodes.get(node_id)
                if known is None or known.phase is not NodePhase.JOINED:
                    continue
                node = self._node(node_id, known.incarnation)  # a newer incarnation starts with a full timeout
                silent = now - node.seen
                if silent > allowance:
                    node.seen = now  # report once per timeout
                    log.warning("node_silent", node=node_id, incarnation=known.incarnation, silent_s=round(silent, 1))
                    await self._submit(NodeLost(
                        node_id=node_id, incarnation=known.incarnation,
                        reason=f"no heartbeat for {self.settings.heartbeat_timeout_s:g} s",
                    ))

    async def watch_progress(self) -> None:
        """Record the round's step progress every ``progress_interval_s`` (once per interval, not per heartbeat)."""
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            await self._maybe_progress()

    async def _maybe_progress(self) -> None:
        state = self._state()
        rdzv = state.rdzv
        if not rdzv.active or not rdzv.members:
            return
        steps = []
        for member in rdzv.members:
            node = self._nodes.get(member)
            if node is None or node.round != rdzv.round or node.step is None:
                return
            steps.append(node.step)
        step = min(steps)
        phase = next((p for m in rdzv.members if (p := self._nodes[m].phase)), "")
        first = self._progress_round != rdzv.round
        now = self._clock()
        if not first and phase == self._progress_phase:  # a phase's start and end are recorded at once
            if self._progress_step is not None and step <= self._progress_step:
                return
            if now - self._progress_at < _PROGRESS_SLACK * self.settings.progress_interval_s:
                return
        self._progress_round, self._progress_step, self._progress_at = rdzv.round, step, now
        self._progress_phase = phase
        await self._submit(StepProgress(round=rdzv.round, step=step, phase=phase))
