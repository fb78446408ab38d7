"""The scaler's membership: its policy (tables), and `stead scale`'s RPC against a real master with simulated nodes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import anyio
import pytest

from stead.core.agent.extensions import AgentContext, RoundInfo
from stead.core.config import Settings
from stead.core.errors import ConfigError, InvalidRequest
from stead.core.events import (
    Event,
    JobSubmitted,
    MembershipDecided,
    NodeExited,
    NodePending,
    NodeResourcesDecided,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RoomFound,
    RoundStarted,
    TransitionRejected,
    WorkersSucceeded,
)
from stead.core.master import Master, MasterConfig
from stead.core.platform import NodeSpec
from stead.core.plugins import PluginContext
from stead.core.rpc import AgentReport, MasterClient, RpcServer, new_token, write_token_file
from stead.core.statemachine import JobPhase, JobState, NodePhase, NodeState, RendezvousState
from stead.core.store import open_store
from stead.plugins.scaler import ScalerPlugin, ScalerServicer, ScalerSettings
from stead.plugins.scaler._proto.stead import v1 as proto
from stead.plugins.scaler.agent import ScalerAgentExtension
from stead.plugins.scaler.client import request_scale
from stead.plugins.scaler.events import DecisionRejected, OomAnswered, PendingAnswered, ScaleRequested
from stead.plugins.scaler.membership import Decision, DefaultPolicy, MembershipView, check, load_policy
from stead.testing.platforms import RecordingPlatform
from stead.testing.swarm import Swarm


def view(**kw: object) -> MembershipView:
    base: dict[str, object] = dict(min_nodes=1, max_nodes=4, target=2, requested=None, capacity=None, live=2,
                                   ready=2, members=2, losses=0, phase="running")
    return MembershipView(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("seen", "decided"), [
    (view(), None),  # nothing asked: the target stays
    (view(requested=3), Decision(3, "3 nodes requested")),
    (view(requested=2), None),
    (view(requested=4, capacity=3),
     Decision(3, "4 nodes requested, capped by the platform's capacity (3, capacity_nodes)")),
    (view(target=4, capacity=3), Decision(3, "4 nodes to start with, capped by the platform's capacity "
                                             "(3, capacity_nodes)")),
    (view(min_nodes=2, requested=3, capacity=1, target=3),
     Decision(2, "3 nodes requested, capped by the platform's capacity (1, capacity_nodes)")),  # never below MIN
])
def test_the_default_policy_aims_at_the_request_capped_by_capacity_within_min_max(
        seen: MembershipView, decided: Decision | None) -> None:
    assert DefaultPolicy().decide(seen) == decided


@pytest.mark.parametrize(("returned", "problem"), [
    (None, ""),
    (Decision(3, "ok"), ""),
    (Decision(-1, "x"), "decided -1 nodes, outside the job's MIN:MAX 1:4"),
    (Decision(5, "x"), "decided 5 nodes, outside the job's MIN:MAX 1:4"),
    (Decision(True, "x"), "decided a target of True, not a whole number of nodes"),  # type: ignore[arg-type]
    (Decision(2.5, "x"), "decided a target of 2.5, not a whole number of nodes"),  # type: ignore[arg-type]
    (3, "returned 3, not a Decision or None"),
])
def test_a_decision_is_checked_before_it_is_recorded(returned: object, problem: str) -> None:
    assert check(returned, view()) == problem


def test_policies_load_by_name_and_an_unknown_one_is_a_clear_error() -> None:
    assert isinstance(load_policy("default"), DefaultPolicy)
    with pytest.raises(ConfigError, match=r"scaler policy 'cheapest' is not installed \(installed: default\)"):
        load_policy("cheapest")


def test_the_readme_policy_example_decides_as_it_says() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [code] = re.findall(r"<!-- run: scaler-policy -->\n```python\n(.*?)```", readme, flags=re.S)
    scope: dict[str, object] = {}
    exec(code, scope)
    policy = scope["AtLeastHalf"]()  # type: ignore[operator]
    assert policy.decide(view(requested=1, target=3)) == Decision(2, "at least half of MAX")  # MAX 4: not below 2
    assert policy.decide(view(requested=3)) == Decision(3, "at least half of MAX")
    assert policy.decide(view()) is None
    assert check(policy.decide(view(requested=4)), view()) == ""


class Nonsense:
    def decide(self, view: MembershipView) -> Decision | None:
        return Decision(view.max_nodes + 7, "more is better")


SETTINGS = Settings(heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0, health_check="off", capacity_nodes=2,
                    last_call_timeout_s=0.2)


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    return NodeSpec(job="elastic", node_id=node_id, incarnation=incarnation, command=("simulated",))


@pytest.mark.anyio
async def test_stead_scale_grows_and_shrinks_a_running_job_and_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    plugin = ScalerPlugin(settings=ScalerSettings(policy_every_s=3600))
    platform = RecordingPlatform()
    config = MasterConfig(job="elastic", store_url=f"sqlite:///{tmp_path / 'e.db'}", settings=SETTINGS,
                          platform=platform, node_spec=_spec, plugins=[], plugin_objects=[plugin], tcp_store=False,
                          token_file=str(tmp_path / "e.token"))
    async with Master(config) as master, Swarm(master.address, master.token) as swarm:
        await master.submit_job(JobSubmitted(job="elastic", min_nodes=1, max_nodes=3, nproc_per_node=1,
                                             start_nodes=1))
        swarm.start(["node-0"])
        await swarm.wait(lambda s: len(s.assigned(1)) == 1)

        async def scale(nodes: int) -> tuple[int, int, str]:
            got = await request_scale(master.address, master.token, nodes=nodes, by="test", reason="more data")
            return got.target, got.previous, got.reason

        target, previous, why = await scale(3)  # capacity_nodes=2 caps it
        assert (target, previous) == (2, 1) and "capped by the platform's capacity (2" in why
        await master.reactor.wait_until(lambda s: "node-1" in s.nodes, timeout_s=30)
        swarm.start(["node-1"])
        await swarm.wait(lambda s: len(s.assigned(2)) == 2)  # the round grew: node-0 kept rank 0
        assert swarm.assigned(2) == {"node-0": 0, "node-1": 1} and master.state.restarts == 0

        with pytest.raises(InvalidRequest, match=r"--nodes 5 is outside the job's MIN:MAX 1:3"):
            await scale(5)
        with pytest.raises(InvalidRequest, match=r"--nodes 0 is outside"):
            await scale(0)

        assert await scale(1) == (1, 2, "1 nodes requested")
        await swarm.wait(lambda s: len(s.assigned(3)) == 1)
        assert master.state.rdzv.members == ("node-0",) and "node-1" in master.state.retired

        plugin.policy = Nonsense()  # a third party's policy gone wrong: refused, recorded, the job keeps its size
        target, _, why = await scale(2)
        assert target == 1 and "outside the job's MIN:MAX 1:3" in why and "keeps 1 nodes" in why
        assert master.state.target_nodes == 1 and master.state.phase is JobPhase.RUNNING

        async with MasterClient(master.address, master.token, call_timeout_s=10) as client:
            await client.report_workers(AgentReport(incarnation=1, event=WorkersSucceeded(node_id="node-0", round=3)))
        await master.reactor.wait_until(lambda s: s.phase is JobPhase.SUCCEEDED, timeout_s=30)
        with pytest.raises(InvalidRequest, match=r"job 'elastic' has succeeded; only a running job can be scaled"):
            await scale(2)
        events = [r.event for r in await master.reactor.log.read()]
    assert [e.nodes for e in events if isinstance(e, ScaleRequested)] == [3, 1, 2]
    assert [e.target for e in events if isinstance(e, MembershipDecided)] == [2, 1]
    [rejected] = [e for e in events if isinstance(e, DecisionRejected)]
    assert rejected.policy == "default" and "Decision(target=10" in rejected.returned
    assert not [e for e in events if isinstance(e, TransitionRejected)]


@pytest.mark.anyio
async def test_an_oom_halves_the_batch_hint_within_its_budget_and_agents_pass_it_to_workers(tmp_path: Path) -> None:
    store = await open_store("memory://")
    events: list[Event] = []

    async def emit(event: Event) -> Record:
        events.append(event)
        return Record(seq=len(events), at=0.0, event=event)

    settings = ScalerSettings(oom_budget=2, oom_batch_factor=0.5)

    def context(handlers: list[object]) -> PluginContext[ScalerSettings]:
        return PluginContext(plugin="scaler", job="j", settings=settings, stead_settings=Settings(), store=store,
                             state=JobState, emit=emit, add_rpc_handler=handlers.append)

    handlers: list[object] = []
    plugin = ScalerPlugin(settings=settings)
    await plugin.start(ctx=context(handlers))
    oom = RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="r", rank=3, failure_class="oom")
    for seq in (7, 7, 9, 12):  # seq 7 twice: a master that took over replays it, answered once
        await plugin.handle(record=Record(seq=seq, at=0.0, event=oom), ctx=context([]))
    await plugin.handle(record=Record(seq=13, at=0.0, event=dataclasses.replace(oom, failure_class="transient")),
                        ctx=context([]))
    answered = [e for e in events if isinstance(e, OomAnswered)]
    assert [(e.ooms, e.batch_scale) for e in answered] == [(1, 0.5), (2, 0.25), (3, 0.25)]
    assert "STEAD_BATCH_SCALE=0.25" in answered[1].reason and "oom_budget 2 spent" in answered[2].reason

    await plugin.handle(record=Record(seq=14, at=0.0, event=RoundStarted(round=2, members=("node-0",),
                                                                        nproc_per_node=1, restart_count=1)),
                        ctx=context([]))  # the round the OOM restarted: its workers get the new scale at once
    token = new_token()
    token_file = tmp_path / "token"
    write_token_file(token_file, token)
    async with RpcServer(handlers, token=token) as server:  # type: ignore[arg-type]
        ext = ScalerAgentExtension(settings=settings)
        ctx = AgentContext(job="j", node_id="node-0", incarnation=1, nproc=1, settings=Settings(),
                           client=MasterClient(server.address, token, call_timeout_s=5),
                           master_address=server.address, token_file=str(token_file), workdir=tmp_path)
        await ext.start(ctx=ctx)
        assert await ext.worker_env(round=1, local_rank=0) == {}  # nothing asked yet: unchanged batches
        await ext.before_round(round=RoundInfo(id="start/2", round=2, node_rank=0, nnodes=1, nproc_per_node=1,
                                               world_size=1, restart_count=1, master_addr="127.0.0.1",
                                               master_port=1))
        assert await ext.worker_env(round=2, local_rank=0) == {"STEAD_BATCH_SCALE": "0.25"}
        await ext.stop(job_ended=True)
    await plugin.stop(ctx=context([]))
    restarted = ScalerPlugin(settings=settings)  # a master that takes over keeps the scale
    await restarted.start(ctx=context([]))
    assert (restarted.ooms, restarted.batch_scale) == (3, 0.25)
    await restarted.stop(ctx=context([]))
    await store.close()


@pytest.mark.anyio
async def test_a_node_killed_for_its_memory_gets_more_within_the_budget_and_the_cap() -> None:
    store = await open_store("memory://")
    events: list[Event] = []

    async def emit(event: Event) -> Record:
        events.append(event)
        return Record(seq=len(events), at=0.0, event=event)

    settings = ScalerSettings(oom_memory_factor=1.5, oom_memory_budget=2, max_memory="16Gi")
    running = JobState(phase=JobPhase.RUNNING, nodes={
        "node-0": NodeState(node_id="node-0", incarnation=1, resources=(("cpu", "4"), ("memory", "8Gi"))),
        "node-1": NodeState(node_id="node-1", incarnation=1)})

    def context(state: JobState) -> PluginContext[ScalerSettings]:
        return PluginContext(plugin="scaler", job="j", settings=settings, stead_settings=Settings(), store=store,
                             state=lambda: state, emit=emit, add_rpc_handler=lambda _: None)

    plugin = ScalerPlugin(settings=settings)
    await plugin.start(ctx=context(running))
    limits = ["8Gi", "12Gi", "16Gi", "16Gi"]
    for seq, limit in enumerate(limits, start=10):  # each relaunch reports the limit it got
        state = dataclasses.replace(running, nodes={**running.nodes, "node-0": NodeState(
            node_id="node-0", incarnation=seq, resources=(("cpu", "4"), ("memory", limit)))})
        killed = NodeExited(node_id="node-0", incarnation=seq, signal=9, reason="OOMKilled", oom=True)
        await plugin.handle(record=Record(seq=seq, at=0.0, event=killed), ctx=context(state))
    await plugin.handle(record=Record(seq=13, at=0.0, event=killed), ctx=context(state))  # replayed: answered once
    await plugin.handle(record=Record(seq=20, at=0.0, event=NodeExited(node_id="node-1", incarnation=1, oom=True)),
                        ctx=context(running))
    decided = [e for e in events if isinstance(e, NodeResourcesDecided)]
    assert [dict(e.resources).get("memory") for e in decided] == ["12Gi", "16Gi", "16Gi", "16Gi", None]
    assert all(dict(e.resources).get("cpu") == "4" for e in decided[:4])
    assert "relaunched with 12Gi (x1.5, raise 1 of 2)" in decided[0].reason
    assert "already at max_memory" in decided[2].reason or "budget" in decided[2].reason
    assert "oom_memory_budget 2 spent" in decided[3].reason
    assert "no memory limit to raise" in decided[4].reason and decided[4].node_id == "node-1"
    await plugin.stop(ctx=context(running))
    restarted = ScalerPlugin(settings=settings)  # a master that takes over keeps the count
    await restarted.start(ctx=context(running))
    assert restarted.memory_raises == {"node-0": 2}
    await restarted.stop(ctx=context(running))
    await store.close()


@pytest.mark.anyio
@pytest.mark.parametrize(("min_nodes", "decision", "target"), [(1, "give_up", 1), (2, "wait", None)])
async def test_a_node_the_platform_has_no_room_for_is_given_up_while_min_holds(min_nodes: int, decision: str,
                                                                              target: int | None) -> None:
    store = await open_store("memory://")
    events: list[Event] = []

    async def emit(event: Event) -> Record:
        events.append(event)
        return Record(seq=len(events), at=0.0, event=event)

    spec = JobSubmitted(job="j", min_nodes=min_nodes, max_nodes=2, nproc_per_node=1)
    state = JobState(phase=JobPhase.RUNNING, spec=spec, nodes={
        "node-0": NodeState(node_id="node-0", incarnation=1, phase=NodePhase.JOINED),
        "node-1": NodeState(node_id="node-1", incarnation=1, pending="not scheduled for 120 s: Unschedulable")})
    settings = ScalerSettings(pending_retry_s=300.0)
    ctx = PluginContext(plugin="scaler", job="j", settings=settings, stead_settings=Settings(), store=store,
                        state=lambda: state, emit=emit, add_rpc_handler=lambda _: None)
    plugin = ScalerPlugin(settings=settings)
    await plugin.start(ctx=ctx)
    pending = NodePending(node_id="node-1", incarnation=1, pending_s=120.0, reason="Unschedulable: 0/3 nodes")
    await plugin.handle(record=Record(seq=5, at=0.0, event=pending), ctx=ctx)
    [answered] = [e for e in events if isinstance(e, PendingAnswered)]
    assert answered.decision == decision and "Unschedulable: 0/3 nodes" in answered.reason
    decided = [e.target for e in events if isinstance(e, MembershipDecided)]
    assert decided == ([target] if target is not None else [])
    if target is not None:
        assert "asks for more again in 300 s" in answered.reason
        view = plugin.view(ctx)
        assert view is not None and view.capacity == 1 and "room" in view.capacity_source
        # a host offers itself with no node to run: the node given up on is asked for again at once
        state = dataclasses.replace(state, target=1)
        await plugin.handle(record=Record(seq=6, at=0.0, event=RoomFound(reason="host h2 offered itself")), ctx=ctx)
        assert [e.target for e in events if isinstance(e, MembershipDecided)] == [1, 2]
        view = plugin.view(ctx)
        assert view is not None and view.capacity is None
    else:
        assert "fails after join_timeout_s" in answered.reason
    await plugin.stop(ctx=ctx)
    await store.close()


@pytest.mark.anyio
async def test_the_batch_hint_of_a_round_the_job_has_not_started_is_answered_at_once() -> None:
    store = await open_store("memory://")
    state = JobState(phase=JobPhase.RUNNING, rdzv=RendezvousState(round=1, active=True))

    async def emit(event: Event) -> Record:
        return Record(seq=1, at=0.0, event=event)

    # a round the job started would be waited for rpc_timeout_s / 2 = 30 min here: round 99 may never start
    ctx = PluginContext(plugin="scaler", job="j", settings=ScalerSettings(),
                        stead_settings=Settings(rpc_timeout_s=3600.0), store=store, state=lambda: state, emit=emit,
                        add_rpc_handler=lambda _: None)
    servicer = ScalerServicer(ScalerPlugin(), ctx)
    with anyio.fail_after(60):
        reply = await servicer.batch_hint(proto.BatchHintRequest(node_id="node-0", round=99))
    assert reply.batch_scale == 1.0
    await store.close()
