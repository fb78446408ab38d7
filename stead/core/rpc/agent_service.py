"""The AgentService servicer: validates each request, then delegates to an AgentBackend.

A request with a bad field is answered INVALID_ARGUMENT with a message that
names the field and says what to send; the backend only sees valid requests,
as plain dataclasses, and an agent's report as the event it reports (see
:mod:`~stead.core.rpc.backend`). Counts are checked for every request before it
is decoded (:mod:`._wire`), strings' lengths and floats' finiteness as it is
decoded (:mod:`._checks`); what each field means is checked here.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator

import grpclib.const
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from stead.core.events import MAX_NOTES_PER_REPORT, NOTE_KINDS, WARNING_SOURCES
from stead.core.rpc._checks import MAX_NODE_ID_CHARS, check_name
from stead.core.rpc._proto.stead.v1 import (
    Ack,
    AgentServiceBase,
    Command,
    CommandsRequest,
    FailureReport,
    HealthReport,
    HeartbeatBatch,
    HeartbeatBatchReply,
    HeartbeatReply,
    HeartbeatRequest,
    NumericsReport,
    RegisterReply,
    RegisterRequest,
    StacksReport,
    WarnedReport,
    WorkersReport,
)
from stead.core.rpc._proto.stead.v1 import NumericsNote as ProtoNumericsNote
from stead.core.rpc._status import at_least, backend_errors, finite_figure, invalid
from stead.core.rpc.backend import HEARTBEAT_STREAM_ROUTE, MAX_ACKS_PER_BEAT, MAX_NODE_WORKERS, AgentBackend
from stead.core.rpc.convert import (
    NO_STEP,
    command_to_proto,
    failure_from_proto,
    health_from_proto,
    heartbeat_from_proto,
    numerics_from_proto,
    register_from_proto,
    register_reply_to_proto,
    stacks_from_proto,
    warned_from_proto,
    workers_from_proto,
)

__all__ = ["AgentServicer", "check_node_id"]

_COMMANDS_ROUTE = "/stead.v1.AgentService/Commands"


def check_node_id(where: str, node_id: str) -> None:
    """INVALID_ARGUMENT unless ``node_id`` is a name (see :func:`~._checks.name_problem`) of at most 253
    characters."""
    check_name(where, node_id, max_chars=MAX_NODE_ID_CHARS, what="the node's id (the one the agent was started with)")


def _check_node(where: str, node_id: str, incarnation: int) -> None:
    check_node_id(f"{where}.node_id", node_id)
    if incarnation < 1:
        invalid(f"{where}.incarnation is {incarnation}: incarnations start at 1; pass the node's launch count")


def _at_least(where: str, field: str, value: int | None, minimum: int, meaning: str) -> None:
    at_least(f"{where}.{field}", value, minimum, meaning)


def _finite_figure(where: str, field: str, value: float | None, unit: str) -> None:
    finite_figure(f"{where}.{field}", value, unit)


#: a signal's name, as a warned agent reports it
_SIGNAL_NAME = re.compile(r"SIG[A-Z0-9+-]{1,12}")
#: the longest dataset name a note's samples name (the sharding plugin's bound)
_MAX_DATASET_CHARS = 200


def _check_samples(where: str, note: ProtoNumericsNote) -> None:
    """A note's samples (their counts bounded on the wire already): named datasets, ranges of slots."""
    if note.samples and (note.kind != "step_skipped" or not note.samples_known):
        invalid(f"{where}.samples: only a step_skipped note with samples_known names samples")
    for j, part in enumerate(note.samples):
        if not 0 < len(part.dataset) <= _MAX_DATASET_CHARS:
            invalid(f"{where}.samples[{j}].dataset is {part.dataset[:40]!r}: a name of 1 to {_MAX_DATASET_CHARS} "
                    "characters")
        _at_least(where, f"samples[{j}].count", part.count, 0, "a count of samples")
        named = 0
        for k, piece in enumerate(part.ranges):
            if piece.part < 0 or not 0 <= piece.start < piece.end:
                invalid(f"{where}.samples[{j}].ranges[{k}] is part {piece.part} slots {piece.start}-{piece.end}: "
                        "part >= 0 and 0 <= start < end")
            named += piece.end - piece.start
        if named > part.count:
            invalid(f"{where}.samples[{j}] names {named} samples in its ranges, more than its count {part.count}")


def _check_heartbeat(where: str, message: HeartbeatRequest) -> None:
    _check_node(where, message.node_id, message.incarnation)
    _at_least(where, "round", message.round, 0, "rendezvous rounds count from 0")
    _at_least(where, "step", message.step, NO_STEP, f"a training step, or {NO_STEP} before the first one")
    _at_least(where, "workers_alive", message.workers_alive, 0, "a count of processes")
    memory = "a memory size; leave it unset when unknown"
    _at_least(where, "rss_bytes", message.rss_bytes, 0, memory)
    _at_least(where, "gpu_memory_bytes", message.gpu_memory_bytes, 0, memory)
    _finite_figure(where, "cpu_percent", message.cpu_percent, "percentage")
    _finite_figure(where, "gpu_util_percent", message.gpu_util_percent, "percentage")
    _finite_figure(where, "step_compute_s", message.step_compute_s, "number of seconds")
    if len(message.acked) > MAX_ACKS_PER_BEAT:
        invalid(f"{where}.acked holds {len(message.acked)} command ids: send at most {MAX_ACKS_PER_BEAT} a heartbeat "
                "and the rest with the next ones")


