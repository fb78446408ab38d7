"""The master's side of the agent protocol: registration, heartbeats, commands.

The gateway turns agent calls into events (a registration into NodeJoined; a report
arrives as the event it reports, WorkerFailed, ..., recorded once its node
incarnation is known live), keeps one ordered command queue per node
incarnation, watches heartbeats to declare silent nodes lost, and aggregates
step progress into StepProgress events. Heartbeats
themselves are not events: only what they change is recorded.

A command is done when its agent acknowledged it, not when it is queued here: the
job state keeps each node's command in force until then (see
:mod:`stead.core.statemachine.commands`), and every command stream an agent opens,
to this master or to one that took over, starts with that command. Agents
acknowledge on their heartbeats; the gateway records the acknowledgements of many
nodes in one ``CommandsAcked`` event (:meth:`AgentGateway.record_acks`), not one store
write each.
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
from stead.core.errors import InvalidRequest, Overloaded, RpcUnavailable, StoreError
from stead.core.events import (
    CommandAck,
    CommandsAcked,
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
    AgentOrder,
    CheckHealth,
    DumpStacks,
    JobState,
    NodePhase,
    StartWorkers,
    StopNode,
    StopWorkers,
    in_force,
)

__all__ = ["AgentGateway"]

log = structlog.get_logger("stead.gateway")

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
#: the most bytes of ids one CommandsAcked record carries (each ack counts its node's and its command's id and
#: _ACK_OVERHEAD_BYTES): half the smallest write a store may take (64 KiB), so a record always fits one; 300 or so
#: acks of a 10,000-node round's start
_ACK_RECORD_BYTES = 32 << 10
#: what one acknowledgement adds to a record besides its ids: its JSON keys and incarnation
_ACK_OVERHEAD_BYTES = 64


@dataclasses.dataclass
class _Node:
    incarnation: int
    queue: asyncio.Queue[AgentCommand]
    seen: float
    #: the ids of commands its agent acknowledged that are not on record yet
    acked: set[str] = dataclasses.field(default_factory=set)
    round: int = 0
    step: int | None = None
    #: a long phase one of its workers declared; "" when none
    phase: str = ""
    #: its phase changed since the progress was last looked at
    phase_changed: bool = False
    #: what its last heartbeat said (resources, its own time per step), for plugins; None before the first
    telemetry: NodeTelemetry | None = None


class AgentGateway:
    def __init__(
        self,
        *,
        job: str,
        settings: Settings,
        submit: Callable[[Event], Awaitable[Record]],
        get_state: Callable[[], JobState],
        store_addr: Callable[[], tuple[str, int]],
        round_store: Callable[[int], Awaitable[tuple[str, int]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``store_addr``: the newest round's rendezvous store (told to registering agents); ``round_store(r)``:
        round ``r``'s, for a start command resent from the job state (default: the newest)."""
        self.job = job
        self.settings = settings
        self._submit = submit
        self._state = get_state
        self._store_addr = store_addr
        self._round_store = round_store
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
        #: acknowledgements taken in and not on record yet (at most one per node: one command is in force), and
        #: set while there are some
        self._acks: list[CommandAck] = []
        self._acks_waiting = asyncio.Event()

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
        if info.acked:
            self._take_acks(info.node_id, node, info.acked)
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
        """The node's commands, starting with the one in force that its agent has not acknowledged (it may never
        have reached the agent: this stream replaces a broken one, or this master took over from one that died)."""
        if not self._check(node_id, incarnation):
            raise InvalidRequest(f"node {node_id} incarnation {incarnation} is not a live node of job {self.job!r}")
        node = self._node(node_id, incarnation)
        waiting: list[AgentCommand] = []
        while not node.queue.empty():
            waiting.append(node.queue.get_nowait())
        order = self._in_force(node_id, node)
        given = ""
        if order is not None:
            queued = next((c for c in waiting if c.id == order.id), None)
            if queued is None:
                log.info("command_resent", node=node_id, command=order.id, reason="not acknowledged")
            yield queued or await self._resent(order)
            if isinstance(order, StopNode):
                return
            given = order.id
        for command in waiting:  # the one-offs: the durable ones queued were the one in force, or superseded
            if _one_off(command):
                yield command
        while True:
            command = await node.queue.get()
            if not _one_off(command):
                order = self._in_force(node_id, node)
                if order is None or order.id != command.id or command.id == given:
                    log.debug("command_not_sent", node=node_id, command=command.id,
                              reason="superseded, acknowledged, or given on this stream already")
                    continue
                given = command.id
            yield command
            if isinstance(command, StopNodeCmd):
                return

    def _in_force(self, node_id: str, node: _Node) -> AgentOrder | None:
        """The node's command in force (:func:`~stead.core.statemachine.in_force`) unless its agent acknowledged it."""
        order = in_force(self._state(), node_id)
        if order is None or order.incarnation != node.incarnation or order.id in node.acked:
            return None
        return order

    async def _resent(self, order: AgentOrder) -> AgentCommand:
        """The command ``order`` stands for, made again from the job state (a round's start with its round's
        rendezvous store)."""
        if not isinstance(order, StartWorkers):
            return _command(order, self._store_addr())
        try:
            address = await self._round_store(order.round) if self._round_store else self._store_addr()
        except StoreError as exc:
            raise RpcUnavailable(f"the rendezvous store of round {order.round} of job {self.job!r} is not available "
                                 f"({exc}); try again in a moment") from exc
        return _command(order, address)

    def _take_acks(self, node_id: str, node: _Node, ids: Sequence[str]) -> None:
        """Take a heartbeat's acknowledgements in, to be recorded by :meth:`record_acks`; one of a command not in
        force (a one-off, superseded, acknowledged already, or unknown) is harmless and only logged."""
        order = self._in_force(node_id, node)
        for command_id in ids:
            if order is None or command_id != order.id:
                log.debug("command_ack_ignored", node=node_id, command=command_id,
                          reason="no such command awaits an acknowledgement")
                continue
            node.acked.add(command_id)
            self._acks.append(CommandAck(node_id=node_id, incarnation=node.incarnation, command_id=command_id))
            order = None
        if self._acks:
            self._acks_waiting.set()

    async def record_acks(self) -> None:
        """Record the acknowledgements taken in, as they come: all those that wait go in ``CommandsAcked`` records
        of many nodes each (a 10,000-node round's acks are a handful of store writes, not 10,000)."""
        while True:
            await self._acks_waiting.wait()
            self._acks_waiting.clear()
            while self._acks:
                batch = _first_record(self._acks)
                del self._acks[:len(batch)]
                try:
                    await self._submit(CommandsAcked(acks=tuple(batch)))
                except BaseException:  # recorded when this task runs again (the store back, say)
                    self._acks[:0] = batch
                    self._acks_waiting.set()
                    raise
                for ack in batch:
                    node = self._nodes.get(ack.node_id)
                    if node is not None:
                        node.acked.discard(ack.command_id)

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
        node.queue.put_nowait(_command(effect, store_addr or self._store_addr()))

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
            # one cheap pass over the gateway's own records; the job state is looked at for the few that are late
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


