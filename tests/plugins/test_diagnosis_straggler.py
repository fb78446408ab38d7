"""Straggler detection: the pure watch over each node's own time per step, and the agent's measure of it."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stead.core.agent.pace import StepPace
from stead.core.config import Settings
from stead.core.events import Event, Record
from stead.core.plugins import NodeTelemetry, PluginContext
from stead.core.statemachine.job import JobPhase, JobState
from stead.core.statemachine.rendezvous import RendezvousState
from stead.core.store import open_store
from stead.core.worker.progress import StepProgress
from stead.plugins.diagnosis import DiagnosisPlugin, DiagnosisSettings, StragglerDetected
from stead.plugins.diagnosis.straggler import StragglerWatch, median_without

MEMBERS = ("node-0", "node-1", "node-2")


def watch(window_s: float = 10.0) -> StragglerWatch:
    return StragglerWatch(factor=1.5, window_s=window_s)


def test_a_node_over_the_factor_for_the_whole_window_is_flagged_once() -> None:
    w = watch()
    slow = {"node-0": 0.10, "node-1": 0.11, "node-2": 0.30}
    assert w.observe(slow, members=MEMBERS, now=0.0) == ([], [])
    assert w.observe(slow, members=MEMBERS, now=9.0) == ([], [])
    flagged, cleared = w.observe(slow, members=MEMBERS, now=10.0)
    assert [(f.node_id, f.compute_s, f.median_s) for f in flagged] == [("node-2", 0.30, pytest.approx(0.105))]
    assert round(flagged[0].ratio, 2) == 2.86 and cleared == []
    assert w.observe(slow, members=MEMBERS, now=20.0) == ([], [])  # reported once


def test_a_break_in_the_window_starts_it_again() -> None:
    w = watch()
    w.observe({"node-0": 0.1, "node-1": 0.4}, members=MEMBERS, now=0.0)
    w.observe({"node-0": 0.1, "node-1": 0.12}, members=MEMBERS, now=5.0)  # back under: not consistent
    assert w.observe({"node-0": 0.1, "node-1": 0.4}, members=MEMBERS, now=11.0) == ([], [])
    flagged, _ = w.observe({"node-0": 0.1, "node-1": 0.4}, members=MEMBERS, now=21.0)
    assert [f.node_id for f in flagged] == ["node-1"]


def test_with_two_nodes_the_slow_one_is_compared_with_the_fast_one() -> None:
    w = watch(window_s=0.0)
    flagged, _ = w.observe({"node-0": 1.0, "node-1": 2.0}, members=MEMBERS, now=0.0)
    assert [f.node_id for f in flagged] == ["node-1"]


def test_a_flagged_node_is_cleared_after_a_window_under_the_factor_or_at_once_when_it_leaves() -> None:
    w = watch(window_s=5.0)
    w.observe({"node-0": 0.1, "node-1": 0.1, "node-2": 0.5}, members=MEMBERS, now=0.0)
    w.observe({"node-0": 0.1, "node-1": 0.1, "node-2": 0.5}, members=MEMBERS, now=5.0)
    assert set(w.flagged) == {"node-2"}
    w.observe({"node-0": 0.1, "node-1": 0.1, "node-2": 0.1}, members=MEMBERS, now=6.0)
    assert w.observe({"node-0": 0.1, "node-1": 0.1, "node-2": 0.1}, members=MEMBERS, now=11.0) == ([], ["node-2"])
    w.observe({"node-0": 0.1, "node-1": 0.5}, members=MEMBERS, now=20.0)
    w.observe({"node-0": 0.1, "node-1": 0.5}, members=MEMBERS, now=25.0)
    assert w.observe({"node-0": 0.1}, members=("node-0",), now=26.0) == ([], ["node-1"])


@given(st.lists(st.floats(0.0, 100.0), min_size=2, max_size=40), st.data())
def test_the_median_of_the_others_read_off_one_sorted_list_is_the_median_of_the_others(
        values: list[float], data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(values) - 1))
    others = values[:index] + values[index + 1:]
    assert median_without(sorted(values), values[index]) == pytest.approx(statistics.median(others))


@given(st.lists(st.floats(0.001, 100.0), min_size=2, max_size=16), st.floats(1.0, 1.49))
def test_nodes_within_the_factor_of_each_other_are_never_flagged(bases: list[float], spread: float) -> None:
    """Any mix of node speeds within 1.5x of each other, over any time, flags nobody."""
    low = min(bases)
    figures = {f"node-{i}": low * (1 + (spread - 1) * ((b - low) / (max(bases) - low or 1)))
               for i, b in enumerate(bases)}
    w = watch(window_s=0.0)
    for now in range(5):
        assert w.observe(figures, members=list(figures), now=float(now)) == ([], [])


# -- the agent's measure ------------------------------------------------------------------------------------


def read(step: int, at: float, backward: float, pid: int = 7, phase: str = "") -> StepProgress:
    return StepProgress(step=step, time=at, pid=pid, phase=phase, backward_s=backward)


def test_own_time_per_step_leaves_out_the_time_inside_backward() -> None:
    pace = StepPace(min_samples=2)
    # rank 0 sleeps 0.3 s of its own per step; rank 1 waits for it inside backward()
    for i in range(4):
        pace.observe({0: read(i, i * 0.4, i * 0.05), 1: read(i, i * 0.4, i * 0.35, pid=8)})
    assert pace.compute_s(2) == pytest.approx(0.35)  # the node's figure is its slowest rank's


def test_no_figure_before_every_rank_has_enough_steps_nor_across_a_new_worker_or_a_phase() -> None:
    pace = StepPace(min_samples=2)
    pace.observe({0: read(1, 1.0, 0.0)})
    pace.observe({0: read(2, 2.0, 0.5)})
    assert pace.compute_s(1) is None  # one sample
    pace.observe({0: read(3, 3.0, 0.4, pid=9)})  # a new worker: its backward clock started again
    pace.observe({0: read(4, 9.0, 0.4, phase="eval")})  # a phase is not a step's time
    assert pace.compute_s(1) is None
    pace.observe({0: read(5, 10.0, 0.9)})
    assert pace.compute_s(1) is None
    pace.observe({0: read(7, 12.0, 1.9)})  # two steps at once: per step
    assert pace.compute_s(1) == pytest.approx(0.5)
    assert pace.compute_s(2) is None  # the other rank has not reported
    pace.reset()
    assert pace.compute_s(1) is None


def seen(compute_s: float) -> NodeTelemetry:
    return NodeTelemetry(incarnation=1, round=1, step=10, step_compute_s=compute_s, rss_bytes=None,
                         cpu_percent=None, seen=0.0)


@pytest.mark.anyio
async def test_a_straggler_flagged_during_the_job_is_still_shown_after_it_ended() -> None:
    running = JobState(phase=JobPhase.RUNNING, rdzv=RendezvousState(round=1, members=("node-0", "node-1"),
                                                                    active=True))
    state, emitted = running, list[Event]()
    telemetry = {"node-0": seen(0.02), "node-1": seen(0.3)}

    async def emit(event: Event) -> Record:
        emitted.append(event)
        return Record(seq=len(emitted), at=0.0, event=event)

    plugin = DiagnosisPlugin(settings=DiagnosisSettings(straggler_window_s=0.0))
    store = await open_store("memory://")
    try:
        ctx = PluginContext(plugin="diagnosis", job="j", settings=plugin.settings, stead_settings=Settings(),
                            store=store, state=lambda: state, emit=emit, add_rpc_handler=None,
                            telemetry=lambda: telemetry)
        await plugin._check_stragglers(ctx)
        state = dataclasses.replace(running, phase=JobPhase.SUCCEEDED,
                                    rdzv=dataclasses.replace(running.rdzv, active=False))
        telemetry = {}
        await plugin._check_stragglers(ctx)
        await plugin._write_status(ctx, force=True)
        kv = await store.get(ctx.key("status"))
        assert kv is not None
        shown = json.loads(kv.value)
    finally:
        await store.close()
    assert [type(e) for e in emitted] == [StragglerDetected]  # the job's end clears nothing
    assert list(shown["stragglers"]) == ["node-1"]
    assert any(line.startswith("straggler node-1: 0.300 s") for line in shown["summary"]), shown["summary"]
