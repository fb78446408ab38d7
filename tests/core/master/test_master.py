"""The master end to end over real grpclib on loopback, and its resume from a store."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.core.errors import InvalidRequest, RpcUnavailable, StoreUnavailable
from stead.core.events import (
    JobStopped,
    JobSubmitted,
    PluginFailed,
    Record,
    RoundStarted,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.events.log import EventLog
from stead.core.master import Master, MasterConfig, MasterTaskFailed
from stead.core.master.rdzv_stores import HEALTH_STORE_ROUND, RoundStores
from stead.core.platform import NodeSpec, PlatformEvent
from stead.core.rpc import AgentReport, HeartbeatInfo, MasterClient, RegisterInfo, StartWorkersCmd, StopNodeCmd
from stead.core.statemachine import JobPhase, NodePhase
from stead.core.store import open_store
from stead.testing.platforms import RecordingPlatform

pytestmark = pytest.mark.anyio

FAST = Settings(heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0, retry_deadline_s=1.0)


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    return NodeSpec(job="t", node_id=node_id, incarnation=incarnation,
                    command=("stead", "agent", "--master", address, "--token-file", token_file))


def _config(tmp_path: Path, store_url: str, platform: RecordingPlatform, job: str, **kw: object) -> MasterConfig:
    return MasterConfig(job=job, store_url=store_url, settings=FAST, platform=platform, node_spec=_spec,
                        token_file=str(tmp_path / f"{job}.token"), tcp_store=False, plugins=[], **kw)  # type: ignore[arg-type]


def _job(nodes: int, **kw: object) -> JobSubmitted:
    return JobSubmitted(job="t", min_nodes=nodes, max_nodes=nodes, nproc_per_node=2, **kw)  # type: ignore[arg-type]


def _register(node: str, incarnation: int = 1) -> RegisterInfo:
    return RegisterInfo(node_id=node, incarnation=incarnation, host="localhost", pid=1, nproc=2)


async def _next(commands: AsyncIterator[object]) -> object:
    with anyio.fail_after(10):
        return await commands.__anext__()


async def test_registration_heartbeat_and_commands_work_end_to_end(tmp_path: Path) -> None:
    platform = RecordingPlatform()
    async with Master(_config(tmp_path, "memory://", platform, "e2e")) as master:
        await master.submit_job(_job(1))
        assert platform.launches == [("node-0", 1)]
        async with MasterClient(master.address, master.token, call_timeout_s=5) as client:
            reply = await client.register(_register("node-0"))
            assert reply.job == "e2e" and reply.heartbeat_interval_s == FAST.heartbeat_interval_s
            commands = client.commands("node-0", 1)
            start = await _next(commands)
            assert isinstance(start, StartWorkersCmd)
            assert (start.round, start.node_rank, start.world_size) == (1, 0, 2)
            beat = HeartbeatInfo(node_id="node-0", incarnation=1, round=1, step=None, workers_alive=2)
            assert await client.heartbeat(beat) is True
            assert await client.heartbeat(HeartbeatInfo(**{**beat.__dict__, "incarnation": 7})) is False
            with pytest.raises(InvalidRequest, match="node-9 incarnation 1 is not a live node"):
                await client.register(_register("node-9"))
            await client.report_workers(AgentReport(incarnation=1, event=WorkersStarted(node_id="node-0", round=1)))
            await client.heartbeat(HeartbeatInfo(**{**beat.__dict__, "step": 0}))
            await client.report_workers(AgentReport(incarnation=1, event=WorkersSucceeded(node_id="node-0", round=1)))
            state = await master.wait()
            assert state.phase is JobPhase.SUCCEEDED and state.step == 0
            assert isinstance(await _next(commands), StopNodeCmd)
            await commands.aclose()


async def test_a_restarted_master_resumes_with_the_same_state_and_no_repeated_effect(
    tmp_path: Path, store_url: str
) -> None:
    if store_url == "memory://":
        pytest.skip("a memory store does not outlive its master; resume needs sqlite or etcd")
    job = f"resume-{uuid.uuid4().hex[:6]}"
    first_platform, second_platform = RecordingPlatform(), RecordingPlatform()
    started = asyncio.Event()
    stop = asyncio.Event()
    state_before = None

    async def first_master() -> None:
        nonlocal state_before
        async with Master(_config(tmp_path, store_url, first_platform, job)) as master:
            await master.submit_job(_job(2))
            async with MasterClient(master.address, master.token, call_timeout_s=5) as client:
                await client.register(_register("node-0"))
            state_before = await master.reactor.wait_until(
                lambda s: s.nodes["node-1"].phase is NodePhase.STARTED and s.nodes["node-0"].phase is NodePhase.JOINED
            )
            started.set()
            await stop.wait()  # "mid-job": cancelled here

    task = asyncio.create_task(first_master())
    with anyio.fail_after(20):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async with Master(_config(tmp_path, store_url, second_platform, job)) as master:
        assert state_before is not None
        assert dataclasses.replace(master.state, seq=0) == dataclasses.replace(state_before, seq=0)
        assert master.state.nodes["node-0"].phase is NodePhase.JOINED
        await master.submit_job(_job(2))  # the same job again: resumed, not re-submitted
        async with MasterClient(master.address, master.token, call_timeout_s=5) as client:
            await client.register(_register("node-1"))
            state = await master.reactor.wait_until(lambda s: s.rdzv.round == 1)
    assert state.rdzv.members == ("node-0", "node-1")
    launches = first_platform.launches + second_platform.launches
    assert sorted(launches) == [("node-0", 1), ("node-1", 1)]
    assert sorted(second_platform.adoptions) == [("node-0", 1), ("node-1", 1)], "the running nodes were not adopted"
    store = await open_store(store_url)
    try:
        records = await EventLog(store, job).read()
    finally:
        await store.close()
    assert sum(isinstance(r.event, JobSubmitted) for r in records) == 1
    assert sum(isinstance(r.event, RoundStarted) for r in records) == 1


async def test_a_round_command_queued_by_a_master_that_died_reaches_the_agent_from_the_next(
    tmp_path: Path, store_url: str
) -> None:
    if store_url == "memory://":
        pytest.skip("a memory store does not outlive its master; resume needs sqlite or etcd")
    job = f"resend-{uuid.uuid4().hex[:6]}"
    async with Master(_config(tmp_path, store_url, RecordingPlatform(), job)) as master:
        await master.submit_job(_job(1))
        async with MasterClient(master.address, master.token, call_timeout_s=5) as client:
            await client.register(_register("node-0"))
        await master.reactor.wait_until(lambda s: s.rdzv.active)  # start-workers ran: queued, never read
    async with Master(_config(tmp_path, store_url, RecordingPlatform(), job)) as master, \
            MasterClient(master.address, master.token, call_timeout_s=5) as client:
        await client.register(_register("node-0"))
        command = await _next(client.commands("node-0", 1))
        assert isinstance(command, StartWorkersCmd) and (command.round, command.node_rank) == (1, 0)
        await client.report_workers(AgentReport(incarnation=1, event=WorkersStarted(node_id="node-0", round=1)))
        state = await master.reactor.wait_until(lambda s: s.rdzv.completed)
    assert state.rdzv.round == 1  # the same round, not a new one


class _Exploding:
    name = "exploding"
    subscriptions = (WorkerFailed, JobSubmitted)

    def __init__(self) -> None:
        self.calls = 0

    async def handle(self, *, record: Record, ctx: object) -> None:
        self.calls += 1
        raise RuntimeError("plugin bug")


async def test_a_failing_plugin_is_recorded_then_disabled_and_the_master_lives_on(tmp_path: Path) -> None:
    plugin = _Exploding()
    settings = Settings(plugin_max_failures=2, heartbeat_interval_s=0.05)
    config = MasterConfig(job="plug", settings=settings, token_file=str(tmp_path / "t"), tcp_store=False,
                          plugins=[], plugin_objects=[plugin])
    async with Master(config) as master:
        await master.submit_job(_job(1))
        for i in range(3):
            await master.submit(WorkerFailed(node_id="node-0", round=9, local_rank=0, rank=i))
        assert master.plugin_host is not None
        await master.plugin_host.drain()
        records = await master.reactor.log.read()
    failures = [r.event for r in records if isinstance(r.event, PluginFailed)]
    assert [f.disabled for f in failures] == [False, True]
    assert plugin.calls == 2
    assert "plugin bug" in failures[0].error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_store_that_is_down_at_start_gives_a_clear_error_after_retrying(tmp_path: Path) -> None:
    settings = Settings(retry_initial_s=0.05, store_connect_timeout_s=0.3, store_timeout_s=0.5)
    config = MasterConfig(job="down", store_url=f"etcd://127.0.0.1:{_free_port()}", settings=settings,
                          token_file=str(tmp_path / "t"), tcp_store=False)
    with pytest.raises(StoreUnavailable, match=r"is unreachable \(tried for 0\.3 s: .*raise store_connect_timeout_s"):
        async with Master(config):
            pass


async def test_a_node_whose_heartbeats_stop_is_lost_killed_and_relaunched(tmp_path: Path) -> None:
    platform = RecordingPlatform()
    settings = Settings(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
    config = MasterConfig(job="hb", settings=settings, platform=platform, node_spec=_spec, plugins=[],
                          token_file=str(tmp_path / "t"), tcp_store=False)
    async with Master(config) as master:
        await master.submit_job(_job(2))
        async with MasterClient(master.address, master.token, call_timeout_s=5) as client:
            await client.register(_register("node-0"))
            await client.register(_register("node-1"))
            await master.reactor.wait_until(lambda s: s.phase is JobPhase.RUNNING)
            beat = HeartbeatInfo(node_id="node-0", incarnation=1, round=1, step=None, workers_alive=2)
            with anyio.fail_after(20):
                while master.state.nodes["node-1"].incarnation == 1:  # node-0 keeps beating, node-1 is silent
                    await client.heartbeat(beat)
                    await anyio.sleep(0.05)
        state = master.state
    assert state.nodes["node-0"].phase is NodePhase.JOINED
    assert state.phase is JobPhase.RECOVERING and state.rdzv.active is False
    assert ("node-1", 1) in platform.kills and ("node-1", 2) in platform.launches


async def test_the_nodes_of_an_ended_job_may_go_quiet_while_they_stop_without_being_lost(tmp_path: Path) -> None:
    """Stopping, an agent writes its checkpoint to disk and beats no more: the platform's grace, not a loss."""
    platform = RecordingPlatform()
    settings = Settings(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.3)
    config = MasterConfig(job="quiet", settings=settings, platform=platform, node_spec=_spec, plugins=[],
                          token_file=str(tmp_path / "t"), tcp_store=False)
    async with Master(config) as master:
        await master.submit_job(_job(1))
        async with MasterClient(master.address, master.token, call_timeout_s=5) as client:
            await client.register(_register("node-0"))
            await master.reactor.wait_until(lambda s: s.phase is JobPhase.RUNNING)
            await master.submit(JobStopped(reason="stopped by SIGTERM"))
            await anyio.sleep(10 * settings.heartbeat_timeout_s)  # many timeouts without a beat
            state = master.state
    assert state.phase is JobPhase.STOPPED
    assert state.nodes["node-0"].phase is NodePhase.JOINED and state.nodes["node-0"].incarnation == 1
    assert platform.kills == []


