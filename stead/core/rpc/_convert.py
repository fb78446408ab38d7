"""Conversions between the generated protobuf messages and the backend's dataclasses.

Both directions live here so that the server and the client agree on them; the
server validates requests before converting them (see ``agent_service``).
"""

from __future__ import annotations

from typing import assert_never

from stead.core.events import NodeHealthReported, PeerCollective
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
    CheckHealthCmd,
    DumpStacksCmd,
    FailureInfo,
    HeartbeatInfo,
    RegisterInfo,
    RegisterResult,
    StacksInfo,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
    WorkersState,
    WorkerStack,
)

__all__ = [
    "NO_STEP",
    "command_from_proto",
    "command_to_proto",
    "failure_from_proto",
    "failure_to_proto",
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
    "workers_state_from_proto",
    "workers_state_to_proto",
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


def health_to_proto(report: NodeHealthReported) -> HealthReport:
    return HealthReport(node_id=report.node_id, incarnation=report.incarnation, check=report.check,
                        matmul_s=report.matmul_s, device=report.device, error=report.error, seconds=report.seconds,
                        collectives=[ProtoPeerCollective(peer=c.peer, seconds=c.seconds, error=c.error)
                                     for c in report.collectives])


def health_from_proto(message: HealthReport) -> NodeHealthReported:
    return NodeHealthReported(node_id=message.node_id, incarnation=message.incarnation, check=message.check,
                              matmul_s=message.matmul_s, device=message.device, error=message.error,
                              seconds=message.seconds, collectives=tuple(
                                  PeerCollective(peer=c.peer, seconds=c.seconds, error=c.error)
                                  for c in message.collectives))


def stacks_to_proto(info: StacksInfo) -> StacksReport:
    return StacksReport(node_id=info.node_id, incarnation=info.incarnation, round=info.round, method=info.method,
                        error=info.error, workers=[
                            ProtoWorkerStack(local_rank=w.local_rank, rank=w.rank, step=w.step, stack=w.stack)
                            for w in info.workers])


def stacks_from_proto(message: StacksReport) -> StacksInfo:
    return StacksInfo(node_id=message.node_id, incarnation=message.incarnation, round=message.round,
                      method=message.method, error=message.error, workers=tuple(
                          WorkerStack(local_rank=w.local_rank, rank=w.rank, step=w.step, stack=w.stack)
                          for w in message.workers))


def failure_to_proto(info: FailureInfo) -> FailureReport:
    return FailureReport(node_id=info.node_id, incarnation=info.incarnation, round=info.round,
                         local_rank=info.local_rank, rank=info.rank, exit_code=info.exit_code, signal=info.signal,
                         step=info.step, error_tail=info.error_tail, exited_at=info.exited_at, oom=info.oom,
                         gpu=info.gpu, exited_ok_ranks=list(info.exited_ok_ranks))


def failure_from_proto(message: FailureReport) -> FailureInfo:
    return FailureInfo(node_id=message.node_id, incarnation=message.incarnation, round=message.round,
                       local_rank=message.local_rank, rank=message.rank, exit_code=message.exit_code,
                       signal=message.signal, step=message.step, error_tail=message.error_tail,
                       exited_at=message.exited_at, oom=message.oom, gpu=message.gpu,
                       exited_ok_ranks=tuple(message.exited_ok_ranks))


def workers_state_to_proto(state: WorkersState) -> ProtoWorkersState:
    match state:
        case "started":
            return ProtoWorkersState.STARTED
        case "succeeded":
            return ProtoWorkersState.SUCCEEDED
        case _:
            assert_never(state)


def workers_state_from_proto(state: ProtoWorkersState) -> WorkersState | None:
    """The state, or None for UNSPECIFIED or a value this stead version does not know."""
    if state == ProtoWorkersState.STARTED:
        return "started"
    if state == ProtoWorkersState.SUCCEEDED:
        return "succeeded"
    return None
