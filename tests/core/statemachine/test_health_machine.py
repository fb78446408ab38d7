"""Node health checks: the pairings, the verdict, and the job stories around them (folded like the reactor)."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
from hypothesis import given

from stead.core.events import (
    CheckHealthId,
    EffectFailed,
    Event,
    HealthChecked,
    HealthCheckStarted,
    HealthTimeout,
    JobSubmitted,
    NodeHealthReported,
    NodeJoined,
    NodeLost,
    NodeStarted,
    PeerCollective,
    RoundStarted,
    TimerFired,
    WorkersStarted,
)
from stead.core.statemachine import CheckHealth, JobPhase, LaunchNode, StartWorkers
from stead.core.statemachine.health import judge, needs_check, participants, stages
from stead.core.statemachine.state import HealthState
from stead.testing.replay import fold

SPEC = JobSubmitted(job="j", min_nodes=3, max_nodes=3, nproc_per_node=1, max_restarts=2, max_node_relaunches=1,
                    health_check="all", health_timeout_s=30.0)


def up(*nodes: str, inc: int = 1) -> list[Event]:
    return [e for n in nodes
            for e in (NodeStarted(node_id=n, incarnation=inc, host=f"host-{n}-{inc}"),
                      NodeJoined(node_id=n, incarnation=inc, host=f"host-{n}-{inc}"))]


def report(node: str, check: int, matmul_s: float | None = 0.01, *, inc: int = 1, error: str = "",
           peers: tuple[tuple[str, float | None], ...] = ()) -> NodeHealthReported:
    return NodeHealthReported(node_id=node, incarnation=inc, check=check, matmul_s=matmul_s, error=error,
                              collectives=tuple(PeerCollective(peer=p, seconds=s, error="" if s else "timed out")
                                                for p, s in peers))


# -- pure parts ---------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "incarnation", "first", "expected"), [
    ("off", 1, 1, False), ("off", 3, 1, False),
    ("relaunched", 1, 1, False), ("relaunched", 2, 1, True), ("relaunched", 4, 4, False),  # first of a resumed run
    ("all", 1, 1, True), ("all", 5, 4, True),
])
def test_which_node_incarnations_are_checked(mode: str, incarnation: int, first: int, expected: bool) -> None:
    assert needs_check(mode, incarnation, first) is expected


def test_a_lone_node_under_check_gets_a_trusted_partner() -> None:
    assert participants(["node-2"], ["node-0", "node-1"]) == ("node-2", "node-0")
    assert participants(["node-2"], []) == ("node-2",)
    assert participants(["node-1", "node-2"], ["node-0"]) == ("node-1", "node-2")


@pytest.mark.parametrize(("times", "expected"), [
    ([0.1], []),
    ([0.1, 0.2], [[(0, 1)]]),
    ([0.1, 0.2, 0.3], [[(0, 1)], [(0, 2)]]),
    ([0.1, 0.4, 0.2, 0.3], [[(0, 1), (2, 3)], [(0, 3), (1, 2)]]),  # slowest (1) with the fastest it has not met
    ([None, 0.1, 0.2, 0.3], [[(0, 1), (2, 3)], [(0, 2), (1, 3)]]),  # a failed matmul counts as slowest
])
def test_pairings_neighbours_first_then_slowest_with_fastest(times: list[float | None],
                                                              expected: list[list[tuple[int, int]]]) -> None:
    assert stages(len(times), times) == expected


@given(st.lists(st.one_of(st.none(), st.floats(min_value=0, max_value=10)), min_size=1, max_size=40))
def test_pairings_are_disjoint_per_stage_never_repeat_and_leave_no_node_alone(times: list[float | None]) -> None:
    plan = stages(len(times), times)
    assert len(plan) <= 3
    seen: set[tuple[int, int]] = set()
    for pairs in plan:
        members = [i for pair in pairs for i in pair]
        assert len(members) == len(set(members))  # one collective at a time per node
        for a, b in pairs:
            assert 0 <= a < b < len(times)
            assert (a, b) not in seen
            seen.add((a, b))
    paired = {i for pair in seen for i in pair}
    assert paired == (set(range(len(times))) if len(times) > 1 else set())


def checking(*nodes: str, trusted: tuple[str, ...] = (), reports: tuple[NodeHealthReported, ...] = ()) -> HealthState:
    everyone = (*nodes, *trusted)
    return HealthState(check=1, nodes=everyone, incarnations=dict.fromkeys(everyone, 1), checked=frozenset(nodes),
                       reports={r.node_id: r for r in reports})


def verdict(health: HealthState, *, gone: tuple[str, ...] = ()) -> dict[str, str]:
    alive = {n: n not in gone for n in health.nodes}
    checked = judge(check=1, health=health, alive=alive, slow_factor=2.0, timeout_s=30.0)
    return {v.node_id: v.reason for v in checked.failed}


def test_healthy_nodes_pass() -> None:
    health = checking("a", "b", "c", reports=(report("a", 1, 0.010, peers=(("b", 0.01), ("c", 0.01))),
                                               report("b", 1, 0.012, peers=(("a", 0.01),)),
                                               report("c", 1, 0.019, peers=(("a", 0.01),))))
    assert verdict(health) == {}  # 0.019 is 1.7x the others' median: within the factor


def test_a_node_more_than_twice_as_slow_as_the_median_of_the_others_fails() -> None:
    health = checking("a", "b", "c", reports=(report("a", 1, 0.010), report("b", 1, 0.011), report("c", 1, 0.025)))
    assert verdict(health) == {"c": "matmul took 0.025 s, 2.4x the median 0.010 s of the other nodes (limit 2x)"}


def test_a_broken_or_missing_report_fails_its_node_but_a_node_that_left_gets_no_verdict() -> None:
    health = checking("a", "b", "c", "d", reports=(report("a", 1), report("b", 1, None, error="matmul: boom")))
    assert verdict(health, gone=("d",)) == {"b": "the check failed: matmul: boom",
                                            "c": "no health report within 30 s (health_timeout_s)"}


def test_a_trusted_partner_is_never_failed_by_another_nodes_check() -> None:
    health = checking("new", trusted=("old",), reports=(report("new", 1, 0.01, peers=(("old", None),)),
                                                        report("old", 1, 0.5, peers=(("new", None),))))
    assert verdict(health) == {"new": "every all-reduce failed while old worked with others (with old: timed out)"}


def test_collectives_blame_the_node_whose_partners_worked_with_others() -> None:
    health = checking("a", "b", "c", reports=(report("a", 1, peers=(("b", None), ("c", None))),
                                               report("b", 1, peers=(("a", None), ("c", 0.01))),
                                               report("c", 1, peers=(("b", 0.01), ("a", None)))))
    assert list(verdict(health)) == ["a"]


def test_a_collective_with_a_partner_that_left_blames_no_one() -> None:
    health = checking("new", trusted=("old",), reports=(report("new", 1, 0.01, peers=(("old", None),)),))
    assert verdict(health, gone=("old",)) == {}


def test_a_pair_that_only_failed_with_each_other_fails_both() -> None:
    health = checking("a", "b", reports=(report("a", 1, peers=(("b", None),)), report("b", 1, peers=(("a", None),))))
    assert set(verdict(health)) == {"a", "b"}


# -- job stories ---------------------------------------------------------------------


def healthy(check: int, *nodes: str, inc: int = 1) -> list[Event]:
    return [report(n, check, 0.01, inc=inc) for n in nodes]


def test_every_node_is_checked_before_the_first_round() -> None:
    state, effects, rejections = fold([SPEC, *up("node-0", "node-1", "node-2")])
    assert rejections == []
    assert state.phase is JobPhase.STARTING and state.ready == () and state.health.nodes == (
        "node-0", "node-1", "node-2")
    assert [e.id for e in effects if isinstance(e, CheckHealth)] == [
        "check-health/1/node-0", "check-health/1/node-1", "check-health/1/node-2"]
    assert not any(isinstance(e, StartWorkers) for e in effects)

    state, effects, rejections = fold([SPEC, *up("node-0", "node-1", "node-2"),
                                       *healthy(1, "node-0", "node-1", "node-2")])
    assert rejections == []
    assert state.phase is JobPhase.RUNNING and not state.health.running
    assert [e.node_id for e in effects if isinstance(e, StartWorkers)] == ["node-0", "node-1", "node-2"]


def test_a_node_that_fails_its_check_is_relaunched_elsewhere_and_the_new_one_checked_with_a_partner() -> None:
    events: list[Event] = [SPEC, *up("node-0", "node-1", "node-2"), report("node-0", 1, 0.010),
                           report("node-1", 1, 0.011), report("node-2", 1, 0.050)]
    state, effects, rejections = fold(events)
    assert rejections == []
    assert state.nodes["node-2"].incarnation == 2 and state.excluded_hosts == {"host-node-2-1"}
    assert [e for e in effects if isinstance(e, LaunchNode)][-1] == LaunchNode(
        node_id="node-2", incarnation=2, avoid_hosts=("host-node-2-1",))
    assert not any(isinstance(e, StartWorkers) for e in effects)  # nobody trains before the third node is good
    checked = [e for e in state_log(events) if isinstance(e, HealthChecked)]
    assert [(v.node_id, v.reason.split(",")[0]) for v in checked[0].failed] == [("node-2", "matmul took 0.050 s")]

    more = [*events, *up("node-2", inc=2)]
    state, effects, rejections = fold(more)
    assert state.health.nodes == ("node-2", "node-0")  # the newcomer and a trusted partner
    state, effects, rejections = fold([*more, *healthy(2, "node-0"), *healthy(2, "node-2", inc=2)])
    assert rejections == []
    assert state.phase is JobPhase.RUNNING
    assert [(e.node_id, e.incarnation) for e in effects if isinstance(e, StartWorkers)] == [
        ("node-0", 1), ("node-1", 1), ("node-2", 2)]


def test_relaunched_mode_checks_only_a_relaunched_node() -> None:
    spec = dataclasses.replace(SPEC, min_nodes=2, max_nodes=2, health_check="relaunched")
    events: list[Event] = [spec, *up("node-0", "node-1")]
    state, _, _ = fold(events)
    assert state.phase is JobPhase.RUNNING and state.health.check == 0
    events += [WorkersStarted(node_id="node-0", round=1), NodeLost(node_id="node-1", incarnation=1),
               *up("node-1", inc=2)]
    state, _, rejections = fold(events)
    assert rejections == []
    assert state.health.nodes == ("node-1", "node-0") and state.ready == ("node-0",)
    assert [e.round for e in state_log(events) if isinstance(e, RoundStarted)] == [1]  # round 2 waits for the check


def test_the_timer_decides_a_check_whose_reports_do_not_all_come() -> None:
    events: list[Event] = [SPEC, *up("node-0", "node-1", "node-2"), *healthy(1, "node-0", "node-1"),
                           TimerFired(name=HealthTimeout(check=1))]
    state, _, rejections = fold(events)
    assert rejections == []
    assert state.nodes["node-2"].incarnation == 2  # failed for its silence, relaunched
    [checked] = [e for e in state_log(events) if isinstance(e, HealthChecked)]
    assert "no health report within 30 s" in checked.failed[0].reason


def test_stale_reports_are_ignored_and_a_second_check_cannot_start_while_one_runs() -> None:
    events: list[Event] = [SPEC, *up("node-0", "node-1", "node-2"), report("node-0", 7),
                           HealthCheckStarted(check=2, nodes=("node-0",), checked=("node-0",))]
    state, _, rejections = fold(events)
    assert len(rejections) == 1 and "cannot start after check 1 (still running)" in rejections[0]
    assert state.health.reports == {}


def test_a_check_that_cannot_be_started_lets_its_nodes_in_unchecked() -> None:
    failed = EffectFailed(effect_id=CheckHealthId(check=1, node_id="node-1"), kind="check-health", error="KeyError: 0",
                          node_id="node-1", incarnation=1)
    events: list[Event] = [SPEC, *up("node-0", "node-1", "node-2"), failed]
    state, _, rejections = fold(events)
    assert rejections == []
    assert state.phase is JobPhase.RUNNING and not state.health.running
    [checked] = [e for e in state_log(events) if isinstance(e, HealthChecked)]
    assert checked.failed == () and checked.skipped == "the check could not be started on node-1: KeyError: 0"


def test_a_bad_health_spec_is_refused_with_the_modes() -> None:
    state, _, rejections = fold([dataclasses.replace(SPEC, health_check="sometimes")])
    assert state.phase is JobPhase.NEW
    assert "health_check 'sometimes' must be one of off, relaunched, all" in rejections[0]


def state_log(events: list[Event]) -> list[Event]:
    """The log the reactor would have written for ``events`` (their follow-ups included)."""
    from stead.testing.replay import replay

    return list(replay(events).log)