class _BrokenPlatform(RecordingPlatform):
    """A platform whose event stream dies at once, every time it is read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def events(self) -> AsyncIterator[PlatformEvent]:  # type: ignore[override]
        self.reads += 1
        return self._fail()

    async def _fail(self) -> AsyncIterator[PlatformEvent]:
        raise RuntimeError("the platform's watch broke")
        yield  # an async generator


async def test_a_master_task_that_keeps_dying_is_restarted_then_stops_the_master_loudly(tmp_path: Path) -> None:
    platform = _BrokenPlatform()
    settings = Settings(master_task_max_failures=3, retry_initial_s=0.01, retry_max_s=0.02)
    config = MasterConfig(job="dying", settings=settings, platform=platform, node_spec=_spec, plugins=[],
                          token_file=str(tmp_path / "t"), tcp_store=False)
    with pytest.raises(MasterTaskFailed, match=r"platform-events task failed 3 times .*the platform's watch broke"):
        async with Master(config) as master:
            with anyio.fail_after(20):
                await master.wait()  # never ends by itself: the master must stop with the task's error
    assert platform.reads == 3


@contextlib.asynccontextmanager
async def round_stores() -> AsyncIterator[RoundStores]:
    store = await open_store("memory://")
    rounds = RoundStores("127.0.0.1", enabled=True, gone_timeout_s=30)
    try:
        await rounds.start(store, "rdzv", "token")
        yield rounds
    finally:
        await rounds.close()
        await store.close()


async def test_the_nodes_of_a_round_started_concurrently_share_one_rendezvous_store() -> None:
    async with round_stores() as rounds:
        addresses = await asyncio.gather(*(rounds.for_round(2) for _ in range(4)))
        assert len(set(addresses)) == 1 and rounds.latest == addresses[0]
        assert await rounds.for_round(1) != addresses[0] and rounds.latest == addresses[0]  # an older round's


async def test_the_health_checks_store_outlives_the_rounds_that_follow_it() -> None:
    async with round_stores() as rounds:
        health = await rounds.for_round(HEALTH_STORE_ROUND)  # the first check, before round 1
        for round_ in (1, 2, 3):
            await rounds.for_round(round_)
        assert await rounds.for_round(HEALTH_STORE_ROUND) == health  # a relaunched node's check, rounds later
        assert rounds.latest == await rounds.for_round(3)  # a check never becomes "the latest round"


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc shows them) something listens on at ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


async def test_the_rendezvous_store_listens_on_the_master_s_address_only_and_serves_workers() -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    async with round_stores() as rounds:
        host, port = await rounds.for_round(1)
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not every interface
        worker = TCPStore(host, port, is_master=False, use_libuv=True)
        worker.set("rank0", "here")
        assert worker.get("rank0") == b"here"
        del worker
        await rounds.for_round(2)
        _, newest = await rounds.for_round(3)
        assert listening_addresses(port) == set()  # round 1's store is freed two rounds later
    assert listening_addresses(newest) == set()


async def test_the_rendezvous_stores_outlive_a_master_that_dies_and_the_next_one_finds_them() -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = await open_store("memory://")
    try:
        first = RoundStores("127.0.0.1", enabled=True, gone_timeout_s=30)
        await first.start(store, "rdzv", "token")
        host, port = await first.for_round(4)
        worker = TCPStore(host, port, is_master=False, use_libuv=True)
        worker.set("rank0", "here")
        first._drop_connection()  # the master is killed: its connection closes, nothing else happens
        second = RoundStores("127.0.0.1", enabled=True, gone_timeout_s=30)
        await second.start(store, "rdzv", "token")
        try:
            assert await second.for_round(4) == (host, port), "the round's store was not the running one"
            assert TCPStore(host, port, is_master=False, use_libuv=True).get("rank0") == b"here"
        finally:
            del worker
            await second.close()
        assert listening_addresses(port) == set()
        assert await store.get("/stead/jobs/rdzv/rdzv-host") is None
    finally:
        await store.close()


async def test_a_master_that_takes_over_a_job_answers_with_the_job_s_token(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'job.db'}"
    config = MasterConfig(job="tok", store_url=url, settings=FAST, token_file=str(tmp_path / "t"), tcp_store=False,
                          plugins=[])
    async with Master(config) as first:
        token = first.token
        assert (tmp_path / "t").read_text().strip() == token
    async with Master(config) as second:
        assert second.token == token  # the agents and workers still running hold this one
        async with MasterClient(second.address, token, call_timeout_s=5) as client:
            await second.submit_job(_job(1))
            assert (await client.register(_register("node-0"))).job == "tok"
    async with Master(dataclasses.replace(config, job="other", token_file=str(tmp_path / "other"))) as unrelated:
        assert unrelated.token != token


async def test_a_node_gone_while_no_master_ran_is_relaunched_by_the_master_that_takes_over(tmp_path: Path) -> None:
    url, job = f"sqlite:///{tmp_path / 'job.db'}", "gone"
    first_platform = RecordingPlatform(auto_start=False)
    async with Master(_config(tmp_path, url, first_platform, job)) as first:
        await first.submit_job(_job(1))
        first_platform.start("node-0", 1, pid=4242)
        await first.reactor.wait_until(lambda s: s.nodes["node-0"].phase is NodePhase.STARTED, timeout_s=10)
        first_platform.abandon()
    second_platform = RecordingPlatform()
    second_platform.gone.add(("node-0", 1))
    async with Master(_config(tmp_path, url, second_platform, job)) as second:
        await second.reactor.wait_until(lambda s: s.nodes["node-0"].incarnation == 2
                                        and s.nodes["node-0"].phase is NodePhase.STARTED, timeout_s=10)
    assert second_platform.adoptions == [("node-0", 1)]
    assert second_platform.launches == [("node-0", 2)]


async def test_agents_are_told_to_retry_while_the_master_replays_its_log(tmp_path: Path) -> None:
    master = Master(_config(tmp_path, "memory://", RecordingPlatform(), "early"))
    beat = HeartbeatInfo(node_id="node-0", incarnation=1, round=1, step=None, workers_alive=2)
    with pytest.raises(RpcUnavailable, match="is starting"):
        await master.gateway.heartbeat(beat)
    with pytest.raises(RpcUnavailable, match="is starting"):
        await master.gateway.register(_register("node-0"))


class _StoreAwayAtAdoption(RecordingPlatform):
    """A platform whose adoption of the running nodes meets the store away again (an outage during a takeover);
    it records whether the master left its nodes (``detach``) or stopped them."""

    def __init__(self) -> None:
        super().__init__()
        self.detached = False

    async def adopt(self, spec: NodeSpec, *, pid: int | None) -> bool:
        await super().adopt(spec, pid=pid)
        raise StoreUnavailable("etcd at etcd://127.0.0.1:1 is unavailable")

    def detach(self) -> None:
        self.detached = True
        self.abandon()


async def test_a_takeover_master_that_meets_the_store_away_while_it_starts_leaves_the_nodes_running(
    tmp_path: Path, store_url: str
) -> None:
    if store_url == "memory://":
        pytest.skip("a memory store does not outlive its master; a takeover needs sqlite or etcd")
    job = f"away-{uuid.uuid4().hex[:6]}"
    first = RecordingPlatform()
    async with Master(_config(tmp_path, store_url, first, job)) as master:
        await master.submit_job(_job(1))
        await master.reactor.wait_until(lambda s: s.nodes["node-0"].phase is NodePhase.STARTED)
        first.abandon()  # the master dies; its node runs on
    second = _StoreAwayAtAdoption()
    with pytest.raises(StoreUnavailable, match="unavailable"):
        async with Master(_config(tmp_path, store_url, second, job, leave_nodes_on_failure=True)):
            pass
    assert second.adoptions == [("node-0", 1)]
    assert second.detached, "the master stopped the nodes it had just adopted instead of leaving them to the next one"
    assert not second.kills
