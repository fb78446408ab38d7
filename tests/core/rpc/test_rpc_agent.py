"""AgentService end to end over grpclib on loopback, with a fake backend."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import anyio
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from stead.core.errors import InvalidRequest, RpcUnavailable, StoreUnavailable, Unauthenticated
from stead.core.events import (
    NodeHealthReported,
    PeerCollective,
    StackSample,
    StacksDumped,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.rpc import (
    AgentReport,
    CheckHealthCmd,
    HeartbeatInfo,
    MasterClient,
    RegisterInfo,
    RpcServer,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
    attach_token,
)
from stead.plugin import proto
from stead.plugins.sharding import proto as sharding_proto

pytestmark = pytest.mark.anyio

REGISTER = RegisterInfo(node_id="node-0", incarnation=1, host="host-a", pid=4242, nproc=2)
HEARTBEAT = HeartbeatInfo(node_id="node-0", incarnation=1, round=0, step=None, workers_alive=2, rss_bytes=1 << 30,
                          cpu_percent=12.5, step_compute_s=0.125, gpu_memory_bytes=3 << 30, gpu_util_percent=87.5)
FAILURE = AgentReport(incarnation=1, event=WorkerFailed(
    node_id="node-0", round=2, local_rank=1, rank=3, exit_code=1, signal=None, step=None,
    error_tail="Traceback ...\nRuntimeError: boom\n", oom="kernel: Killed process 7",
    gpu="GPU 0: XID 79 (GPU has fallen off the bus)", exited_ok_ranks=(2,)))
COMMANDS = [
    StartWorkersCmd(id="start-1", round=1, node_rank=0, nnodes=2, nproc_per_node=2, world_size=4, restart_count=0,
                    master_addr="10.0.0.1", master_port=29500),
    StopWorkersCmd(id="stop-1", round=1, reason="worker failed"),
    StartWorkersCmd(id="start-2", round=2, node_rank=1, nnodes=2, nproc_per_node=2, world_size=4, restart_count=1,
                    master_addr="10.0.0.1", master_port=29501),
    CheckHealthCmd(id="check-health/1/node-0", check=1, nodes=("node-0", "node-1"), store_host="10.0.0.1",
                   store_port=29502, timeout_s=60.0),
    StopNodeCmd(id="stop-node", reason="job finished"),
]
HEALTH = AgentReport(incarnation=1, event=NodeHealthReported(
    node_id="node-0", incarnation=1, check=1, matmul_s=0.012, device="cpu", seconds=1.5,
    collectives=(PeerCollective(peer="node-1", seconds=0.004),
                 PeerCollective(peer="node-2", error="RuntimeError: timed out"))))
STACKS = AgentReport(incarnation=1, event=StacksDumped(node_id="node-0", round=2, method="faulthandler", workers=(
    StackSample(rank=2, local_rank=0, step=7, stack='Thread 0x1 (most recent call first):\n  File "train.py"'),
    StackSample(rank=3, local_rank=1, step=None, stack=""))))


def _with(report: AgentReport[Any], **changes: Any) -> AgentReport[Any]:
    """``report`` with these fields of its event changed."""
    return AgentReport(incarnation=report.incarnation, event=dataclasses.replace(report.event, **changes))


def _workers(node_id: str, round_: int, *, started: bool = True) -> AgentReport[WorkersStarted | WorkersSucceeded]:
    kind = WorkersStarted if started else WorkersSucceeded
    return AgentReport(incarnation=1, event=kind(node_id=node_id, round=round_))


async def test_register_and_heartbeat_reach_the_backend_and_return_its_answers(client: MasterClient,
                                                                            backend: Any) -> None:
    assert await client.register(REGISTER) == backend.result
    assert await client.heartbeat(HEARTBEAT) is True
    stepped = HeartbeatInfo(**{**HEARTBEAT.__dict__, "round": 3, "step": 1234, "acked": ("start-workers/3/node-0",)})
    assert await client.heartbeat(stepped) is True
    backend.known = False
    assert await client.heartbeat(HEARTBEAT) is False

    assert backend.registered == [REGISTER]
    assert backend.heartbeats == [HEARTBEAT, stepped, HEARTBEAT]  # step None travels as -1 and comes back None


async def test_command_stream_delivers_the_backends_commands_in_order(client: MasterClient, backend: Any) -> None:
    backend.to_send = COMMANDS
    received = [command async for command in client.commands("node-0", 1)]
    assert received == COMMANDS
    assert backend.subscribed == [("node-0", 1)]
    with anyio.fail_after(10):
        await backend.stream_closed.wait()


async def test_leaving_the_command_stream_early_closes_the_backends_iterator(client: MasterClient,
                                                                             backend: Any) -> None:
    backend.to_send = COMMANDS[:1]
    backend.hold_open = True
    commands = client.commands("node-0", 1)
    assert await anext(commands) == COMMANDS[0]
    await commands.aclose()
    with anyio.fail_after(10):
        await backend.stream_closed.wait()
    assert await client.heartbeat(HEARTBEAT) is True  # the connection is still usable


async def test_failure_and_workers_reports_reach_the_backend_as_the_events_they_are(client: MasterClient,
                                                                                     backend: Any) -> None:
    signalled = _with(FAILURE, exit_code=None, signal=9, step=77)
    await client.report_failure(FAILURE)
    await client.report_failure(signalled)
    await client.report_workers(_workers("node-0", 2))
    await client.report_workers(_workers("node-0", 2, started=False))
    assert backend.failures == [FAILURE, signalled]
    assert backend.workers == [_workers("node-0", 2), _workers("node-0", 2, started=False)]


async def test_health_and_stacks_reports_reach_the_backend_as_the_events_they_are(client: MasterClient,
                                                                                   backend: Any) -> None:
    failed = AgentReport(incarnation=2, event=NodeHealthReported(node_id="node-1", incarnation=2, check=3,
                                                                 error="matmul: RuntimeError: boom"))
    await client.report_health(HEALTH)
    await client.report_health(failed)
    await client.report_stacks(STACKS)
    assert backend.health == [HEALTH, failed]  # an unset matmul time travels as unset
    assert backend.stacks == [STACKS]  # and an unset step as unset


@pytest.mark.parametrize(("call", "field"), [
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "node_id": ""})), "RegisterRequest.node_id"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "node_id": "a/b"})), "RegisterRequest.node_id"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "incarnation": 0})), "RegisterRequest.incarnation"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "host": ""})), "RegisterRequest.host"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "nproc": 0})), "RegisterRequest.nproc"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "nproc": 2**31 - 1})), "RegisterRequest.nproc"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "host": "h" * 254})), "RegisterRequest.host"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "host": "a\nb"})), "RegisterRequest.host"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "incarnation": -1})),
     "HeartbeatRequest.incarnation"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "step": -5})), "HeartbeatRequest.step"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "workers_alive": -1})),
     "HeartbeatRequest.workers_alive"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "cpu_percent": float("nan")})),
     "HeartbeatRequest.cpu_percent"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "gpu_util_percent": -1.0})),
     "HeartbeatRequest.gpu_util_percent"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "gpu_memory_bytes": -1})),
     "HeartbeatRequest.gpu_memory_bytes"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "step_compute_s": -0.5})),
     "HeartbeatRequest.step_compute_s"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "step_compute_s": float("inf")})),
     "HeartbeatRequest.step_compute_s"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "acked": ("stop-workers/1/node-0",) * 65})),
     "HeartbeatRequest.acked"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "acked": ("x" * 400,)})), "HeartbeatRequest.acked"),
    (lambda c: c.report_failure(_with(FAILURE, oom="x" * 5000)), "FailureReport.oom"),
    (lambda c: c.report_failure(_with(FAILURE, gpu="x" * 5000)), "FailureReport.gpu"),
    (lambda c: c.report_failure(_with(FAILURE, rank=-1)), "FailureReport.rank"),
    (lambda c: c.report_failure(_with(FAILURE, error_tail="x" * 40_000)),
     "FailureReport.error_tail"),
    (lambda c: c.report_failure(_with(FAILURE, exited_ok_ranks=(1, -1))),
     "FailureReport.exited_ok_ranks"),
    (lambda c: c.report_failure(_with(FAILURE, local_rank=-2)), "FailureReport.local_rank"),
    (lambda c: c.report_failure(_with(FAILURE, round=-1)), "FailureReport.round"),
    (lambda c: c.report_workers(_workers("", 0)), "WorkersReport.node_id"),
    (lambda c: c.report_health(_with(HEALTH, check=0)), "HealthReport.check"),
    (lambda c: c.report_health(_with(HEALTH, matmul_s=float("nan"))), "HealthReport.matmul_s"),
    (lambda c: c.report_health(_with(HEALTH, seconds=-1.0)), "HealthReport.seconds"),
    (lambda c: c.report_health(_with(HEALTH, collectives=(PeerCollective(peer="a/b"),))),
     "HealthReport.collectives[0].peer"),
    (lambda c: c.report_health(_with(HEALTH, collectives=(PeerCollective(peer="n", seconds=-2),))),
     "HealthReport.collectives[0].seconds"),
    (lambda c: c.report_health(_with(HEALTH, collectives=(PeerCollective(peer="n"),) * 4)),
     "HealthReport.collectives"),
    (lambda c: c.report_health(_with(HEALTH, error="x" * 5000)), "HealthReport.error"),
    (lambda c: c.report_workers(_workers("node-0", -1)), "WorkersReport.round"),
    (lambda c: c.report_failure(AgentReport(incarnation=0, event=FAILURE.event)), "FailureReport.incarnation"),
    (lambda c: c.report_stacks(_with(STACKS, node_id="a/b")), "StacksReport.node_id"),
    (lambda c: c.report_stacks(_with(STACKS, round=-1)), "StacksReport.round"),
    (lambda c: c.report_stacks(_with(STACKS, workers=(StackSample(rank=-1, local_rank=0, step=None, stack=""),))),
     "StacksReport.workers[0].rank"),
    (lambda c: c.report_stacks(_with(STACKS, workers=(StackSample(rank=0, local_rank=0, step=-3, stack=""),))),
     "StacksReport.workers[0].step"),
    (lambda c: c.report_stacks(_with(STACKS, workers=(StackSample(rank=0, local_rank=0, step=1,
                                                                  stack="s" * (64 * 1024 + 1)),))),
     "StacksReport.workers[0].stack has 65537 characters: send at most 65536"),
    (lambda c: c.report_stacks(_with(STACKS, method="m" * 65)), "StacksReport.method has 65 characters"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "node_id": ".."})), "RegisterRequest.node_id"),
    (lambda c: c.register(RegisterInfo(**{**REGISTER.__dict__, "node_id": "../../x y"})), "RegisterRequest.node_id"),
    (lambda c: c.heartbeat(HeartbeatInfo(**{**HEARTBEAT.__dict__, "phase": "p" * (2 << 20)})),
     "HeartbeatRequest.phase has 2097152 characters: send at most 24"),
    (lambda c: c.report_failure(_with(FAILURE, exited_at=float("nan"))),
     "FailureReport.exited_at is nan: send a finite number"),
    (lambda c: c.report_failure(_with(FAILURE, exited_at=-1.0)), "FailureReport.exited_at"),
    (lambda c: c.report_health(_with(HEALTH, device="d" * 300)),
     "HealthReport.device has 300 characters: send at most 256"),
])
async def test_malformed_requests_are_rejected_with_the_field_named(client: MasterClient, backend: Any, call: Any,
                                                                    field: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(field)):
        await call(client)
    assert backend.calls == 0


async def test_a_heartbeat_refused_as_it_is_decoded_leaves_the_heartbeat_stream_open(server: RpcServer, token: str,
                                                                                     backend: Any) -> None:
    channel = Channel(server.host, server.port)
    attach_token(channel, token)
    try:
        async with channel.request("/stead.v1.AgentService/HeartbeatStream", Cardinality.STREAM_STREAM,
                                   proto.HeartbeatRequest, proto.HeartbeatReply, timeout=10) as stream:
            await stream.send_message(proto.HeartbeatRequest(node_id="node-0", incarnation=1, cpu_percent=float("nan")))
            refused = await stream.recv_message()
            await stream.send_message(proto.HeartbeatRequest(node_id="node-0", incarnation=1), end=True)
            taken = await stream.recv_message()
    finally:
        channel.close()
    assert refused is not None and "HeartbeatRequest.cpu_percent is nan" in refused.error and not refused.known
    assert taken is not None and taken.known and not taken.error
    assert len(backend.heartbeats) == 1


async def test_a_command_stream_for_a_bad_node_is_rejected(client: MasterClient, backend: Any) -> None:
    with pytest.raises(InvalidRequest, match=r"CommandsRequest\.incarnation"):
        [command async for command in client.commands("node-0", 0)]
    assert backend.subscribed == []


async def test_an_unknown_workers_state_is_rejected(server: RpcServer, token: str, backend: Any) -> None:
    channel = Channel(server.host, server.port)
    attach_token(channel, token)
    try:
        for state in (proto.WorkersState.UNSPECIFIED, proto.WorkersState(7)):
            report = proto.WorkersReport(node_id="node-0", incarnation=1, round=0, state=state)
            with pytest.raises(GRPCError) as caught:
                await proto.AgentServiceStub(channel).report_workers(report, timeout=10)
            assert caught.value.status == Status.INVALID_ARGUMENT
            assert "WorkersReport.state" in (caught.value.message or "")
    finally:
        channel.close()
    assert backend.workers == []


@pytest.mark.parametrize(("error", "expected", "text"), [
    (InvalidRequest("node node-0 incarnation 1 is not a live node"), InvalidRequest, "not a live node"),
    (Unauthenticated("token revoked"), Unauthenticated, "token revoked"),
    (StoreUnavailable("etcd is down"), RpcUnavailable, "etcd is down"),
    (RuntimeError("boom"), RpcUnavailable, "RuntimeError: boom"),
])
async def test_backend_errors_reach_the_client_as_steads_errors(client: MasterClient, backend: Any,
                                                                error: Exception, expected: type[Exception],
                                                                text: str) -> None:
    backend.error = error
    with pytest.raises(expected, match=text):
        await client.register(REGISTER)
    with pytest.raises(expected, match=text):
        [command async for command in client.commands("node-0", 1)]


async def test_an_unexpected_backend_error_is_answered_internal(server: RpcServer, token: str,
                                                                backend: Any) -> None:
    backend.error = RuntimeError("boom")
    channel = Channel(server.host, server.port)
    attach_token(channel, token)
    try:
        with pytest.raises(GRPCError) as caught:
            await proto.AgentServiceStub(channel).report_workers(
                proto.WorkersReport(node_id="node-0", incarnation=1, round=0, state=proto.WorkersState.STARTED),
                timeout=10)
    finally:
        channel.close()
    assert caught.value.status == Status.INTERNAL
    assert "boom" in (caught.value.message or "")


async def test_services_this_master_does_not_serve_answer_unimplemented_with_an_explanation(
        server: RpcServer, token: str) -> None:
    channel = Channel(server.host, server.port)
    attach_token(channel, token)
    try:
        with pytest.raises(GRPCError) as caught:
            await sharding_proto.ShardServiceStub(channel).lease_shards(
                sharding_proto.LeaseShardsRequest(dataset="d", node_id="n", count=1), timeout=10)
    finally:
        channel.close()
    assert caught.value.status == Status.UNIMPLEMENTED
    assert "/stead.v1.ShardService/LeaseShards is not served by this stead master" in (caught.value.message or "")
