"""What a client can make the master hold is bounded before it is held: messages, connections, their time."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from _polling import until
from grpclib.const import Status
from h2.settings import SettingCodes

from stead.core.config import Settings
from stead.core.errors import RpcUnavailable
from stead.core.rpc import AgentServicer, HeartbeatInfo, MasterClient, RegisterInfo, RpcServer, StopNodeCmd
from stead.plugin import proto
from tests.support.h2peer import DeafPeer, RawPeer
from tests.support.wire import grpc_frame

pytestmark = pytest.mark.anyio

REGISTER = RegisterInfo(node_id="node-0", incarnation=1, host="host-a", pid=4242, nproc=2)
HEARTBEAT = HeartbeatInfo(node_id="node-0", incarnation=1, round=0, step=None, workers_alive=2)
LIMIT = 64 << 10
#: the longest a test waits for something the server does on its own timer (a bound for a broken test only)
WITHIN_S = 20.0
#: what a deaf peer sends at most: far past what the master may buffer for it (then the test fails)
FLOOD_BYTES = 8 << 20
#: HTTP/2's initial flow-control window, which the master keeps until a call authenticates
H2_DEFAULT_WINDOW = 65_535
REGISTER_PATH = "/stead.v1.AgentService/Register"
#: REGISTER, as a call carries it (prefix and body)
REGISTER_FRAME = grpc_frame(bytes(proto.RegisterRequest(node_id=REGISTER.node_id, incarnation=REGISTER.incarnation,
                                                  host=REGISTER.host, pid=REGISTER.pid, nproc=REGISTER.nproc)))


def _holds_socket(port: int, peer: DeafPeer) -> bool:
    """Whether this process (the master) still has a socket open for ``peer``'s connection to ``port``."""
    return any(c.laddr and c.raddr and c.laddr.port == port and c.raddr.port == peer.port
               for c in psutil.Process().net_connections("tcp"))


