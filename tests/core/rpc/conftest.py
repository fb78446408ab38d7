"""Fixtures for the RPC tests: a fake AgentBackend behind a real server on loopback."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest

from stead.core.events import NodeHealthReported, StacksDumped, WorkerFailed, WorkersStarted, WorkersSucceeded
from stead.core.rpc import (
    AgentCommand,
    AgentReport,
    AgentServicer,
    HeartbeatInfo,
    MasterClient,
    RegisterInfo,
    RegisterResult,
    RpcServer,
    new_token,
)

#: generous: a call on loopback takes milliseconds; this only bounds a broken test
CALL_TIMEOUT_S = 10.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclasses.dataclass
class FakeBackend:
    """Records every call; behaviour is steered by its public fields."""

    result: RegisterResult = dataclasses.field(default_factory=lambda: RegisterResult(
        job="job-1", heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, store_host="127.0.0.1", store_port=29500,
        progress_interval_s=1.0))
    known: bool = True
    to_send: list[AgentCommand] = dataclasses.field(default_factory=list)
    #: keep the command stream open after sending ``to_send``
    hold_open: bool = False
    #: raised by every method when set
    error: Exception | None = None
    registered: list[RegisterInfo] = dataclasses.field(default_factory=list)
    heartbeats: list[HeartbeatInfo] = dataclasses.field(default_factory=list)
    failures: list[AgentReport[WorkerFailed]] = dataclasses.field(default_factory=list)
    workers: list[AgentReport[WorkersStarted | WorkersSucceeded]] = dataclasses.field(default_factory=list)
    subscribed: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    stacks: list[AgentReport[StacksDumped]] = dataclasses.field(default_factory=list)
    health: list[AgentReport[NodeHealthReported]] = dataclasses.field(default_factory=list)
    stream_closed: anyio.Event = dataclasses.field(default_factory=anyio.Event)

    @property
    def calls(self) -> int:
        return (len(self.registered) + len(self.heartbeats) + len(self.failures) + len(self.workers)
                + len(self.subscribed) + len(self.stacks) + len(self.health))

    def _maybe_fail(self) -> None:
        if self.error is not None:
            raise self.error

    async def register(self, info: RegisterInfo) -> RegisterResult:
        self.registered.append(info)
        self._maybe_fail()
        return self.result

    async def heartbeat(self, info: HeartbeatInfo) -> bool:
        self.heartbeats.append(info)
        self._maybe_fail()
        return self.known

    async def commands(self, node_id: str, incarnation: int) -> AsyncIterator[AgentCommand]:
        self.subscribed.append((node_id, incarnation))
        try:
            self._maybe_fail()
            for command in self.to_send:
                yield command
            if self.hold_open:
                await anyio.sleep_forever()
        finally:
            self.stream_closed.set()

    async def report_failure(self, report: AgentReport[WorkerFailed]) -> None:
        self.failures.append(report)
        self._maybe_fail()

    async def report_workers(self, report: AgentReport[WorkersStarted | WorkersSucceeded]) -> None:
        self.workers.append(report)
        self._maybe_fail()

    async def report_stacks(self, report: AgentReport[StacksDumped]) -> None:
        self.stacks.append(report)
        self._maybe_fail()

    async def report_health(self, report: AgentReport[NodeHealthReported]) -> None:
        self.health.append(report)
        self._maybe_fail()


@pytest.fixture
def call_timeout_s() -> float:
    return CALL_TIMEOUT_S


@pytest.fixture
def token() -> str:
    return new_token()


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def server(backend: FakeBackend, token: str) -> AsyncIterator[RpcServer]:
    handlers = [AgentServicer(backend)]
    async with RpcServer(handlers, token=token, token_file="/run/stead/job-1/token") as srv:
        yield srv


@pytest.fixture
async def client(server: RpcServer, token: str) -> AsyncIterator[MasterClient]:
    async with MasterClient(server.address, token, call_timeout_s=CALL_TIMEOUT_S) as master:
        yield master


def _listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture
def listening_ports() -> Callable[[], set[int]]:
    """The TCP ports something on this machine listens on (from /proc)."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs /proc/net/tcp (Linux) to list listening sockets")
    return _listening_ports
