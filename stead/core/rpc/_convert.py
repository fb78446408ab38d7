"""Conversions between the generated protobuf messages and the backend's dataclasses and events.

Both directions live here so that the server and the client agree on them; the
server validates requests before converting them (see ``agent_service``). An
agent's report converts straight to the event it reports (see
:mod:`~stead.core.rpc.backend`): the message and the event spell their fields
the same way, so the conversion goes by name, and a field added to both crosses
without a line here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar, assert_never

import betterproto2

from stead.core.events import (
    NodeHealthReported,
    PeerCollective,
    StackSample,
    StacksDumped,
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
    RegisterReply,
    RegisterRequest,
    StacksReport,
    StartWorkers,
    StopNode,
    StopWorkers,
    WorkersReport,
)
from stead.core.rpc._proto.stead.v1 import (
    PeerCollective as ProtoPeerCollective,
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
    "register_from_proto",
    "register_reply_from_proto",
    "register_reply_to_proto",
    "register_to_proto",
    "stacks_from_proto",
    "stacks_to_proto",
    "to_proto",
    "workers_from_proto",
    "workers_to_proto",
]

#: the wire value of "no step yet" in HeartbeatRequest.step
NO_STEP = -1


def register_to_proto(info: RegisterInfo) -> RegisterRequest:
    return RegisterRequest(node_id=info.node_id, incarnation=info.incarnation, host=info.host, pid=info.pid,
                           nproc=info.nproc)


def register_from_proto(message: RegisterRequest) -> RegisterInfo:
    return RegisterInfo(node_id=message.node_id, incarnation=message.incarnation, host=message.host,
                        pid=message.pid, nproc=message.nproc)


def register_reply_to_proto(result: RegisterResult) -> RegisterReply:
    return RegisterReply(job=result.job, heartbeat_interval_s=result.heartbeat_interval_s,
                         heartbeat_timeout_s=result.heartbeat_timeout_s, store_host=result.store_host,
                         store_port=result.store_port, progress_interval_s=result.progress_interval_s)


def register_reply_from_proto(message: RegisterReply) -> RegisterResult:
    return RegisterResult(job=message.job, heartbeat_interval_s=message.heartbeat_interval_s,
                          heartbeat_timeout_s=message.heartbeat_timeout_s, store_host=message.store_host,
                          store_port=message.store_port, progress_interval_s=message.progress_interval_s)


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
            return Command(id=command.id, start_workers=StartWorkers(
                round=command.round, node_rank=command.node_rank, nnodes=command.nnodes,
                nproc_per_node=command.nproc_per_node, world_size=command.world_size,
                restart_count=command.restart_count, master_addr=command.master_addr,
                master_port=command.master_port))
        case StopWorkersCmd():
            return Command(id=command.id, stop_workers=StopWorkers(round=command.round, reason=command.reason))
        case StopNodeCmd():
            return Command(id=command.id, stop_node=StopNode(reason=command.reason))
        case DumpStacksCmd():
            return Command(id=command.id, dump_stacks=DumpStacks(round=command.round, reason=command.reason))
        case CheckHealthCmd():
            return Command(id=command.id, check_health=CheckHealth(
                check=command.check, nodes=list(command.nodes), store_host=command.store_host,
                store_port=command.store_port, timeout_s=command.timeout_s))
        case _:
            assert_never(command)


def command_from_proto(message: Command) -> AgentCommand | None:
    """The command, or None when its body is one this stead version does not know."""
    if (start := message.start_workers) is not None:
        return StartWorkersCmd(id=message.id, round=start.round, node_rank=start.node_rank, nnodes=start.nnodes,
                               nproc_per_node=start.nproc_per_node, world_size=start.world_size,
                               restart_count=start.restart_count, master_addr=start.master_addr,
                               master_port=start.master_port)
    if (stop := message.stop_workers) is not None:
        return StopWorkersCmd(id=message.id, round=stop.round, reason=stop.reason)
    if (stop_node := message.stop_node) is not None:
        return StopNodeCmd(id=message.id, reason=stop_node.reason)
    if (dump := message.dump_stacks) is not None:
        return DumpStacksCmd(id=message.id, round=dump.round, reason=dump.reason)
    if (check := message.check_health) is not None:
        return CheckHealthCmd(id=message.id, check=check.check, nodes=tuple(check.nodes), store_host=check.store_host,
                              store_port=check.store_port, timeout_s=check.timeout_s)
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
