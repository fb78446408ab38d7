"""The effect executor: each effect does what it says, through a recording platform and a real gateway's command
streams (what an agent receives); an effect it cannot run raises EffectDeclined or PlatformError."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.core.errors import EffectDeclined, PlatformError
from stead.core.events import DecisionTimeout, JobFailed, Record
from stead.core.master.executor import Executor
from stead.core.master.gateway import AgentGateway
from stead.core.master.rdzv_stores import HEALTH_STORE_ROUND, RoundStores
from stead.core.platform import WARM_FIRST_ENV, NodeSpec
from stead.core.rpc import (
    AgentCommand,
    CheckHealthCmd,
    DumpStacksCmd,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
    new_token,
)
from stead.core.statemachine import (
    AgentOrder,
    CheckHealth,
    DumpStacks,
    Emit,
    JobState,
    KillNode,
    LaunchNode,
    NodePhase,
    NodeState,
    RendezvousState,
    StartTimer,
    StartWorkers,
    StopNode,
    StopWorkers,
)
from stead.core.store import open_store
from stead.testing.platforms import RecordingPlatform

pytestmark = pytest.mark.anyio

JOB = "exec"
MASTER_ADDRESS = "127.0.0.1:4711"
#: the longest a test waits for a command on a stream (a bound for a broken test, not a measured time)
WAIT_S = 30.0


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    """The job's node spec factory: what it was given shows in the spec."""
    return NodeSpec(job=JOB, node_id=node_id, incarnation=incarnation, command=("stead", "agent", address, token_file),
                    env={"FOO": "bar"}, resources={"cpu": "4"})


class _Job:
    """The job's state as the gateway reads it: nodes joined (incarnation 1), round 1 running, no command in force;
    a test puts there the command the job machine would keep in force for the effect it runs."""

    def __init__(self, *nodes: str) -> None:
        self.state = JobState(nodes={n: NodeState(node_id=n, incarnation=1, phase=NodePhase.JOINED) for n in nodes},
                              rdzv=RendezvousState(round=1, members=nodes, active=True))

    def keep(self, order: AgentOrder) -> None:
        rdzv = self.state.rdzv
        if isinstance(order, StartWorkers):
            rdzv = dataclasses.replace(rdzv, round=order.round)
        self.state = dataclasses.replace(self.state, rdzv=rdzv, commands={**self.state.commands, order.node_id: order})

    def acknowledged(self) -> None:
        """Every agent acknowledged its command: none is in force."""
        self.state = dataclasses.replace(self.state, commands={})


@dataclasses.dataclass
class _Master:
    executor: Executor
    gateway: AgentGateway
    job: _Job
    platform: RecordingPlatform
    rounds: RoundStores


@pytest.fixture
async def master(tmp_path: Path) -> AsyncIterator[_Master]:
    """An executor with a recording platform, the job's spec factory, and a real gateway (no rendezvous host)."""
    async with RecordingPlatform() as platform:
        yield _master(tmp_path, _Job("node-0", "node-1"), platform, RoundStores("127.0.0.1", enabled=False))


def _master(tmp_path: Path, job: _Job, platform: RecordingPlatform | None, rounds: RoundStores, *,
            node_spec: bool = True) -> _Master:
    async def submit(event: object) -> Record:
        raise AssertionError(f"the executor made the gateway record {event!r}")

    gateway = AgentGateway(job=JOB, settings=Settings(), submit=submit, get_state=lambda: job.state,
                           store_addr=lambda: rounds.latest)
    executor = Executor(platform=platform, node_spec=_spec if node_spec else None,
                        commands=gateway.command_streams, rounds=rounds,
                        address=lambda: MASTER_ADDRESS, token_file=tmp_path / "job.token")
    return _Master(executor, gateway, job, platform or RecordingPlatform(), rounds)


async def _given(gateway: AgentGateway, node_id: str) -> AgentCommand:
    """The first command a new stream of ``node_id``'s agent gives (incarnation 1)."""
    commands = gateway.commands(node_id, 1)
    try:
        with anyio.fail_after(WAIT_S):
            return await commands.__anext__()
    finally:
        await commands.aclose()


