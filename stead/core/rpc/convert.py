"""Conversions between the generated protobuf messages and the backend's dataclasses and events.

Both directions live here so that the server and the client agree on them; the
server validates requests before converting them (see ``agent_service``). An
agent's report converts straight to the event it reports (see
:mod:`~stead.core.rpc.backend`): the message and the event spell their fields
the same way, so the conversion goes by name, and a field added to both crosses
without a line here. A registration, its reply and each command go by name too
(a command's id is its envelope's); a heartbeat, one per node and interval, is
written out field by field, which is quicker, with its "no step" spelled -1.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar, assert_never

import betterproto2

from stead.core.events import (
    JobWarned,
    NodeHealthReported,
    NumericsNote,
    NumericsReported,
    PeerCollective,
    RestoreBound,
    StackSample,
    StacksDumped,
    StepSamples,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.rpc._proto.stead.v1 import (
    CheckHealth,
    Command,
    DumpStacks,
    FailureReport,
    HealthReport,
    HeartbeatRequest,
    NumericsReport,
    RegisterReply,
    RegisterRequest,
    StacksReport,
    StartWorkers,
    StopNode,
    StopWorkers,
    WarnedReport,
    WorkersReport,
)
from stead.core.rpc._proto.stead.v1 import (
    NumericsNote as ProtoNumericsNote,
)
from stead.core.rpc._proto.stead.v1 import (
    PeerCollective as ProtoPeerCollective,
)
from stead.core.rpc._proto.stead.v1 import (
    RestoreBound as ProtoRestoreBound,
)
from stead.core.rpc._proto.stead.v1 import (
    SampleRange as ProtoSampleRange,
)
from stead.core.rpc._proto.stead.v1 import (
    StepSamples as ProtoStepSamples,
)
from stead.core.rpc._proto.stead.v1 import (
    WorkersState as ProtoWorkersState,
)
from stead.core.rpc._proto.stead.v1 import (
    WorkerStack as ProtoWorkerStack,
)
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

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "NO_STEP",
    "command_from_proto",
    "command_to_proto",
    "failure_from_proto",
    "failure_to_proto",
    "from_proto",
    "health_from_proto",
    "health_to_proto",
    "heartbeat_from_proto",
    "heartbeat_to_proto",
    "numerics_from_proto",
    "numerics_to_proto",
    "register_from_proto",
    "register_reply_from_proto",
    "register_reply_to_proto",
    "register_to_proto",
    "stacks_from_proto",
    "stacks_to_proto",
    "warned_from_proto",
    "warned_to_proto",
    "to_proto",
    "workers_from_proto",
    "workers_to_proto",
]

#: the wire value of "no step yet" in HeartbeatRequest.step
NO_STEP = -1


def register_to_proto(info: RegisterInfo) -> RegisterRequest:
    return to_proto(RegisterRequest, info)


def register_from_proto(message: RegisterRequest) -> RegisterInfo:
    return from_proto(RegisterInfo, message)


def register_reply_to_proto(result: RegisterResult) -> RegisterReply:
    return to_proto(RegisterReply, result)


def register_reply_from_proto(message: RegisterReply) -> RegisterResult:
    return from_proto(RegisterResult, message)


def heartbeat_to_proto(info: HeartbeatInfo) -> HeartbeatRequest:
    return HeartbeatRequest(node_id=info.node_id, incarnation=info.incarnation, round=info.round,
                            step=NO_STEP if info.step is None else info.step, workers_alive=info.workers_alive,
                            rss_bytes=info.rss_bytes, cpu_percent=info.cpu_percent, phase=info.phase,
                            step_compute_s=info.step_compute_s, gpu_memory_bytes=info.gpu_memory_bytes,
                            gpu_util_percent=info.gpu_util_percent, acked=list(info.acked))


def heartbeat_from_proto(message: HeartbeatRequest) -> HeartbeatInfo:
    return HeartbeatInfo(node_id=message.node_id, incarnation=message.incarnation, round=message.round,
                         step=None if message.step == NO_STEP else message.step,
                         workers_alive=message.workers_alive, rss_bytes=message.rss_bytes,
                         cpu_percent=message.cpu_percent, phase=message.phase,
                         step_compute_s=message.step_compute_s, gpu_memory_bytes=message.gpu_memory_bytes,
                         gpu_util_percent=message.gpu_util_percent, acked=tuple(message.acked))


def command_to_proto(command: AgentCommand) -> Command:
    match command:
        case StartWorkersCmd():
            bounds = [to_proto(ProtoRestoreBound, b) for b in command.restore_bounds]
            return Command(id=command.id, start_workers=_body(StartWorkers, command, restore_bounds=bounds))
        case StopWorkersCmd():
            return Command(id=command.id, stop_workers=_body(StopWorkers, command))
        case StopNodeCmd():
            return Command(id=command.id, stop_node=_body(StopNode, command))
        case DumpStacksCmd():
            return Command(id=command.id, dump_stacks=_body(DumpStacks, command))
        case CheckHealthCmd():
            return Command(id=command.id, check_health=_body(CheckHealth, command))
        case _:
            assert_never(command)


def command_from_proto(message: Command) -> AgentCommand | None:
    """The command, or None when its body is one this stead version does not know."""
    if (start := message.start_workers) is not None:
        bounds = tuple(from_proto(RestoreBound, b) for b in start.restore_bounds)
        return from_proto(StartWorkersCmd, start, id=message.id, restore_bounds=bounds)
    if (stop := message.stop_workers) is not None:
        return from_proto(StopWorkersCmd, stop, id=message.id)
    if (stop_node := message.stop_node) is not None:
        return from_proto(StopNodeCmd, stop_node, id=message.id)
    if (dump := message.dump_stacks) is not None:
        return from_proto(DumpStacksCmd, dump, id=message.id)
    if (check := message.check_health) is not None:
        return from_proto(CheckHealthCmd, check, id=message.id)
    return None


D = TypeVar("D", bound="DataclassInstance")
M = TypeVar("M", bound=betterproto2.Message)


def from_proto(kind: type[D], message: betterproto2.Message, **given: Any) -> D:
    """The ``kind`` (an event, or a value an event holds) whose fields are ``message``'s fields of the same names (a
    list becomes a tuple), but for those ``given`` (a nested message's values, converted by the caller)."""
    values = {field.name: _tupled(getattr(message, field.name)) for field in dataclasses.fields(kind)
              if field.name not in given}
    return kind(**values, **given)


def to_proto(kind: type[M], value: DataclassInstance, **given: Any) -> M:
    """The message of ``kind`` whose fields are ``value``'s fields of the same names (a tuple becomes a list), and
    those ``given`` (what the value does not hold, or a nested message's values, converted by the caller)."""
    values = {field.name: _listed(getattr(value, field.name)) for field in dataclasses.fields(value)
              if field.name not in given}
    return kind(**values, **given)


def _body(kind: type[M], command: AgentCommand, **given: Any) -> M:
    """The message of ``kind`` that carries ``command`` in a ``Command``: its fields but its id (the envelope's), and
    those ``given`` (a nested message's values, converted by the caller)."""
    return kind(**{field.name: _listed(getattr(command, field.name)) for field in dataclasses.fields(command)
                   if field.name != "id" and field.name not in given}, **given)


def _tupled(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def failure_to_proto(report: AgentReport[WorkerFailed]) -> FailureReport:
    return to_proto(FailureReport, report.event, incarnation=report.incarnation)


def failure_from_proto(message: FailureReport) -> AgentReport[WorkerFailed]:
    return AgentReport(incarnation=message.incarnation, event=from_proto(WorkerFailed, message))


def stacks_to_proto(report: AgentReport[StacksDumped]) -> StacksReport:
    return to_proto(StacksReport, report.event, incarnation=report.incarnation,
                    workers=[to_proto(ProtoWorkerStack, w) for w in report.event.workers])


def stacks_from_proto(message: StacksReport) -> AgentReport[StacksDumped]:
    workers = tuple(from_proto(StackSample, w) for w in message.workers)
    return AgentReport(incarnation=message.incarnation, event=from_proto(StacksDumped, message, workers=workers))


def numerics_to_proto(report: AgentReport[NumericsReported]) -> NumericsReport:
    return to_proto(NumericsReport, report.event, incarnation=report.incarnation,
                    notes=[_note_to_proto(n) for n in report.event.notes])


def numerics_from_proto(message: NumericsReport) -> AgentReport[NumericsReported]:
    notes = tuple(_note_from_proto(n) for n in message.notes)
    return AgentReport(incarnation=message.incarnation, event=from_proto(NumericsReported, message, notes=notes))


def _note_to_proto(note: NumericsNote) -> ProtoNumericsNote:
    samples = [ProtoStepSamples(dataset=s.dataset, count=s.count,
                                ranges=[ProtoSampleRange(part=p, start=b, end=e) for p, b, e in s.ranges])
               for s in note.samples or ()]
    return to_proto(ProtoNumericsNote, note, samples=samples, samples_known=note.samples is not None)


def _note_from_proto(message: ProtoNumericsNote) -> NumericsNote:
    samples = tuple(StepSamples(dataset=s.dataset, count=s.count, ranges=tuple((r.part, r.start, r.end)
                                                                                for r in s.ranges))
                    for s in message.samples) if message.samples_known else None
    return from_proto(NumericsNote, message, samples=samples)


def health_to_proto(report: AgentReport[NodeHealthReported]) -> HealthReport:
    return to_proto(HealthReport, report.event, collectives=[
        to_proto(ProtoPeerCollective, c) for c in report.event.collectives])


def health_from_proto(message: HealthReport) -> AgentReport[NodeHealthReported]:
    collectives = tuple(from_proto(PeerCollective, c) for c in message.collectives)
    return AgentReport(incarnation=message.incarnation,
                       event=from_proto(NodeHealthReported, message, collectives=collectives))


def workers_to_proto(report: AgentReport[WorkersStarted | WorkersSucceeded]) -> WorkersReport:
    event = report.event
    match event:
        case WorkersStarted():
            state = ProtoWorkersState.STARTED
        case WorkersSucceeded():
            state = ProtoWorkersState.SUCCEEDED
        case _:
            assert_never(event)
    return to_proto(WorkersReport, event, incarnation=report.incarnation, state=state)


def workers_from_proto(message: WorkersReport) -> AgentReport[WorkersStarted | WorkersSucceeded] | None:
    """The report, or None for state UNSPECIFIED or a state this stead version does not know."""
    kind: type[WorkersStarted | WorkersSucceeded]
    if message.state == ProtoWorkersState.STARTED:
        kind = WorkersStarted
    elif message.state == ProtoWorkersState.SUCCEEDED:
        kind = WorkersSucceeded
    else:
        return None
    return AgentReport(incarnation=message.incarnation, event=from_proto(kind, message))


def warned_to_proto(report: AgentReport[JobWarned]) -> WarnedReport:
    """The master fills ``committed_step`` (its newest committed step when it records the report): not sent."""
    values = dataclasses.asdict(report.event)
    del values["committed_step"]
    return WarnedReport(**values)


def warned_from_proto(message: WarnedReport) -> AgentReport[JobWarned]:
    return AgentReport(incarnation=message.incarnation, event=from_proto(JobWarned, message, committed_step=None))
