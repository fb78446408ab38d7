"""ReportFailure is idempotent: the same failure reported again (the agent retried) is one ``worker.failed`` record."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from stead.core.config import Settings
from stead.core.errors import StoreUnavailable
from stead.core.events import Event, JobSubmitted, Record, WorkerFailed
from stead.core.events.log import EventLog
from stead.core.master import Master, MasterConfig
from stead.core.master.gateway import AgentGateway
from stead.core.platform import NodeSpec
from stead.core.rpc import AgentReport, MasterClient, RegisterInfo
from stead.core.statemachine import JobState, NodePhase, NodeState
from stead.core.store import open_store
from stead.testing.platforms import RecordingPlatform

pytestmark = pytest.mark.anyio

JOB = "failures"
FAILURE = AgentReport(incarnation=1, event=WorkerFailed(node_id="node-0", round=1, local_rank=0, rank=0, exit_code=1,
                                                       signal=None, step=3, error_tail="RuntimeError: boom"))


def _with(**changes: Any) -> AgentReport[WorkerFailed]:
    return AgentReport(incarnation=1, event=dataclasses.replace(FAILURE.event, **changes))


def _config(tmp_path: Path, store_url: str) -> MasterConfig:
    def spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
        return NodeSpec(job=JOB, node_id=node_id, incarnation=incarnation, command=("true",))

    return MasterConfig(job=JOB, store_url=store_url, settings=Settings(heartbeat_timeout_s=600.0),
                        platform=RecordingPlatform(), node_spec=spec, token_file=str(tmp_path / "token"),
                        tcp_store=False, plugins=[])


async def _failures(store_url: str) -> list[WorkerFailed]:
    store = await open_store(store_url)
    try:
        return [r.event for r in await EventLog(store, JOB).read() if isinstance(r.event, WorkerFailed)]
    finally:
        await store.close()


async def test_a_failure_reported_again_is_recorded_once_even_by_the_master_that_takes_over(tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    async with Master(_config(tmp_path, store_url)) as master:
        await master.submit_job(JobSubmitted(job=JOB, min_nodes=2, max_nodes=2, nproc_per_node=1))
        async with MasterClient(master.address, master.token, call_timeout_s=10) as agent0, \
                MasterClient(master.address, master.token, call_timeout_s=10) as agent1:
            for node, client in (("node-0", agent0), ("node-1", agent1)):
                await client.register(RegisterInfo(node_id=node, incarnation=1, host="localhost", pid=1, nproc=1))
            await master.reactor.wait_until(lambda s: s.rdzv.round == 1 and s.rdzv.active, timeout_s=10)
            # the first report and its retry, the retry arriving while the first is being recorded
            await asyncio.gather(agent0.report_failure(FAILURE), agent1.report_failure(FAILURE))
            await agent0.report_failure(FAILURE)  # a retry after the first was answered (its reply was lost)
            other = _with(node_id="node-1", rank=1, error_tail="collective")
            await agent1.report_failure(other)  # another rank's failure of the same round is a failure of its own
            await agent1.report_failure(other)
    assert [(f.node_id, f.rank) for f in await _failures(store_url)] == [("node-0", 0), ("node-1", 1)]

    async with Master(_config(tmp_path, store_url)) as master:  # a new master replays the job from the store
        assert master.state.last_failure is not None
        async with MasterClient(master.address, master.token, call_timeout_s=10) as agent0:
            await agent0.report_failure(FAILURE)  # the agent's retry reaches the master that took over
    assert [(f.node_id, f.rank) for f in await _failures(store_url)] == [("node-0", 0), ("node-1", 1)]


async def test_a_report_whose_recording_failed_is_recorded_by_its_retry() -> None:
    recorded: list[Event] = []
    attempts = 0

    async def submit(event: Event) -> Record:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise StoreUnavailable("the store did not answer")
        recorded.append(event)
        return Record(seq=len(recorded), at=0.0, event=event)

    state = JobState(nodes={"node-0": NodeState(node_id="node-0", incarnation=1, phase=NodePhase.JOINED)})
    gateway = AgentGateway(job=JOB, settings=Settings(), submit=submit, get_state=lambda: state,
                   store_addr=lambda: ("127.0.0.1", 1))
    with pytest.raises(StoreUnavailable):
        await gateway.report_failure(FAILURE)
    await gateway.report_failure(FAILURE)
    await gateway.report_failure(FAILURE)
    await gateway.report_failure(_with(round=2))  # a later round: a new failure
    assert [(e.round, e.rank) for e in recorded if isinstance(e, WorkerFailed)] == [(1, 0), (2, 0)]


async def test_a_report_whose_caller_went_away_and_whose_recording_then_failed_is_recorded_by_its_retry() -> None:
    """The agent's RPC deadline passes while the store is frozen; the append fails after that: the retry must
    record the failure, not be told it is a repeat of one that never reached the log."""
    recorded: list[Event] = []
    store_back = asyncio.Event()
    attempts = 0

    async def submit(event: Event) -> Record:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            await store_back.wait()  # the store is frozen...
            raise StoreUnavailable("the store did not answer")  # ...and the write fails once it thaws
        recorded.append(event)
        return Record(seq=len(recorded), at=0.0, event=event)

    state = JobState(nodes={"node-0": NodeState(node_id="node-0", incarnation=1, phase=NodePhase.JOINED)})
    gateway = AgentGateway(job=JOB, settings=Settings(), submit=submit, get_state=lambda: state,
                   store_addr=lambda: ("127.0.0.1", 1))
    first = asyncio.create_task(gateway.report_failure(FAILURE))
    await asyncio.sleep(0)  # the first report is being recorded
    first.cancel()  # its caller's deadline passed
    with pytest.raises(asyncio.CancelledError):
        await first
    retry = asyncio.create_task(gateway.report_failure(FAILURE))  # the agent retries while the first is pending
    await asyncio.sleep(0)
    store_back.set()
    await retry
    assert [(e.round, e.rank) for e in recorded if isinstance(e, WorkerFailed)] == [(1, 0)]