class AgentServicer(AgentServiceBase):
    """Serves AgentService on behalf of ``backend``."""

    def __init__(self, backend: AgentBackend) -> None:
        self._backend = backend

    async def register(self, message: RegisterRequest) -> RegisterReply:
        where = "RegisterRequest"
        _check_node(where, message.node_id, message.incarnation)
        if not message.host:
            invalid(f"{where}.host is empty: pass the host name or address the agent runs on")
        if not message.host.isascii() or not message.host.isprintable():
            invalid(f"{where}.host {message.host[:64]!r} is not a host name: pass the agent's host name or address, "
                    "in printable ASCII characters")
        _at_least(where, "pid", message.pid, 1, "the agent's process id")
        _at_least(where, "nproc", message.nproc, 1, "the number of worker processes on the node")
        if message.nproc > MAX_NODE_WORKERS:
            invalid(f"{where}.nproc is {message.nproc}: a node runs at most {MAX_NODE_WORKERS} workers")
        with backend_errors("AgentService.Register"):
            result = await self._backend.register(register_from_proto(message))
        return register_reply_to_proto(result)

    async def heartbeat(self, message: HeartbeatRequest) -> HeartbeatReply:
        _check_heartbeat("HeartbeatRequest", message)
        with backend_errors("AgentService.Heartbeat"):
            known = await self._backend.heartbeat(heartbeat_from_proto(message))
        return HeartbeatReply(known=known)

    async def heartbeats(self, message: HeartbeatBatch) -> HeartbeatBatchReply:
        for i, beat in enumerate(message.beats):
            _check_heartbeat(f"HeartbeatBatch.beats[{i}]", beat)
        with backend_errors("AgentService.Heartbeats"):
            unknown = await self._backend.heartbeats([heartbeat_from_proto(beat) for beat in message.beats])
        return HeartbeatBatchReply(unknown=list(unknown))

    async def commands(self, message: CommandsRequest) -> AsyncGenerator[Command, None]:
        _check_node("CommandsRequest", message.node_id, message.incarnation)
        with backend_errors("AgentService.Commands"):
            commands = self._backend.commands(message.node_id, message.incarnation)
        try:
            with backend_errors("AgentService.Commands"):
                async for command in commands:
                    yield command_to_proto(command)
        finally:
            # The backend may hold a subscription for this node: release it now, not when collected.
            aclose = getattr(commands, "aclose", None)
            if aclose is not None:
                await aclose()

    async def report_failure(self, message: FailureReport) -> Ack:
        where = "FailureReport"
        _check_node(where, message.node_id, message.incarnation)
        _at_least(where, "round", message.round, 0, "rendezvous rounds count from 0")
        _at_least(where, "local_rank", message.local_rank, 0, "ranks count from 0")
        _at_least(where, "rank", message.rank, 0, "ranks count from 0")
        _at_least(where, "signal", message.signal, 1, "a signal number; leave it unset when none")
        _at_least(where, "step", message.step, 0, "a training step; leave it unset when none")
        _finite_figure(where, "exited_at", message.exited_at, "time in seconds since the epoch")
        for i, rank in enumerate(message.exited_ok_ranks):
            _at_least(where, f"exited_ok_ranks[{i}]", rank, 0, "ranks count from 0")
        with backend_errors("AgentService.ReportFailure"):
            await self._backend.report_failure(failure_from_proto(message))
        return Ack()

    async def report_workers(self, message: WorkersReport) -> Ack:
        where = "WorkersReport"
        _check_node(where, message.node_id, message.incarnation)
        _at_least(where, "round", message.round, 0, "rendezvous rounds count from 0")
        report = workers_from_proto(message)
        if report is None:
            invalid(f"{where}.state is {message.state!r}: send WORKERS_STATE_STARTED or WORKERS_STATE_SUCCEEDED")
        with backend_errors("AgentService.ReportWorkers"):
            await self._backend.report_workers(report)
        return Ack()

    async def report_stacks(self, message: StacksReport) -> Ack:
        where = "StacksReport"
        _check_node(where, message.node_id, message.incarnation)
        _at_least(where, "round", message.round, 0, "rendezvous rounds count from 0")
        for i, worker in enumerate(message.workers):
            _at_least(where, f"workers[{i}].local_rank", worker.local_rank, 0, "ranks count from 0")
            _at_least(where, f"workers[{i}].rank", worker.rank, 0, "ranks count from 0")
            _at_least(where, f"workers[{i}].step", worker.step, 0, "a training step; leave it unset when none")
        with backend_errors("AgentService.ReportStacks"):
            await self._backend.report_stacks(stacks_from_proto(message))
        return Ack()

    async def report_health(self, message: HealthReport) -> Ack:
        where = "HealthReport"
        _check_node(where, message.node_id, message.incarnation)
        _at_least(where, "check", message.check, 1, "health checks count from 1")
        for name, value in [("matmul_s", message.matmul_s), ("seconds", message.seconds),
                            *((f"collectives[{i}].seconds", c.seconds) for i, c in enumerate(message.collectives))]:
            _finite_figure(where, name, value, "number of seconds")
        for i, c in enumerate(message.collectives):
            check_node_id(f"{where}.collectives[{i}].peer", c.peer)
        with backend_errors("AgentService.ReportHealth"):
            await self._backend.report_health(health_from_proto(message))
        return Ack()

    async def report_numerics(self, message: NumericsReport) -> Ack:
        where = "NumericsReport"
        _check_node(where, message.node_id, message.incarnation)
        _at_least(where, "round", message.round, 0, "rendezvous rounds count from 0")
        _at_least(where, "dropped", message.dropped, 0, "a count of notes")
        if len(message.notes) > MAX_NOTES_PER_REPORT:
            invalid(f"{where}.notes holds {len(message.notes)} notes: send at most {MAX_NOTES_PER_REPORT} a report and "
                    "the rest with the next ones")
        for i, note in enumerate(message.notes):
            if note.kind not in NOTE_KINDS:
                invalid(f"{where}.notes[{i}].kind is {note.kind[:40]!r}: one of {', '.join(NOTE_KINDS)}")
            _at_least(where, f"notes[{i}].rank", note.rank, 0, "ranks count from 0")
            _at_least(where, f"notes[{i}].step", note.step, 0, "steps count from 0")
            for name in ("loss", "median", "score"):
                _finite_figure(where, f"notes[{i}].{name}", getattr(note, name), "number (unset when not finite)")
            if note.action not in ("", "record", "skip"):
                invalid(f"{where}.notes[{i}].action is {note.action[:40]!r}: record, skip, or empty")
            _check_samples(f"{where}.notes[{i}]", note)
        with backend_errors("AgentService.ReportNumerics"):
            await self._backend.report_numerics(numerics_from_proto(message))
        return Ack()

    async def report_warned(self, message: WarnedReport) -> Ack:
        where = "WarnedReport"
        _check_node(where, message.node_id, message.incarnation)
        _at_least(where, "round", message.round, 0, "rendezvous rounds count from 0")
        if not _SIGNAL_NAME.fullmatch(message.signal):
            invalid(f"{where}.signal is {message.signal[:40]!r}: the signal's name, e.g. SIGUSR1")
        if message.source not in WARNING_SOURCES:
            invalid(f"{where}.source is {message.source[:40]!r}: who sent the warning, one of "
                    f"{', '.join(WARNING_SOURCES)}")
        if not message.warned_at > 0:
            invalid(f"{where}.warned_at is {message.warned_at!r}: when the agent got the signal, in seconds since the "
                    "epoch (> 0)")
        _at_least(where, "time_left_s", message.time_left_s, 0, "a number of seconds; leave it unset when not said")
        _at_least(where, "persisted_step", message.persisted_step, 0, "a training step; leave it unset when none")
        with backend_errors("AgentService.ReportWarned"):
            await self._backend.report_warned(warned_from_proto(message))
        return Ack()

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        mapping = super().__mapping__()
        for route, serve in ((_COMMANDS_ROUTE, self._serve_commands), (HEARTBEAT_STREAM_ROUTE, self._serve_beats)):
            generated = mapping[route]
            mapping[route] = grpclib.const.Handler(serve, generated.cardinality, generated.request_type,
                                                   generated.reply_type)
        return mapping

    async def _serve_beats(self, stream: Stream[HeartbeatRequest, HeartbeatReply]) -> None:
        """One agent's heartbeats, a reply to each, until the agent ends the call: a bad heartbeat is answered
        with its error and the call stays open (one refused as it was decoded too: its bytes were read); a
        master that cannot serve one, or one over the message limit, ends the call."""
        while True:
            try:
                message = await stream.recv_message()
                if message is None:
                    return
                _check_heartbeat("HeartbeatRequest", message)
                with backend_errors("AgentService.HeartbeatStream"):
                    reply = HeartbeatReply(known=await self._backend.heartbeat(heartbeat_from_proto(message)))
            except GRPCError as exc:
                if exc.status != Status.INVALID_ARGUMENT:
                    raise  # the master cannot serve it now: the call ends, the agent opens another
                reply = HeartbeatReply(known=False, error=exc.message or "invalid heartbeat")  # said, stream kept
            await stream.send_message(reply)

    async def _serve_commands(self, stream: Stream[CommandsRequest, Command]) -> None:
        # Unlike the generated handler, close the command generator (and so the backend's
        # iterator) as soon as the stream ends, even when it ends while sending.
        request = await stream.recv_message()
        if request is None:
            invalid("CommandsRequest is missing: send one CommandsRequest message")
        commands = self.commands(request)
        try:
            async for command in commands:
                await stream.send_message(command)
        finally:
            await commands.aclose()

    def __repr__(self) -> str:
        return f"AgentServicer({self._backend!r})"