# -- nodes, through the platform -----------------------------------------------------------------------------------

async def test_a_launch_starts_the_node_the_job_s_spec_factory_describes(master: _Master, tmp_path: Path) -> None:
    await master.executor.run(LaunchNode(node_id="node-1", incarnation=2))
    assert master.platform.launches == [("node-1", 2)]
    token_file = str((tmp_path / "job.token").resolve())
    assert master.platform.specs["node-1", 2] == _spec("node-1", 2, MASTER_ADDRESS, token_file)
    assert master.platform.running == {("node-1", 2)}


async def test_a_launch_keeps_the_node_off_excluded_hosts_warm_first_and_with_its_own_resources(
        master: _Master) -> None:
    await master.executor.run(LaunchNode(node_id="node-0", incarnation=3, avoid_hosts=("gpu-7",), warm_first=True,
                                         resources=(("memory", "64Gi"), ("cpu", "8"))))
    spec = master.platform.specs["node-0", 3]
    assert spec.avoid_hosts == ("gpu-7",)
    assert spec.env == {"FOO": "bar", WARM_FIRST_ENV: "1"}
    assert spec.resources == {"cpu": "8", "memory": "64Gi"}  # the effect's own win over the job's


async def test_a_kill_goes_to_the_platform(master: _Master) -> None:
    await master.executor.run(LaunchNode(node_id="node-0", incarnation=1))
    await master.executor.run(KillNode(node_id="node-0", incarnation=1))
    assert master.platform.kills == [("node-0", 1)]
    assert master.platform.running == frozenset()


async def test_without_a_platform_a_launch_is_declined_and_a_kill_does_nothing(tmp_path: Path) -> None:
    bare = _master(tmp_path, _Job("node-0"), None, RoundStores("127.0.0.1", enabled=False), node_spec=False)
    with pytest.raises(EffectDeclined, match="no platform launches node-0 here"):
        await bare.executor.run(LaunchNode(node_id="node-0", incarnation=1))
    await bare.executor.run(KillNode(node_id="node-0", incarnation=1))
    assert bare.executor.spec_for("node-0", 1) is None


async def test_a_platform_without_a_node_spec_factory_declines_a_launch(tmp_path: Path) -> None:
    async with RecordingPlatform() as platform:
        bare = _master(tmp_path, _Job("node-0"), platform, RoundStores("127.0.0.1", enabled=False), node_spec=False)
        with pytest.raises(EffectDeclined, match="no platform launches node-0 here"):
            await bare.executor.run(LaunchNode(node_id="node-0", incarnation=1))
    assert platform.launches == []


class _FullDisk(RecordingPlatform):
    async def launch(self, spec: NodeSpec) -> None:
        raise OSError(28, "No space left on device")


async def test_a_launch_the_os_refuses_is_a_platform_error_that_names_the_node_and_the_platform(
        tmp_path: Path) -> None:
    async with _FullDisk() as platform:
        full = _master(tmp_path, _Job("node-0"), platform, RoundStores("127.0.0.1", enabled=False))
        with pytest.raises(PlatformError, match=r"could not launch node-0 on the recording platform: .*No space left"):
            await full.executor.run(LaunchNode(node_id="node-0", incarnation=1))


async def test_a_platform_s_own_error_passes_unchanged(master: _Master) -> None:
    master.platform.close()
    with pytest.raises(PlatformError, match="the recording platform is closed"):
        await master.executor.run(LaunchNode(node_id="node-0", incarnation=1))


# -- workers, through the agents' command streams ------------------------------------------------------------------

async def test_a_round_s_start_is_given_to_the_node_s_agent_with_the_round_s_store(master: _Master) -> None:
    start = StartWorkers(node_id="node-1", incarnation=1, round=2, node_rank=1, nnodes=2, nproc_per_node=4,
                         restart_count=1)
    master.job.keep(start)
    await master.executor.run(start)
    host, port = master.rounds.latest
    assert await _given(master.gateway, "node-1") == StartWorkersCmd(
        id=start.id, round=2, node_rank=1, nnodes=2, nproc_per_node=4, world_size=8, restart_count=1,
        master_addr=host, master_port=port)


