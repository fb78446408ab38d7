"""The server's lifecycle and robustness, and the client's view of a master it cannot reach."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError

from stead.core.errors import ConfigError, RpcUnavailable
from stead.core.rpc import (
    AgentServicer,
    HeartbeatInfo,
    MasterClient,
    RegisterInfo,
    RpcServer,
    StopNodeCmd,
    attach_token,
    format_address,
    new_token,
    parse_address,
)

pytestmark = pytest.mark.anyio

REGISTER = RegisterInfo(node_id="node-0", incarnation=1, host="host-a", pid=4242, nproc=2)
HEARTBEAT = HeartbeatInfo(node_id="node-0", incarnation=1, round=0, step=None, workers_alive=2)


def _free_port() -> int:
    """A port nothing listens on (the OS just handed it out and it was released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class _RawCodec(CodecBase):
    """Sends the bytes it is given as the message body: lets a test send garbage."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        assert isinstance(message, bytes)
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


async def test_server_binds_a_free_port_and_leaves_none_listening(token: str, listening_ports: Any) -> None:
    async with RpcServer([], token=token) as server:
        port = server.port
        assert port > 0
        assert port in listening_ports()
        assert server.address == f"127.0.0.1:{port}"
    assert port not in listening_ports()
    with pytest.raises(RuntimeError, match="inside `async with"):
        _ = server.port


async def test_server_exit_ends_open_command_streams_and_connections(backend: Any, token: str,
                                                                     call_timeout_s: float) -> None:
    backend.to_send = [StopNodeCmd(id="c1", reason="r")]
    backend.hold_open = True
    async with RpcServer([AgentServicer(backend)], token=token) as server:
        client = MasterClient(server.address, token, call_timeout_s=call_timeout_s)
        await client.__aenter__()
        commands = client.commands("node-0", 1)
        assert await anext(commands) == backend.to_send[0]
    try:
        with anyio.fail_after(10), pytest.raises(RpcUnavailable, match=r"connection to the master .* was lost"):
            await anext(commands)
        with anyio.fail_after(10):
            await backend.stream_closed.wait()
        with pytest.raises(RpcUnavailable):  # the old connection no longer serves calls either
            await client.heartbeat(HEARTBEAT)
    finally:
        await commands.aclose()
        await client.__aexit__(None, None, None)


async def test_garbage_bytes_do_not_take_the_server_down(server: RpcServer, client: MasterClient,
                                                         backend: Any) -> None:
    garbage = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not HTTP/2: the server drops the connection
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64,  # a frame that never completes
        bytes(range(256)) * 4,
    ]
    for data in garbage:
        async with await anyio.connect_tcp(server.host, server.port) as stream:
            await stream.send(data)
            assert await client.register(REGISTER) == backend.result


async def _raw_register(server: RpcServer, token: str, body: bytes) -> GRPCError:
    """Send ``body`` as a Register request's bytes; the error the server answers with."""
    channel = Channel(server.host, server.port, codec=_RawCodec())
    attach_token(channel, token)
    try:
        with pytest.raises(GRPCError) as caught:
            async with channel.request("/stead.v1.AgentService/Register", Cardinality.UNARY_UNARY, bytes, bytes,
                                       timeout=10) as stream:
                await stream.send_message(body, end=True)
                await stream.recv_message()
    finally:
        channel.close()
    return caught.value


@pytest.mark.parametrize("body", [b"\x08" + b"\x80" * 11 + b"\x01", b"\x1a\xff\xff\xff\xff\x0f"])
async def test_a_body_that_is_not_protobuf_is_invalid_argument(server: RpcServer, client: MasterClient,
                                                               token: str, backend: Any, body: bytes) -> None:
    error = await _raw_register(server, token, body)
    assert error.status == Status.INVALID_ARGUMENT
    assert backend.calls == 0
    assert await client.register(REGISTER) == backend.result  # the server still serves


async def test_a_message_over_the_size_limit_is_refused_before_it_is_decoded(backend: Any, token: str,
                                                                             call_timeout_s: float) -> None:
    async with RpcServer([AgentServicer(backend)], token=token, max_message_bytes=64 << 10) as server, \
            MasterClient(server.address, token, call_timeout_s=call_timeout_s) as client:
        host = b"h" * (65 << 10)  # field 3 (host), a well-formed message, just too big
        body = b"\x1a" + bytes([0x80 | (len(host) & 0x7F), 0x80 | (len(host) >> 7 & 0x7F), len(host) >> 14]) + host
        error = await _raw_register(server, token, body)
        assert error.status == Status.RESOURCE_EXHAUSTED
        assert f"a RegisterRequest of {len(body)} bytes is over this master's limit of 65536 bytes (setting " \
               "rpc_max_message_bytes)" in (error.message or "")
        assert backend.calls == 0
        assert await client.register(REGISTER) == backend.result  # the server still serves


async def test_clients_of_a_closed_port_raise_rpc_unavailable(token: str, call_timeout_s: float) -> None:
    address = f"127.0.0.1:{_free_port()}"
    async with MasterClient(address, token, call_timeout_s=call_timeout_s) as client:
        with pytest.raises(RpcUnavailable, match=r"cannot reach the master at 127\.0\.0\.1"):
            await client.register(REGISTER)
        with pytest.raises(RpcUnavailable):
            [command async for command in client.commands("node-0", 1)]


async def test_a_master_that_does_not_answer_in_time_is_unavailable(token: str) -> None:
    # A listening socket that never speaks HTTP/2: the call can only time out.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = format_address("127.0.0.1", silent.getsockname()[1])
        async with MasterClient(address, token, call_timeout_s=0.2) as client:
            with anyio.fail_after(10), pytest.raises(RpcUnavailable, match=r"did not answer within 0\.2s"):
                await client.heartbeat(HEARTBEAT)


async def test_binding_a_port_in_use_is_a_config_error(server: RpcServer, token: str) -> None:
    with pytest.raises(ConfigError, match="choose another port"):
        async with RpcServer([], token=token, port=server.port):
            pass


async def test_a_server_with_an_unusable_token_does_not_start(listening_ports: Callable[[], set[int]]) -> None:
    before = listening_ports()
    with pytest.raises(ConfigError):
        async with RpcServer([], token="not a token"):
            pass
    assert listening_ports() <= before


@pytest.mark.parametrize(("address", "expected"), [
    ("127.0.0.1:5000", ("127.0.0.1", 5000)),
    ("master.job.svc:80", ("master.job.svc", 80)),
    ("[::1]:5000", ("::1", 5000)),
])
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected
    assert format_address(*expected) == address


@pytest.mark.parametrize("address", ["", "host", "host:", ":5000", "host:0", "host:70000", "::1:5000", "h:x"])
def test_parse_address_rejects_malformed_addresses(address: str) -> None:
    with pytest.raises(ConfigError, match="host:port"):
        parse_address(address)


def test_clients_refuse_bad_settings() -> None:
    with pytest.raises(ConfigError, match="call_timeout_s"):
        MasterClient("127.0.0.1:1", new_token(), call_timeout_s=0)
    with pytest.raises(ConfigError, match="token"):
        MasterClient("127.0.0.1:1", "bad token", call_timeout_s=1)


async def test_a_client_used_outside_async_with_says_so(token: str) -> None:
    client = MasterClient("127.0.0.1:1", token, call_timeout_s=1)
    with pytest.raises(RuntimeError, match="inside `async with`"):
        await client.heartbeat(HEARTBEAT)


async def test_a_client_reconnects_to_a_restarted_master(backend: Any, token: str, call_timeout_s: float) -> None:
    async with RpcServer([AgentServicer(backend)], token=token) as first:
        port = first.port
        client = MasterClient(first.address, token, call_timeout_s=call_timeout_s)
        await client.__aenter__()
        assert await client.heartbeat(HEARTBEAT) is True
    try:
        with pytest.raises(RpcUnavailable):
            await client.heartbeat(HEARTBEAT)
        # The same port, just released by the first server: a master restarted at its old address.
        async with RpcServer([AgentServicer(backend)], token=token, port=port):
            assert await client.heartbeat(HEARTBEAT) is True
    finally:
        await client.__aexit__(None, None, None)
