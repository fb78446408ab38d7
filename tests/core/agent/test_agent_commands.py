"""An agent applies a command id once, however often masters give it, and acknowledges it on its heartbeats."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import pytest

from stead.cli.run_args import parse_run_args
from stead.core.agent.main import Agent
from stead.core.config import Settings
from stead.core.errors import RpcUnavailable
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
    StartWorkersCmd,
    StopNodeCmd,
    new_token,
)

pytestmark = pytest.mark.anyio

SETTINGS = Settings(heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0, retry_initial_s=0.05, retry_max_s=0.2)
START = StartWorkersCmd(id="start-workers/1/node-0", round=1, node_rank=0, nnodes=1, nproc_per_node=1, world_size=1,
                        restart_count=0, master_addr="127.0.0.1", master_port=1)
STOP = StopNodeCmd(id="stop-node/node-0/1", reason="job succeeded")


class _DyingMaster:
    """Gives the round's start, breaks the stream once the workers are up (a master dying before it heard the
    acknowledgement), gives the start again on the next stream, then, once acknowledged, stops the node."""

    def __init__(self) -> None:
        self.streams = 0
        self.workers: list[str] = []
        self.acked: list[str] = []
        self._started = anyio.Event()
        self._acked = anyio.Event()

    async def register(self, info: RegisterInfo) -> RegisterResult:
        return RegisterResult(job="t", heartbeat_interval_s=SETTINGS.heartbeat_interval_s,
                              heartbeat_timeout_s=SETTINGS.heartbeat_timeout_s, store_host="127.0.0.1", store_port=1,
                              progress_interval_s=1.0)

    async def heartbeat(self, info: HeartbeatInfo) -> bool:
        self.acked.extend(info.acked)
        if self.streams > 1 and START.id in info.acked:
            self._acked.set()
        return True

    async def heartbeats(self, beats: Sequence[HeartbeatInfo]) -> list[str]:
        return []

    async def commands(self, node_id: str, incarnation: int) -> AsyncIterator[AgentCommand]:
        self.streams += 1
        yield START
        if self.streams == 1:
            await self._started.wait()
            raise RpcUnavailable("the master went away")
        await self._acked.wait()
        yield STOP

    async def report_workers(self, report: AgentReport[WorkersStarted | WorkersSucceeded]) -> None:
        self.workers.append("started" if isinstance(report.event, WorkersStarted) else "succeeded")
        self._started.set()

    async def report_failure(self, report: AgentReport[WorkerFailed]) -> None:
        raise AssertionError(f"no worker should fail here: {report}")

    async def report_stacks(self, report: AgentReport[StacksDumped]) -> None: ...

    async def report_health(self, report: AgentReport[NodeHealthReported]) -> None: ...


async def test_a_start_given_again_before_its_ack_was_heard_is_acknowledged_again_not_applied_again(
        tmp_path: Path) -> None:
    master, token = _DyingMaster(), new_token()
    config = parse_run_args(["--nnodes", "1", "--nproc-per-node", "1", "--no-python", "sleep", "60"],
                            cwd=str(tmp_path))
    async with RpcServer([AgentServicer(master)], token=token, token_file=str(tmp_path / "token")) as server, \
            MasterClient(server.address, token, call_timeout_s=10) as client:
        agent = Agent(client=client, config=config, node_id="node-0", incarnation=1, settings=SETTINGS)
        with anyio.fail_after(60):
            assert await agent.run() == 0
    assert master.streams == 2
    assert master.workers == ["started"]  # once: the second start was recognised by its id
    assert START.id in master.acked
