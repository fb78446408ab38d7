"""200 simulated nodes (stead.testing.swarm) against a real master: rendezvous, mass failure, lost node, fencing."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.core.errors import InvalidRequest, RetryableError
from stead.core.events import JobSubmitted, NodeLost, RecoveryDecided, RoundStarted, StepProgress, WorkerFailed
from stead.core.master import Master, MasterConfig
from stead.core.platform import NodeSpec
from stead.core.rpc import HeartbeatInfo, MasterClient, RegisterInfo
from stead.core.statemachine import JobPhase, NodePhase
from stead.core.statemachine.job import node_ids
from stead.testing.platforms import RecordingPlatform
from stead.testing.swarm import Swarm

pytestmark = pytest.mark.anyio

N = 200
SETTINGS = Settings(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, progress_interval_s=0.2, health_check="off")


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    return NodeSpec(job="swarm", node_id=node_id, incarnation=incarnation, command=("simulated",))


def _config(tmp_path: Path, platform: RecordingPlatform) -> MasterConfig:
    return MasterConfig(job="swarm", store_url=f"sqlite:///{tmp_path / 'swarm.db'}", settings=SETTINGS,
                        platform=platform, node_spec=_spec, plugins=["diagnosis"], tcp_store=False,
                        token_file=str(tmp_path / "swarm.token"))


def _job() -> JobSubmitted:
    return JobSubmitted(job="swarm", min_nodes=N, max_nodes=N, nproc_per_node=1, max_restarts=10)


async def test_two_hundred_nodes_rendezvous_fail_together_lose_one_and_recover(tmp_path: Path) -> None:
    platform = RecordingPlatform()
    async with Master(_config(tmp_path, platform)) as master, Swarm(master.address, master.token) as swarm:
        await master.submit_job(_job())
        swarm.start(node_ids(N))
        await swarm.wait(lambda s: len(s.assigned(1)) == N)
        assert sorted(swarm.assigned(1).values()) == list(range(N))  # every node a unique rank

        swarm.set_step(5)
        await master.reactor.wait_until(lambda s: (s.step or 0) >= 5, timeout_s=60)

        # a mass failure: a quarter of the nodes report a worker failure at the same moment
        await swarm.fail(node_ids(N)[:N // 4], round=1)
        await swarm.wait(lambda s: len(s.assigned(2)) == N)
        assert sorted(swarm.assigned(2).values()) == list(range(N))

        # one node goes silent: declared lost, relaunched as incarnation 2, the round goes on without a restart
        victim = node_ids(N)[N // 2]
        swarm.silence(victim)
        await master.reactor.wait_until(lambda s: s.nodes[victim].incarnation == 2, timeout_s=60)
        assert (victim, 2) in platform.launches
        swarm.start([victim], incarnation=2)
        await swarm.wait(lambda s: len(s.assigned(3)) == N)
        async with MasterClient(master.address, master.token, call_timeout_s=10) as client:
            # the first agent of that node, come back: fenced by its incarnation, and told why
            with pytest.raises(InvalidRequest, match="stale"):
                await client.register(RegisterInfo(node_id=victim, incarnation=1, host="h", pid=1, nproc=1))
        assert sorted(swarm.assigned(3).values()) == list(range(N))
        records = await master.reactor.log.read()

    decisions = [r.event for r in records if isinstance(r.event, RecoveryDecided)]
    assert [d.round for d in decisions] == [1]  # the mass failure: one decision, not one per node
    assert len([r for r in records if isinstance(r.event, WorkerFailed)]) == N // 4  # each failure is on record
    lost = [r.event for r in records if isinstance(r.event, NodeLost)]
    assert [(e.node_id, e.incarnation) for e in lost] == [(victim, 1)]
    assert [r.event.round for r in records if isinstance(r.event, RoundStarted)] == [1, 2, 3]
    # heartbeats are not events; progress is recorded per round and interval, not per node
    assert len([r for r in records if isinstance(r.event, StepProgress)]) < 50


async def test_batched_heartbeats_keep_nodes_alive_and_name_the_ones_to_register_again(tmp_path: Path) -> None:
    platform = RecordingPlatform()
    async with Master(_config(tmp_path, platform)) as master, \
            Swarm(master.address, master.token, batch=50, interval_s=0.2) as swarm:
        await master.submit_job(_job())
        swarm.start(node_ids(N))
        await swarm.wait(lambda s: len(s.assigned(1)) == N)
        async with MasterClient(master.address, master.token, call_timeout_s=10) as client:
            beats = [HeartbeatInfo(node_id=n, incarnation=1, round=1, step=None, workers_alive=1)
                     for n in ("node-1", "node-2")]
            stale = HeartbeatInfo(node_id="node-4", incarnation=7, round=1, step=None, workers_alive=1)
            assert await client.heartbeats([*beats, stale]) == ["node-4"]
            with pytest.raises(InvalidRequest, match=r"HeartbeatBatch.beats\[0\].round"):
                await client.heartbeats([HeartbeatInfo(node_id="node-1", incarnation=1, round=-1, step=None,
                                                       workers_alive=1)])
        # the batched heartbeats keep every node alive: nobody is lost over several timeouts
        await anyio.sleep(2 * SETTINGS.heartbeat_timeout_s)
        assert master.state.phase is JobPhase.RUNNING
        assert platform.kills == []
        assert swarm.heartbeat_errors == 0 and len(swarm.latencies) > 0


async def test_a_master_running_late_sheds_registrations_with_a_retry_after_and_takes_them_when_it_caught_up(
        tmp_path: Path) -> None:
    platform = RecordingPlatform()
    async with Master(_config(tmp_path, platform)) as master:
        await master.submit_job(JobSubmitted(job="swarm", min_nodes=1, max_nodes=1, nproc_per_node=1))
        async with MasterClient(master.address, master.token, call_timeout_s=10) as client:
            info = RegisterInfo(node_id="node-0", incarnation=1, host="h", pid=1, nproc=1)
            refused: RetryableError | None = None
            for _ in range(5):  # the watcher measures the lag anew every 0.5 s: set it again if it did in between
                master.gateway.liveness.lag_s = 4.0  # what the watcher measures while a storm of calls holds it up
                try:
                    await client.register(info)
                except RetryableError as exc:
                    refused = exc
                    break
            assert refused is not None and "overloaded" in str(refused)
            assert refused.retry_after_s == pytest.approx(8.0)
            assert master.gateway.liveness.shed == 1
            master.gateway.liveness.lag_s = 0.0
            await client.register(info)
        assert master.state.nodes["node-0"].phase is NodePhase.JOINED


async def test_two_hundred_agents_come_back_to_a_restarted_master_without_a_new_round(tmp_path: Path) -> None:
    """The master dies (its platform leaves the nodes running); the next one, on the same socket and store, is
    found by every agent: they register again (with jittered backoff; a node it knows as joined is taken back
    even while it sheds new joins), and the job goes on in the same round, nobody lost."""
    listener = socket.create_server(("127.0.0.1", 0))
    first_platform = RecordingPlatform()
    config = dataclasses.replace(_config(tmp_path, first_platform), listen_fd=listener.fileno())
    try:
        async with Master(config) as master:
            swarm = Swarm(master.address, master.token)
            await swarm.__aenter__()
            try:
                await master.submit_job(_job())
                swarm.start(node_ids(N))
                await swarm.wait(lambda s: len(s.assigned(1)) == N)
                first_platform.abandon()  # the nodes outlive the master
            except BaseException:
                await swarm.stop()
                raise
        async with swarm, Master(dataclasses.replace(config, platform=RecordingPlatform())) as second:
            second.gateway.liveness.lag_s = 4.0  # even busy, it takes the nodes it knows back: their return is no event
            await swarm.wait(lambda s: all(n.registrations >= 2 for n in s.nodes.values()))
            assert second.gateway.liveness.shed == 0
            assert second.state.phase is JobPhase.RUNNING and second.state.rdzv.round == 1
            records = await second.reactor.log.read()
    finally:
        listener.close()
    assert not [r for r in records if isinstance(r.event, NodeLost)]
    assert [r.event.round for r in records if isinstance(r.event, RoundStarted)] == [1]