def _unread_by_master(port: int, peer: DeafPeer) -> int | None:
    """What ``peer`` sent that the master's end of its connection to ``port`` has not read yet (None: no such end)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and int(fields[2].rsplit(":", 1)[1], 16) == peer.port:
            return int(fields[4].split(":")[1], 16)
    return None


def _kernel_send_buffer_bytes() -> int:
    """The most the kernel holds of what a socket wrote and its peer did not read (its autotuned send buffer)."""
    return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])


@contextlib.asynccontextmanager
async def _agent(server: RpcServer, token: str) -> AsyncIterator[MasterClient]:
    """A client with its command stream open, as an agent holds it for as long as it lives."""
    async with MasterClient(server.address, token, call_timeout_s=10) as client:
        commands = client.commands("node-0", 1)
        assert isinstance(await anext(commands), StopNodeCmd)  # the stream is open, and stays open
        try:
            yield client
        finally:
            await commands.aclose()


async def test_a_length_prefix_over_the_limit_is_refused_before_the_body_is_read(backend: Any, token: str) -> None:
    async with RpcServer([AgentServicer(backend)], token=token, max_message_bytes=LIMIT) as server:
        async with await RawPeer.connect(server.host, server.port) as peer:
            answer = await peer.call("/stead.v1.AgentService/Register", token, prefix=b"\x00\xff\xff\xff\xff",
                                     total=64 << 20)
        assert answer.status == Status.RESOURCE_EXHAUSTED.value
        assert (f"a RegisterRequest of {2**32 - 1} bytes is over this master's limit of {LIMIT} bytes "
                "(setting rpc_max_message_bytes)") in answer.message
        # the flow-control windows are one message: what the client pushed before the refusal is about that much
        assert answer.sent <= 2 * LIMIT, f"the server let {answer.sent} bytes in for a message it refused"
        async with MasterClient(server.address, token, call_timeout_s=10) as client:
            await client.register(REGISTER)  # and it serves on
    assert backend.registered == [REGISTER]


async def test_the_server_announces_its_http2_limits_and_widens_the_window_once_a_call_authenticates(
        backend: Any, token: str) -> None:
    message_bytes = Settings().rpc_max_message_bytes  # 4 MiB: well over HTTP/2's default window
    async with RpcServer([AgentServicer(backend)], token=token) as server, \
            await RawPeer.connect(server.host, server.port) as peer:
        settings = await peer.server_settings()
        assert settings[SettingCodes.MAX_CONCURRENT_STREAMS] == 100
        assert settings[SettingCodes.MAX_HEADER_LIST_SIZE] == 16 << 10
        # before a call authenticates, HTTP/2's default window: a stranger pushes 64 KiB, not a message's worth
        assert settings[SettingCodes.INITIAL_WINDOW_SIZE] == H2_DEFAULT_WINDOW
        assert peer.send_window == H2_DEFAULT_WINDOW
        refused = await peer.call(REGISTER_PATH, "not-the-token", prefix=b"", total=4 << 20)
        assert refused.status == Status.UNAUTHENTICATED.value
        assert refused.sent <= H2_DEFAULT_WINDOW, f"an unauthenticated call pushed {refused.sent} bytes"
        answer = await peer.call(REGISTER_PATH, token, prefix=REGISTER_FRAME, total=len(REGISTER_FRAME))
        assert answer.status == Status.OK.value, answer
        settings = await peer.server_settings()
        assert settings[SettingCodes.INITIAL_WINDOW_SIZE] == message_bytes + 5  # then one message, as before
        assert peer.send_window >= message_bytes // 2  # what the calls above sent is not acknowledged yet
    assert backend.registered == [REGISTER]


async def test_a_client_that_sends_pings_and_never_reads_is_let_go_before_it_authenticates(token: str) -> None:
    # h2 answers every PING itself: a peer that never reads makes the master buffer the answers
    async with RpcServer([], token=token, auth_timeout_s=600) as server, \
            await DeafPeer.connect(server.host, server.port) as deaf:
        await deaf.pings(_kernel_send_buffer_bytes() + (1 << 20))
        await until(lambda: not _holds_socket(server.port, deaf), "the master let go of a peer that never reads")
        assert server.connections == 0


async def test_an_authenticated_client_that_never_reads_is_let_go_when_its_answers_pass_the_bound(
        backend: Any, token: str) -> None:
    async with RpcServer([AgentServicer(backend)], token=token, idle_timeout_s=600) as server, \
            await DeafPeer.connect(server.host, server.port) as deaf:
        await deaf.call(REGISTER_PATH, token, REGISTER_FRAME)
        await until(lambda: backend.registered == [REGISTER], "the deaf peer's Register call was served")
        await deaf.pings(_kernel_send_buffer_bytes() + (4 << 20))
        await until(lambda: not _holds_socket(server.port, deaf), "the master let go of a peer that never reads")


async def test_a_connection_closed_while_its_peer_reads_nothing_releases_its_socket(
        backend: Any, token: str) -> None:
    # a graceful close waits for the peer to read what is buffered: one that never reads kept its socket for ever
    deaf: DeafPeer | None = None
    try:
        async with RpcServer([AgentServicer(backend)], token=token) as server:
            port = server.port
            deaf = await DeafPeer.connect(server.host, port)
            await deaf.call(REGISTER_PATH, token, REGISTER_FRAME)
            await deaf.pings(_kernel_send_buffer_bytes() + (1 << 20))  # answers past the kernel's buffers
            await until(lambda: not _unread_by_master(port, deaf),  # answered (or let go, over the bound)
                        "the master read what the deaf peer sent")
        await until(lambda: not _holds_socket(port, deaf), "the stopped server let go of every connection")
    finally:
        if deaf is not None:
            deaf.close()


async def test_unauthenticated_and_idle_connections_are_closed_and_an_agent_s_open_stream_is_not(
        backend: Any, token: str) -> None:
    backend.to_send, backend.hold_open = [StopNodeCmd(id="c1", reason="r")], True
    async with RpcServer([AgentServicer(backend)], token=token, auth_timeout_s=0.2, idle_timeout_s=0.2) as server, \
            _agent(server, token) as agent:
        silent = [await RawPeer.connect(server.host, server.port) for _ in range(3)]
        wrong = await RawPeer.connect(server.host, server.port)
        refused = await wrong.call("/stead.v1.AgentService/Register", "not-the-token", prefix=b"", total=0)
        assert refused.status == Status.UNAUTHENTICATED.value
        for peer in [*silent, wrong]:
            assert await peer.closed_by_server(within_s=WITHIN_S), "an unauthenticated connection was kept"
            await peer.close()
        async with MasterClient(server.address, token, call_timeout_s=10) as quiet:
            await quiet.register(REGISTER)
            await until(lambda: server.connections == 1, "the quiet client's idle connection was closed")
            # (on a loaded machine the client may not have read the close yet: a call then would go out on the dead
            # connection and fail, as a call does that crosses a close; retried, as agents retry)
            await until(lambda: not quiet._conn.channel._connected, "the quiet client saw its connection closed")
            await quiet.register(REGISTER)  # and its next call connects again
        await anyio.sleep(1.0)  # five idle timeouts: the agent's stream is a call, its connection is not idle
        assert not backend.stream_closed.is_set(), "the agent's command stream was cut"
        assert server.connections == 1
        assert await agent.heartbeat(HEARTBEAT) is True
    assert backend.registered == [REGISTER, REGISTER]


async def test_at_the_limit_unauthenticated_connections_go_first_then_newcomers_are_refused(
        backend: Any, token: str) -> None:
    backend.to_send, backend.hold_open = [StopNodeCmd(id="c1", reason="r")], True
    async with RpcServer([AgentServicer(backend)], token=token, max_connections=2) as server:
        first = await RawPeer.connect(server.host, server.port)
        second = await RawPeer.connect(server.host, server.port)
        await until(lambda: server.connections == 2, "the server took both raw connections")
        async with _agent(server, token):  # the oldest unauthenticated connection makes room
            assert await first.closed_by_server(within_s=WITHIN_S)
            async with _agent(server, token):  # and the next
                assert await second.closed_by_server(within_s=WITHIN_S)
                with pytest.raises(RpcUnavailable):  # two connections, each with a call open: none to let go
                    async with MasterClient(server.address, token, call_timeout_s=10) as late:
                        await late.register(REGISTER)
                assert not backend.stream_closed.is_set(), "a held command stream was cut for a newcomer"
                assert server.connections == 2
        for peer in (first, second):
            await peer.close()
