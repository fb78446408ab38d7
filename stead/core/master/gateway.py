"""The master's side of the agent protocol (:class:`~stead.core.rpc.backend.AgentBackend`): the calls come in here.

The gateway takes agent calls in and hands each to the part of the master that does
its job: every call passes the one liveness check (:mod:`.liveness`, which also
watches heartbeat deadlines and sheds load); a registration is recorded as
NodeJoined; a heartbeat is no event, only what it changes is recorded (its
acknowledgements by :mod:`.command_streams`, its steps by :mod:`.step_progress`,
what it says of the node's resources kept here for plugins); a command stream is
:mod:`.command_streams`'s; a report arrives as the event it reports (WorkerFailed,
...) and is recorded once its node incarnation is known live, a worker failure only
once however often its agent retries, a node's report of a warning (``job.warned``)
once per warning.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing

import structlog

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings
from stead.core.events import (
    MAX_NUMERICS_RECORDS,
    MAX_WARNED_RECORDS,
    Event,
    JobWarned,
    NodeHealthReported,
    NodeJoined,
    NumericsReported,
    Record,
    StacksDumped,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
    same_warning,
)
from stead.core.master.command_streams import CommandStreams
from stead.core.master.liveness import Liveness
from stead.core.master.step_progress import ProgressRecorder
from stead.core.plugins import NodeTelemetry
from stead.core.rpc.backend import AgentCommand, AgentReport, HeartbeatInfo, RegisterInfo, RegisterResult
from stead.core.statemachine import JobState, NodePhase

__all__ = ["SKIP_REPORTS_PER_NODE_STEP", "AgentGateway"]

log = structlog.get_logger("stead.gateway")
#: reports of step_skipped notes a job may record past MAX_NUMERICS_RECORDS, per step decided to skip and node: one in
#: the round that skips the step, one in a round that rolls back before it and skips it again
SKIP_REPORTS_PER_NODE_STEP = 2


class AgentGateway:
    """The agents' calls in; its parts (:attr:`liveness`, :attr:`command_streams`, :attr:`progress`) do the rest."""

    def __init__(
        self,
        *,
        job: str,
        settings: Settings,
        submit: Callable[[Event], Awaitable[Record]],
        get_state: Callable[[], JobState],
        store_addr: Callable[[], tuple[str, int]],
        round_store: Callable[[int], Awaitable[tuple[str, int]]] | None = None,
        clock: Clock = WALL_CLOCK,
    ) -> None:
        """``store_addr``: the newest round's rendezvous store (told to registering agents); ``round_store(r)``:
        round ``r``'s, for a start command resent from the job state (default: the newest); ``clock``: the
        master's, which the heartbeat watcher and the progress recorder wait on."""
        self.job = job
        self.settings = settings
        self._submit = submit
        self._state = get_state
        self._store_addr = store_addr
        #: which node incarnations are live, the heartbeat watcher (a task), load shedding
        self.liveness = Liveness(job=job, settings=settings, submit=submit, get_state=get_state, clock=clock)
        #: the nodes' command streams (the executor queues on them) and their acknowledgements (a task records them)
        self.command_streams = CommandStreams(job=job, submit=submit, get_state=get_state, store_addr=store_addr,
                                              round_store=round_store)
        #: the round's step progress (a task records it every progress interval)
        self.progress = ProgressRecorder(settings=settings, submit=submit, get_state=get_state, clock=clock)
        #: numerical notes dropped past the job's bound (:meth:`report_numerics`), since this master started
        self._numerics_dropped = 0
        #: node id -> what its last heartbeat said, for plugins
        self._telemetry: dict[str, NodeTelemetry] = {}
        #: the worker failures this master recorded or is recording, by (node, incarnation, round, rank): done
        #: True once on record, False if recording failed (a retry then records it)
        self._failures: dict[tuple[str, int, int, int], asyncio.Future[bool]] = {}
        #: the rounds before this one are forgotten from ``_failures``
        self._failures_from = 0
        #: the nodes' reports of warnings this master recorded or is recording (at most MAX_WARNED_RECORDS)
        self._warned: list[JobWarned] = []

    async def register(self, info: RegisterInfo) -> RegisterResult:
        self.liveness.require_live(info.node_id, info.incarnation)
        joining = self._state().nodes[info.node_id].phase is not NodePhase.JOINED
        if joining:  # a join is an event; an agent registering again (a new master, a lost reply) is not, and is
            self.liveness.shed_if_late()  # never refused: the master counts it as joined and waits for its heartbeats
        self.liveness.heard(info.node_id, info.incarnation)
        telemetry = self._telemetry.get(info.node_id)
        if telemetry is not None and telemetry.incarnation != info.incarnation:
            del self._telemetry[info.node_id]  # a new incarnation has said nothing yet
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

    async def heartbeat(self, info: HeartbeatInfo) -> bool:
        known = self._beat(info)
        if known and self.progress.heard(info):
            await self.progress.record()
        return known

    async def heartbeats(self, beats: Sequence[HeartbeatInfo]) -> list[str]:
        unknown, due = [], False
        for info in beats:
            if self._beat(info):  # every beat is looked at: it may be a member's first step
                due = self.progress.heard(info) or due
            else:
                unknown.append(info.node_id)
        if due:
            await self.progress.record()
        return unknown

    def _beat(self, info: HeartbeatInfo) -> bool:
        """Take one heartbeat in (no event: only what it changes is recorded); False for an unknown node."""
        if not self.liveness.is_live(info.node_id, info.incarnation):
            return False
        seen = self.liveness.heard(info.node_id, info.incarnation)
        if info.acked:
            self.command_streams.take_acks(info.node_id, info.incarnation, info.acked)
        self._telemetry[info.node_id] = NodeTelemetry(
            incarnation=info.incarnation, round=info.round, step=info.step, step_compute_s=info.step_compute_s,
            rss_bytes=info.rss_bytes, cpu_percent=info.cpu_percent, seen=seen, gpu_memory_bytes=info.gpu_memory_bytes,
            gpu_util_percent=info.gpu_util_percent)
        return True

    def telemetry(self) -> dict[str, NodeTelemetry]:
        """node id -> what its last heartbeat said (for plugins: stragglers, resources).

        Each node's record is made when its heartbeat arrives, not here: plugins ask every second, and at
        10,000 nodes making them all at each ask cost more than the heartbeats themselves."""
        return dict(self._telemetry)

    async def commands(self, node_id: str, incarnation: int) -> AsyncIterator[AgentCommand]:
        """The node's command stream (:meth:`CommandStreams.stream`), once its incarnation is known live."""
        self.liveness.require_live(node_id, incarnation)
        async with aclosing(self.command_streams.stream(node_id, incarnation)) as stream:
            async for command in stream:
                yield command

    async def report_failure(self, report: AgentReport[WorkerFailed]) -> None:
        """Record a worker's failure once: the same failure reported again (the agent retried because the reply
        was lost or slow) is acknowledged without a second record.

        A failure is known by (node, incarnation, round, rank). This master remembers the ones it recorded, and
        the ones it is recording (a retry waits for the first report's record, and records it itself if that
        one failed); a master that took over finds the round's first failure, the one its decision is about, in
        the job state (``last_failure``).
        """
        failure = report.event
        self.liveness.require_live(report.node_id, report.incarnation)
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
        self.liveness.require_live(report.node_id, report.incarnation)
        if isinstance(report.event, WorkersStarted):
            self.progress.workers_started(report.node_id, report.incarnation, report.event.round)
        else:  # the node's last heartbeat said its final step: on record before its end, whatever the interval
            await self.progress.record(final=True)
        await self._submit(report.event)

    async def report_stacks(self, report: AgentReport[StacksDumped]) -> None:
        self.liveness.require_live(report.node_id, report.incarnation)
        await self._submit(report.event)

    async def report_numerics(self, report: AgentReport[NumericsReported]) -> None:
        """Record a node's numerical notes, up to :data:`MAX_NUMERICS_RECORDS` reports a job (a flood of loss spikes
        must not flood the store): past that, the notes are counted in the log and dropped.

        A report of nothing but step_skipped notes of steps the master decided to skip may go past that bound by
        :data:`SKIP_REPORTS_PER_NODE_STEP` reports per decided step and node of the job's largest size: every rank
        says what its skipped step held (one report a node), so a job of more nodes than the bound would otherwise
        lose most of one skip's notes, and the samples they name would not be recorded as skipped."""
        self.liveness.require_live(report.node_id, report.incarnation)
        event = report.event
        state = self._state()
        recorded = state.numerics_reports
        bound = MAX_NUMERICS_RECORDS
        if event.notes and not event.dropped and all(
                note.kind == "step_skipped" and note.step in state.skip_steps for note in event.notes):
            nodes = state.spec.max_nodes if state.spec is not None else 1
            bound += len(state.skip_steps) * nodes * SKIP_REPORTS_PER_NODE_STEP
        if recorded >= bound:
            self._numerics_dropped += len(event.notes) + event.dropped
            log.warning("numerics_notes_dropped", node=event.node_id, notes=len(event.notes),
                        dropped_so_far=self._numerics_dropped,
                        reason=f"the job recorded {recorded} reports of numerical notes, its bound")
            return
        for note in event.notes:
            log.warning("numerics_note", node=event.node_id, round=event.round, kind=note.kind, rank=note.rank,
                        step=note.step, loss=note.loss, median=note.median, score=note.score, action=note.action)
        await self._submit(event)

    async def report_health(self, report: AgentReport[NodeHealthReported]) -> None:
        self.liveness.require_live(report.node_id, report.incarnation)
        health = report.event
        log.info("node_health", node=health.node_id, check=health.check, matmul_s=health.matmul_s,
                 collectives=[(c.peer, c.seconds, c.error) for c in health.collectives], error=health.error)
        await self._submit(health)

    async def report_warned(self, report: AgentReport[JobWarned]) -> None:
        """Record a node's report of a warning (Slurm's, before a time limit) once, with the newest committed step
        (the one its agent persists), up to :data:`MAX_WARNED_RECORDS` reports: the same node's report of the same
        warning again (its agent retried: the reply was lost or slow) is acknowledged and not recorded again, and
        one past the bound is logged and dropped.

        This master knows the reports it recorded; one that took over from another may record a retry of a report
        its predecessor recorded, which the readers of the log count once (:func:`group_warnings` by node)."""
        self.liveness.require_live(report.node_id, report.incarnation)
        event = report.event
        if any(seen.node_id == event.node_id and same_warning(seen, event) for seen in self._warned):
            log.info("job_warned_repeated", node=event.node_id, source=event.source, warned_at=event.warned_at)
            return
        if len(self._warned) >= MAX_WARNED_RECORDS:
            log.warning("job_warned_dropped", node=event.node_id, source=event.source, said=event.said,
                        reason=f"this master recorded {len(self._warned)} nodes' warnings, its bound")
            return
        event = dataclasses.replace(event, committed_step=self._state().checkpoint_step)
        self._warned.append(event)
        log.warning("job_warned", node=event.node_id, source=event.source, signal=event.signal,
                    time_left_s=event.time_left_s, deadline=event.deadline, committed_step=event.committed_step)
        try:
            await self._submit(event)
        except BaseException:
            self._warned.remove(event)  # not on record: the agent's retry records it
            raise
