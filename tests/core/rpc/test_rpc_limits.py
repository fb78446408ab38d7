"""What a client can make the master hold is bounded before it is held: messages, connections, their time."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from grpclib.const import Status
from h2.settings import SettingCodes

from stead.core.errors import RpcUnavailable
from stead.core.rpc import AgentServicer, HeartbeatInfo, MasterClient, RegisterInfo, RpcServer, StopNodeCmd
from stead.testing.h2peer import RawPeer

pytestmark = pytest.mark.anyio

REGISTER = RegisterInfo(node_id="node-0", incarnation=1, host="host-a", pid=4242, nproc=2)
HEARTBEAT = HeartbeatInfo(node_id="node-0", incarnation=1, round=0, step=None, workers_alive=2)
LIMIT = 64 << 10
#: the longest a test waits for something the server does on its own timer (a bound for a broken test only)
WITHIN_S = 20.0


async def _until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(WITHIN_S):
        while not condition():  # noqa: ASYNC110 (a count the server keeps: nothing to wait on)
            await anyio.sleep(0.02)


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


async def test_the_server_announces_its_http2_limits(token: str) -> None:
    async with RpcServer([], token=token, max_message_bytes=LIMIT) as server, \
            await RawPeer.connect(server.host, server.port) as peer:
        settings = await peer.server_settings()
    assert settings[SettingCodes.MAX_CONCURRENT_STREAMS] == 100
    assert settings[SettingCodes.MAX_HEADER_LIST_SIZE] == 16 << 10
    assert settings[SettingCodes.INITIAL_WINDOW_SIZE] == LIMIT + 5


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
            await _until(lambda: server.connections == 1)  # the quiet client's connection went, idle
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
        await _until(lambda: server.connections == 2)
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
