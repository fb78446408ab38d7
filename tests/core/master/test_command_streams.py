"""The agents' commands through a real master: given until acknowledged, resent by the next master from the log."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.core.events import CommandsAcked, JobStopped, JobSubmitted, WorkerFailed, WorkersStarted
from stead.core.events.log import EventLog
from stead.core.master import Master, MasterConfig
from stead.core.platform import NodeSpec
from stead.core.rpc import (
    AgentCommand,
    AgentReport,
    HeartbeatInfo,
    MasterClient,
    RegisterInfo,
    StartWorkersCmd,
    StopNodeCmd,
)
from stead.core.store import open_store
from stead.testing.platforms import RecordingPlatform

pytestmark = pytest.mark.anyio

FAST = Settings(heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0, retry_deadline_s=1.0)


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    return NodeSpec(job="t", node_id=node_id, incarnation=incarnation, command=("stead", "agent"))


@contextlib.asynccontextmanager
async def _serving(tmp_path: Path, store_url: str, job: str, nodes: tuple[str, ...], *,
                   submit: bool = True) -> AsyncIterator[tuple[Master, MasterClient]]:
    """A master of ``job`` (submitted, unless it resumes one) with ``nodes`` registered, and a client of it."""
    config = MasterConfig(job=job, store_url=store_url, settings=FAST, platform=RecordingPlatform(), node_spec=_spec,
                          token_file=str(tmp_path / f"{job}.token"), tcp_store=False, plugins=[])
    async with Master(config) as master, MasterClient(master.address, master.token, call_timeout_s=5) as client:
        if submit:
            await master.submit_job(_job(len(nodes)))
        for node in nodes:
            await client.register(_register(node))
        yield master, client


def _job(nodes: int) -> JobSubmitted:
    return JobSubmitted(job="t", min_nodes=nodes, max_nodes=nodes, nproc_per_node=1, max_restarts=3)


def _register(node: str) -> RegisterInfo:
    return RegisterInfo(node_id=node, incarnation=1, host="localhost", pid=1, nproc=1)


def _beat(node: str, *acked: str) -> HeartbeatInfo:
    return HeartbeatInfo(node_id=node, incarnation=1, round=1, step=None, workers_alive=1, acked=acked)


async def _first(client: MasterClient, node: str) -> AgentCommand:
    """The first command a new stream of ``node`` gives."""
    commands = client.commands(node, 1)
    try:
        with anyio.fail_after(10):
            return await commands.__anext__()
    finally:
        await commands.aclose()


async def _acks(store_url: str, job: str) -> list[CommandsAcked]:
    store = await open_store(store_url)
    try:
        return [r.event for r in await EventLog(store, job).read() if isinstance(r.event, CommandsAcked)]
    finally:
        await store.close()


def _resumable(store_url: str) -> None:
    if store_url == "memory://":
        pytest.skip("a memory store does not outlive its master; a takeover needs sqlite or etcd")


async def test_a_command_is_given_on_every_new_stream_until_acknowledged_and_its_ack_recorded_once(
        tmp_path: Path) -> None:
    async with _serving(tmp_path, "memory://", "acks", ("node-0",)) as (master, client):
        first, again = await _first(client, "node-0"), await _first(client, "node-0")
        assert isinstance(first, StartWorkersCmd) and first == again  # the stream broke before any ack
        assert await client.heartbeat(_beat("node-0", first.id))
        await master.wait(lambda s: not s.commands)
        # the same ack again, and acks of nothing awaited: taken without a word to the log
        assert await client.heartbeat(_beat("node-0", first.id, "start-workers/9/node-0", "dump-stacks/3/node-0"))
        await master.submit(JobStopped(reason="test over"))
        assert isinstance(await _first(client, "node-0"), StopNodeCmd)  # the start is not given again
        records = [r.event for r in await EventLog(master.store, "acks").read() if isinstance(r.event, CommandsAcked)]
    assert [[a.command_id for a in r.acks] for r in records] == [[first.id]]


async def test_the_acknowledgements_of_many_nodes_taken_together_are_one_record(tmp_path: Path) -> None:
    nodes = tuple(f"node-{i}" for i in range(40))
    async with _serving(tmp_path, "memory://", "many", nodes) as (master, client):
        state = await master.wait(lambda s: s.rdzv.active)
        assert len(state.commands) == len(nodes)
        assert await client.heartbeats([_beat(n, f"start-workers/1/{n}") for n in nodes]) == []
        await master.wait(lambda s: not s.commands)
        records = [r.event for r in await EventLog(master.store, "many").read() if isinstance(r.event, CommandsAcked)]
    assert len(records) == 1 and sorted(a.node_id for a in records[0].acks) == sorted(nodes)


async def test_a_master_that_takes_over_resends_what_was_not_acknowledged_and_nothing_else(
        tmp_path: Path, store_url: str) -> None:
    _resumable(store_url)
    job = f"takeover-{uuid.uuid4().hex[:6]}"
    async with _serving(tmp_path, store_url, job, ("node-0", "node-1")) as (master, client):
        starts = {node: await _first(client, node) for node in ("node-0", "node-1")}
        assert await client.heartbeat(_beat("node-0", starts["node-0"].id))  # node-1's ack is lost with the master
        await master.wait(lambda s: set(s.commands) == {"node-1"})
    async with _serving(tmp_path, store_url, job, ("node-0", "node-1"), submit=False) as (master, client):
        assert await _first(client, "node-1") == starts["node-1"]
        await master.submit(JobStopped(reason="test over"))
        assert isinstance(await _first(client, "node-0"), StopNodeCmd)  # its acknowledged start was not resent
    assert [[a.command_id for a in r.acks] for r in await _acks(store_url, job)] == [[starts["node-0"].id]]


async def test_a_start_superseded_by_a_later_round_is_not_resent_by_the_next_master(
        tmp_path: Path, store_url: str) -> None:
    _resumable(store_url)
    job = f"superseded-{uuid.uuid4().hex[:6]}"
    async with _serving(tmp_path, store_url, job, ("node-0", "node-1")) as (master, client):
        first = await _first(client, "node-0")
        assert isinstance(first, StartWorkersCmd) and first.round == 1
        await client.report_workers(AgentReport(incarnation=1, event=WorkersStarted(node_id="node-1", round=1)))
        await client.report_failure(AgentReport(incarnation=1, event=WorkerFailed(
            node_id="node-1", round=1, local_rank=0, rank=1, exit_code=1, signal=None, step=None,
            error_tail="reset")))
        await master.wait(lambda s: s.rdzv.round == 2 and s.rdzv.active)  # restarted by the built-in policy
    async with _serving(tmp_path, store_url, job, ("node-0",), submit=False) as (_, client):
        resent = await _first(client, "node-0")
    assert isinstance(resent, StartWorkersCmd) and (resent.round, resent.id) == (2, "start-workers/2/node-0")
