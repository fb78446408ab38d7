"""The job token: generation, token files, and rejection of calls without the right one."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.errors import ConfigError, Unauthenticated
from stead.core.rpc import (
    AUTH_METADATA_KEY,
    MasterClient,
    RegisterInfo,
    RpcServer,
    attach_token,
    check_token,
    new_token,
    read_token_file,
    write_token_file,
)
from stead.plugin import proto

pytestmark = pytest.mark.anyio

REGISTER = RegisterInfo(node_id="node-0", incarnation=1, host="host-a", pid=4242, nproc=2)


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="stead-rpc-auth-") as path:
        yield Path(path)


def test_new_tokens_are_random_and_fit_in_a_header() -> None:
    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(check_token(t) == t and len(t) >= 40 for t in tokens)


@pytest.mark.parametrize("bad", ["", "with space", "new\nline", "caf\u00e9"])
def test_tokens_that_cannot_travel_in_a_header_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="token file"):
        check_token(bad)


def test_token_file_round_trip_is_private_to_the_user(scratch: Path) -> None:
    token = new_token()
    path = write_token_file(scratch / "job" / "token", token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token_file(path) == token
    replacement = new_token()
    write_token_file(path, replacement)
    assert read_token_file(path) == replacement
    assert sorted(p.name for p in path.parent.iterdir()) == ["token"]  # no temporary file left


def test_reading_a_missing_or_malformed_token_file_says_what_to_do(scratch: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist: pass the token file"):
        read_token_file(scratch / "absent")
    (scratch / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="does not hold a valid token"):
        read_token_file(scratch / "empty")


def test_a_token_file_others_can_read_is_still_read(scratch: Path) -> None:
    path = scratch / "token"
    path.write_text("abc\n")
    os.chmod(path, 0o644)  # e.g. a Kubernetes secret mounted with its default mode: warned about, not refused
    assert read_token_file(path) == "abc"


async def _raw_register(server: RpcServer, token: str | None) -> GRPCError:
    channel = Channel(server.host, server.port)
    if token is not None:
        attach_token(channel, token)
    try:
        with pytest.raises(GRPCError) as caught:
            await proto.AgentServiceStub(channel).register(
                proto.RegisterRequest(node_id="n", incarnation=1, host="h", pid=1, nproc=1), timeout=10)
    finally:
        channel.close()
    return caught.value


async def test_a_call_without_a_token_is_unauthenticated(server: RpcServer, backend: Any) -> None:
    error = await _raw_register(server, None)
    assert error.status == Status.UNAUTHENTICATED
    assert "missing job token" in (error.message or "")
    assert "pass the job's token file: stead writes it to /run/stead/job-1/token" in (error.message or "")
    assert backend.calls == 0


async def test_a_call_with_a_wrong_token_is_unauthenticated(server: RpcServer, backend: Any) -> None:
    error = await _raw_register(server, new_token())
    assert error.status == Status.UNAUTHENTICATED
    assert "wrong job token" in (error.message or "")
    assert backend.calls == 0


async def test_a_malformed_authorization_header_is_unauthenticated(server: RpcServer, token: str) -> None:
    channel = Channel(server.host, server.port)
    try:
        for value in (token, f"Basic {token}", f"Bearer {token}x", "Bearer "):
            with pytest.raises(GRPCError) as caught:
                await proto.AgentServiceStub(channel).register(proto.RegisterRequest(), timeout=10,
                                                         metadata={AUTH_METADATA_KEY: value})
            assert caught.value.status == Status.UNAUTHENTICATED
    finally:
        channel.close()


async def test_clients_with_a_wrong_token_raise_unauthenticated(server: RpcServer, backend: Any,
                                                                call_timeout_s: float) -> None:
    async with MasterClient(server.address, new_token(), call_timeout_s=call_timeout_s) as client:
        with pytest.raises(Unauthenticated, match="refused the job token"):
            await client.register(REGISTER)
        with pytest.raises(Unauthenticated):
            [command async for command in client.commands("node-0", 1)]
    assert backend.calls == 0


async def test_every_method_checks_the_token(server: RpcServer, backend: Any) -> None:
    channel = Channel(server.host, server.port)
    stub = proto.AgentServiceStub(channel)

    async def commands() -> None:
        async for _ in stub.commands(proto.CommandsRequest(node_id="n", incarnation=1), timeout=10):
            pass

    async def beat_stream() -> None:  # another job's agent (or anything else) flooding the heartbeat stream
        flood = [proto.HeartbeatRequest(node_id=f"n{i}", incarnation=1) for i in range(1000)]
        async for _ in stub.heartbeat_stream(flood, timeout=10):
            pass

    calls = [
        lambda: stub.heartbeat(proto.HeartbeatRequest(node_id="n", incarnation=1), timeout=10),
        lambda: stub.heartbeats(proto.HeartbeatBatch(beats=[proto.HeartbeatRequest(node_id=f"n{i}", incarnation=1)
                                                      for i in range(1000)]), timeout=10),
        beat_stream,
        lambda: stub.report_failure(proto.FailureReport(node_id="n", incarnation=1), timeout=10),
        lambda: stub.report_workers(proto.WorkersReport(node_id="n", incarnation=1), timeout=10),
        commands,
    ]
    try:
        for call in calls:
            with pytest.raises(GRPCError) as caught:
                await call()
            assert caught.value.status == Status.UNAUTHENTICATED
    finally:
        channel.close()
    assert backend.calls == 0