async def test_stops_are_given_to_the_node_s_agent(master: _Master) -> None:
    stop = StopWorkers(node_id="node-0", incarnation=1, round=1, reason="node-1 failed")
    master.job.keep(stop)
    await master.executor.run(stop)
    assert await _given(master.gateway, "node-0") == StopWorkersCmd(id=stop.id, round=1, reason="node-1 failed")
    end = StopNode(node_id="node-0", incarnation=1, reason="the job succeeded")
    master.job.keep(end)
    await master.executor.run(end)
    assert await _given(master.gateway, "node-0") == StopNodeCmd(id=end.id, reason="the job succeeded")


async def test_a_stack_dump_and_a_health_check_are_given_once_with_no_command_kept_in_force(master: _Master) -> None:
    dump = DumpStacks(node_id="node-0", incarnation=1, round=1, reason="rank 3 stalled", request=7)
    await master.executor.run(dump)
    assert await _given(master.gateway, "node-0") == DumpStacksCmd(id=dump.id, round=1, reason="rank 3 stalled")
    check = CheckHealth(node_id="node-1", incarnation=1, check=2, nodes=("node-0", "node-1"), timeout_s=30.0)
    await master.executor.run(check)
    host, port = master.rounds.latest
    assert await _given(master.gateway, "node-1") == CheckHealthCmd(
        id=check.id, check=2, nodes=("node-0", "node-1"), store_host=host, store_port=port, timeout_s=30.0)


async def test_each_round_and_the_health_checks_rendezvous_in_a_store_of_their_own(tmp_path: Path) -> None:
    """With the job's rendezvous host: every node of a round gets the round's store, a later round another, and a
    health check the health checks' store, which is neither."""
    store = await open_store("memory://")
    rounds = RoundStores("127.0.0.1", enabled=True, gone_timeout_s=WAIT_S)
    try:
        await rounds.start(store, JOB, new_token())
        async with RecordingPlatform() as platform:
            master = _master(tmp_path, _Job("node-0", "node-1"), platform, rounds)
            given: dict[tuple[str, int], tuple[str, int]] = {}
            for round_ in (1, 2):
                for rank, node in enumerate(("node-0", "node-1")):
                    start = StartWorkers(node_id=node, incarnation=1, round=round_, node_rank=rank, nnodes=2,
                                         nproc_per_node=1, restart_count=round_ - 1)
                    master.job.keep(start)
                    await master.executor.run(start)
                    command = await _given(master.gateway, node)
                    assert isinstance(command, StartWorkersCmd) and command.round == round_
                    given[node, round_] = (command.master_addr, command.master_port)
            master.job.acknowledged()
            check = CheckHealth(node_id="node-0", incarnation=1, check=1, nodes=("node-0", "node-1"), timeout_s=30.0)
            await master.executor.run(check)
            health = await _given(master.gateway, "node-0")
            assert isinstance(health, CheckHealthCmd)
        assert given["node-0", 1] == given["node-1", 1] and given["node-0", 2] == given["node-1", 2]
        assert given["node-0", 1] != given["node-0", 2]
        assert (health.store_host, health.store_port) == await rounds.for_round(HEALTH_STORE_ROUND)
        assert (health.store_host, health.store_port) not in given.values()
    finally:
        await rounds.close()
        await store.close()


# -- what is not the executor's ------------------------------------------------------------------------------------

@pytest.mark.parametrize("effect", [
    Emit(key="job-end", event=JobFailed(reason="test")),
    StartTimer(name=DecisionTimeout(round=1), at=0.0),
], ids=["emit", "start-timer"])
async def test_the_reactor_s_own_effects_are_refused(master: _Master, effect: Emit | StartTimer) -> None:
    with pytest.raises(PlatformError, match=f"{effect.kind} effects are the reactor's own, not the executor's"):
        await master.executor.run(effect)
    assert master.platform.launches == [] and master.platform.kills == []
