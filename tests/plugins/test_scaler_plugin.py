"""The scaler plugin against a real master: what simulated nodes report becomes figures and a recommendation."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from stead.core.config import Settings
from stead.core.events import JobSubmitted, JobSucceeded, WorkersSucceeded
from stead.core.master import Master, MasterConfig
from stead.core.platform import NodeSpec
from stead.core.rpc import AgentReport, MasterClient
from stead.core.statemachine import JobPhase
from stead.core.statemachine.job import node_ids
from stead.core.views.top import published_lines
from stead.plugins.scaler import ResourcesRecommended, ScalerPlugin, ScalerSettings
from stead.testing import FakeClock, settle
from stead.testing.platforms import RecordingPlatform
from stead.testing.swarm import Swarm

pytestmark = pytest.mark.anyio

GI = 1 << 30
#: the master watches heartbeats on its (fake) clock: longer than the LOOKS sampling periods the test moves it on
SETTINGS = Settings(heartbeat_interval_s=0.1, heartbeat_timeout_s=600.0, health_check="off")
#: the plugin's looks at the nodes' figures before the job ends
LOOKS = 3
#: the longest a test waits for the simulated nodes' heartbeats (a guard against a hang, not a measured time)
WAIT_S = 30.0


async def _next_heartbeats(master: Master, clock: FakeClock, nodes: list[str],
                           usage: dict[str, tuple[int | None, float | None]]) -> None:
    """Until every node's heartbeat came since the master's clock last moved, saying its ``usage`` (the simulated
    nodes beat in real time; the master stamps each heartbeat, and the plugin looks, on its clock)."""

    def came() -> bool:
        now = master.gateway.telemetry()
        return all(node_id in now and now[node_id].seen >= clock.now()
                   and (now[node_id].rss_bytes, now[node_id].cpu_percent) == usage.get(node_id, (None, None))
                   for node_id in nodes)

    deadline = time.monotonic() + WAIT_S
    while not came():
        if time.monotonic() > deadline:
            pytest.fail(f"the simulated nodes' heartbeats did not all come again within {WAIT_S:g} s: "
                        f"{master.gateway.telemetry()} at {clock.now()}")
        await anyio.sleep(SETTINGS.heartbeat_interval_s / 2)


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    return NodeSpec(job="usage", node_id=node_id, incarnation=incarnation, command=("simulated",))


async def _run(tmp_path: Path, plugin: ScalerPlugin, *, usage: dict[str, tuple[int | None, float | None]],
               ) -> tuple[list[ResourcesRecommended], list[str]]:
    """Three nodes report ``usage``; the plugin looks LOOKS times (its clock moved on after each node's next
    heartbeat); then the job succeeds."""
    clock = FakeClock()
    config = MasterConfig(job="usage", settings=SETTINGS, platform=RecordingPlatform(), node_spec=_spec, plugins=[],
                          plugin_objects=[plugin], tcp_store=False, token_file=str(tmp_path / "usage.token"),
                          clock=clock)
    nodes = node_ids(3)
    async with Master(config) as master, Swarm(master.address, master.token) as swarm:
        await master.submit_job(JobSubmitted(job="usage", min_nodes=3, max_nodes=3, nproc_per_node=1))
        swarm.start(nodes)
        await swarm.wait(lambda s: len(s.assigned(1)) == 3)
        for node_id, (rss, cpu) in usage.items():
            swarm.set_usage(node_id, rss_bytes=rss, cpu_percent=cpu)
        looked = plugin.looks
        for _ in range(LOOKS):
            await _next_heartbeats(master, clock, nodes, usage)
            await clock.advance(plugin.settings.sample_every_s)
        assert plugin.looks == looked + LOOKS * len(nodes)  # each look took each node's new heartbeat, once
        async with MasterClient(master.address, master.token, call_timeout_s=10) as client:
            for node_id in nodes:
                await client.report_workers(AgentReport(incarnation=1,
                                                        event=WorkersSucceeded(node_id=node_id, round=1)))
        await master.reactor.wait_until(lambda s: s.phase is JobPhase.SUCCEEDED, timeout_s=30)
        await settle(master)  # the plugin has handled the job's end: its recommendation is recorded
        records = await master.reactor.log.read()
        shown = await published_lines(master.store, "usage")
    assert any(isinstance(r.event, JobSucceeded) for r in records)
    return [r.event for r in records if isinstance(r.event, ResourcesRecommended)], shown


async def test_the_job_end_records_peaks_and_a_recommendation_and_status_shows_them(tmp_path: Path) -> None:
    plugin = ScalerPlugin(settings=ScalerSettings(headroom=0.2))
    usage = {"node-0": (3 * GI, 150.0), "node-1": (int(11.2 * GI), 90.0), "node-2": (None, None)}
    [made], shown = await _run(tmp_path, plugin, usage=usage)
    assert made.nodes == 2  # node-2 reported nothing: not counted, and not as zeros
    assert made.memory_peak_bytes == int(11.2 * GI) and made.memory_recommend_bytes == 14 * GI
    assert made.cpu_peak_cores == pytest.approx(1.5) and made.cpu_recommend_cores == 2.0
    assert made.gpu_memory_peak_bytes is None and made.gpu_util_median_percent is None  # no GPU: unknown
    assert made.lines[0] == "memory: peak 11.2Gi, p95 11.2Gi per node; recommend 14Gi"
    assert any("recommend 14Gi" in line for line in shown), shown


async def test_nodes_that_report_nothing_give_no_figures_not_zeros(tmp_path: Path) -> None:
    plugin = ScalerPlugin(settings=ScalerSettings())
    [made], shown = await _run(tmp_path, plugin, usage={})
    assert (made.nodes, made.memory_peak_bytes, made.cpu_peak_cores, made.lines) == (0, None, None, ())
    assert any("no node has reported its use yet" in line for line in shown), shown