def _first_record(acks: Sequence[CommandAck]) -> list[CommandAck]:
    """As many of ``acks``, from the first, as one CommandsAcked record carries (at least one)."""
    size = 0
    for count, ack in enumerate(acks):
        size += len(ack.node_id) + len(ack.command_id) + _ACK_OVERHEAD_BYTES
        if size > _ACK_RECORD_BYTES and count:
            return list(acks[:count])
    return list(acks)


def _one_off(command: AgentCommand) -> bool:
    """Whether ``command`` is given once, on the stream open then, and never kept in force."""
    return isinstance(command, DumpStacksCmd | CheckHealthCmd)


def _command(effect: StartWorkers | StopWorkers | StopNode | DumpStacks | CheckHealth,
             store_addr: tuple[str, int]) -> AgentCommand:
    """The command an effect stands for; ``store_addr``: the rendezvous store of a start's round or a check."""
    host, port = store_addr
    match effect:
        case StartWorkers():
            return StartWorkersCmd(
                id=effect.id, round=effect.round, node_rank=effect.node_rank, nnodes=effect.nnodes,
                nproc_per_node=effect.nproc_per_node, world_size=effect.world_size,
                restart_count=effect.restart_count, master_addr=host, master_port=port,
            )
        case StopWorkers():
            return StopWorkersCmd(id=effect.id, round=effect.round, reason=effect.reason)
        case StopNode():
            return StopNodeCmd(id=effect.id, reason=effect.reason)
        case DumpStacks():  # a one-off: not kept in force (see stead.core.statemachine.commands)
            return DumpStacksCmd(id=effect.id, round=effect.round, reason=effect.reason)
        case CheckHealth():  # a one-off too: its report reaches whichever master runs by then
            return CheckHealthCmd(id=effect.id, check=effect.check, nodes=effect.nodes, store_host=host,
                                  store_port=port, timeout_s=effect.timeout_s)
