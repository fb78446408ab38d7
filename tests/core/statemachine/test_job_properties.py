"""Property tests of the job machine over random but plausible event histories.

A history is a job spec (1-3 nodes, 1-2 processes per node, 0-3 restarts, 0-2
relaunches) and a list of input events: mostly events that make sense in the
state reached so far (nodes starting, joining, getting lost; workers starting,
succeeding, failing; decisions; armed timers firing), plus some random noise.
Each is folded like the reactor folds it, follow-up events included.
"""

from __future__ import annotations

import dataclasses
import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stead.core.events import (
    CheckpointCommitted,
    DecisionTimeout,
    EffectFailed,
    Event,
    JobFailed,
    JobResumed,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    JoinTimeout,
    LastCall,
    LaunchId,
    NodeExited,
    NodeJoined,
    NodeLost,
    NodeRequested,
    NodeStarted,
    PluginFailed,
    PluginsStarted,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RelaunchRequested,
    RestartRequested,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    TimerFired,
    TimerName,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.serde import from_json, to_json
from stead.core.statemachine import JobPhase, JobState, KillNode, NodePhase, StartTimer, StopNode, fold, transition
from stead.testing.replay import Folder, Replay, Step, replay

#: STEAD_PROPERTY_EXAMPLES=5000 for a deeper search than the default quick one
PROPERTIES = settings(max_examples=int(os.environ.get("STEAD_PROPERTY_EXAMPLES", "100")), deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])
NOW = 50.0
NODE_IDS = st.sampled_from(["node-0", "node-1", "node-2", "node-3"])
SMALL = st.integers(0, 5)


def specs() -> st.SearchStrategy[JobSubmitted]:
    def build(min_nodes: int, extra: int, nproc: int, restarts: int, relaunches: int) -> JobSubmitted:
        return JobSubmitted(job="prop", min_nodes=min_nodes, max_nodes=min(3, min_nodes + extra),
                            nproc_per_node=nproc, max_restarts=restarts, max_node_relaunches=relaunches,
                            last_call_timeout_s=1.0, join_timeout_s=30.0)

    return st.builds(build, st.integers(1, 3), st.integers(0, 2), st.integers(1, 2), st.integers(0, 3),
                     st.integers(0, 2))


def noise() -> st.SearchStrategy[Event]:
    """Any core event with small, colliding values: mostly stale, unknown or out of place."""
    node = {"node_id": NODE_IDS, "incarnation": SMALL}
    worker = {"node_id": NODE_IDS, "round": SMALL}
    events: list[st.SearchStrategy[Event]] = [
        st.builds(NodeRequested, **node), st.builds(NodeStarted, **node), st.builds(NodeJoined, **node),
        st.builds(NodeLost, **node), st.builds(NodeExited, **node, exit_code=st.none() | SMALL),
        st.builds(WorkersStarted, **worker), st.builds(WorkersSucceeded, **worker),
        st.builds(WorkerFailed, **worker, local_rank=SMALL, rank=SMALL, error_tail=st.sampled_from(["", "tail"])),
        st.builds(RoundStarted, round=SMALL, members=st.lists(NODE_IDS, max_size=4, unique=True).map(tuple),
                  nproc_per_node=st.integers(1, 2), restart_count=SMALL),
        st.builds(RoundCompleted, round=SMALL), st.builds(StepProgress, round=SMALL, step=st.integers(0, 100)),
        st.builds(RecoveryDecided, round=SMALL, action=st.sampled_from(RecoveryAction), reason=st.just("noise")),
        st.builds(TimerFired, name=st.sampled_from([JoinTimeout(), LastCall(round=1), LastCall(round=2),
                                                    LastCall(round=3), DecisionTimeout(round=1),
                                                    DecisionTimeout(round=2), JoinTimeout(life=5)])),
        st.builds(CheckpointCommitted, step=st.integers(0, 100)),
        st.builds(PluginFailed, plugin=st.sampled_from(["p", "diagnosis"]), event_type=st.just("x"),
                  error=st.just("e"), disabled=st.booleans()),
        st.builds(PluginsStarted, plugins=st.just(("diagnosis",)),
                  deciders=st.sampled_from([(), ("diagnosis",)])),
        st.builds(EffectFailed, effect_id=st.just(LaunchId(node_id="node-0", incarnation=1)), error=st.just("boom"),
                  kind=st.sampled_from(["launch-node", "kill-node", "start-workers", "stop-workers", "stop-node"]),
                  node_id=st.none() | NODE_IDS, incarnation=st.none() | SMALL, round=st.none() | SMALL),
        st.builds(RestartRequested, round=SMALL, reason=st.just("r"), by=st.just("p")),
        st.builds(RelaunchRequested, **node, reason=st.just("r"), by=st.just("p")),
        specs(), st.just(JobSucceeded()), st.just(JobFailed(reason="noise")), st.just(JobStopped()),
    ]
    return st.one_of(events)


NOISE = noise()
PICK = st.integers(0, 1 << 16)  # index into the plausible events (one strategy object: cheap to draw)
NOISY = st.integers(0, 9)
LENGTH = st.integers(0, 45)


def plausible(state: JobState, timers: set[TimerName], *, resumes: bool = False) -> list[Event]:
    """Events that could well arrive now, repeated by how likely they are (timers: armed, not fired)."""
    out: list[Event] = []
    if resumes and state.spec is not None and (state.phase.terminal or len(timers) == 7):
        spec = state.spec
        out += [JobResumed(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(JobSubmitted)})] * 3
    for node in state.nodes.values():
        n, inc = node.node_id, node.incarnation
        if node.phase is NodePhase.REQUESTED:
            out += [NodeStarted(node_id=n, incarnation=inc, host="h")] * 6
            out += [NodeJoined(node_id=n, incarnation=inc)] * 3  # the agent may register before the platform reports
        if node.phase is NodePhase.STARTED:
            out += [NodeJoined(node_id=n, incarnation=inc)] * 8
        if node.phase is NodePhase.JOINED:
            out.append(NodeJoined(node_id=n, incarnation=inc))  # re-registration
        if node.phase.alive:  # lost or exited, one death per live node
            out.append(NodeLost(node_id=n, incarnation=inc) if len(out) % 2 else NodeExited(node_id=n, incarnation=inc))
        if inc > 1:
            out.append(NodeExited(node_id=n, incarnation=inc - 1, signal=9))
    rdzv = state.rdzv
    if rdzv.active:
        for rank, n in enumerate(rdzv.members):
            out += [WorkersStarted(node_id=n, round=rdzv.round)] * 4
            out += [WorkersSucceeded(node_id=n, round=rdzv.round)] * 2
            out += [WorkerFailed(node_id=n, round=rdzv.round, local_rank=0, rank=rank, exit_code=1,
                                 error_tail=f"error on {n}")] * 3
        out += [StepProgress(round=rdzv.round, step=10 * rdzv.round), CheckpointCommitted(step=10 * rdzv.round)]
    if state.awaiting_decision:
        restart = RecoveryDecided(round=rdzv.round, action=RecoveryAction.RESTART, reason="transient")
        out += [restart] * 6 + [RecoveryDecided(round=rdzv.round, action=RecoveryAction.FAIL, reason="user error")]
        out += [PluginFailed(plugin="diagnosis", event_type="worker.failed", error="e", disabled=True)]
    if rdzv.active:
        out.append(RestartRequested(round=rdzv.round, reason="hang", by="p"))
    for node in state.nodes.values():
        if node.phase is NodePhase.REQUESTED:
            out.append(EffectFailed(effect_id=LaunchId(node_id=node.node_id, incarnation=node.incarnation),
                                    kind="launch-node", error="boom", node_id=node.node_id,
                                    incarnation=node.incarnation))
        if node.phase is NodePhase.JOINED:
            out.append(RelaunchRequested(node_id=node.node_id, incarnation=node.incarnation, reason="slow", by="p"))
    if state.deciders is None:
        out.append(PluginsStarted(plugins=("diagnosis",), deciders=("diagnosis",) if len(out) % 3 else ()))
    for name in sorted(timers, key=str):
        out += [TimerFired(name=name)] * (1 if isinstance(name, JoinTimeout) else 6)
    return out


@st.composite
def histories(draw: st.DrawFn, resumes: bool = False) -> tuple[JobSubmitted, list[Event]]:
    """A spec and the input events of one job (the spec first); ``resumes``: ended jobs may be resumed."""
    spec = draw(specs())
    folder = Folder()
    events: list[Event] = [spec]
    timers: set[TimerName] = set()
    for _ in range(draw(LENGTH)):
        event = events[-1]
        for step in folder.feed(event, now=NOW):
            timers |= {e.name for e in step.result.effects if isinstance(e, StartTimer)}
            if isinstance(step.event, TimerFired):
                timers.discard(step.event.name)
        choices = plausible(folder.state, timers, resumes=resumes)
        if not choices or draw(NOISY) == 0:
            events.append(draw(NOISE))
        else:
            events.append(choices[draw(PICK) % len(choices)])
    return spec, events


def run(events: list[Event]) -> Replay:
    return replay(events, now=NOW)


def snapshot(state: JobState) -> JobState:
    """What a restarted master reads back: ``to_json`` through real JSON text and ``from_json``."""
    return from_json(JobState, json.loads(json.dumps(to_json(state))))


def without_bookkeeping(state: JobState) -> JobState:
    """The state less what a finished job still tracks: its nodes going away, the plugins and the last seq."""
    return dataclasses.replace(state, nodes={}, seq=0, deciders=None)


# -- properties -------------------------------------------------------------------------------------------------


@PROPERTIES
@given(histories())
def test_terminal_phase_absorbs_every_later_event(history: tuple[JobSubmitted, list[Event]]) -> None:
    for step in run(history[1]).steps:
        if step.before.phase.terminal and not isinstance(step.event, JobResumed):
            assert step.rejected is None
            # the only effect a finished job still has: killing a node that was lost after the end
            assert all(isinstance(e, KillNode) and isinstance(step.event, NodeLost) for e in step.result.effects)
            assert without_bookkeeping(step.result.state) == without_bookkeeping(step.before)


@PROPERTIES
@given(histories(resumes=True))
def test_folding_the_same_log_twice_gives_equal_states_and_effects(history: tuple[JobSubmitted, list[Event]]) -> None:
    first, second = run(history[1]), run(history[1])
    assert first.state == second.state
    assert first.effects == second.effects
    assert [e.id for e in first.effects] == [e.id for e in second.effects]
    assert first.log == second.log
    recorded = replay(first.log, now=NOW, follow_emits=False)
    assert recorded.state == first.state
    assert recorded.effects == first.effects


@PROPERTIES
@given(histories(resumes=True), st.data())
def test_snapshot_round_trips_at_every_point_and_resuming_from_it_ends_in_the_same_state(
    history: tuple[JobSubmitted, list[Event]], data: st.DataObject
) -> None:
    whole = run(history[1])
    for step in whole.steps:
        assert snapshot(step.before) == step.before
    assert snapshot(whole.state) == whole.state
    cut = data.draw(st.integers(0, len(whole.steps)), label="cut")
    start = snapshot(whole.steps[cut].before if cut < len(whole.steps) else whole.state)
    rest = [step.event for step in whole.steps[cut:]]
    assert replay(rest, start=start, follow_emits=False, now=NOW).state == whole.state
    # a restarted master resumes at an input boundary and goes on live
    inputs = [i for i, step in enumerate(whole.steps) if step.cause is None]
    at = data.draw(st.integers(0, len(inputs) - 1), label="input") if inputs else 0
    live = replay(history[1][at:], start=snapshot(whole.steps[inputs[at]].before) if inputs else None, now=NOW)
    assert live.state == whole.state


@PROPERTIES
@given(histories(resumes=True))
def test_effect_ids_are_unique_within_a_transition_and_deterministic(
    history: tuple[JobSubmitted, list[Event]],
) -> None:
    for step in run(history[1]).steps:
        ids = [e.id for e in step.result.effects]
        assert len(ids) == len(set(ids)), ids
        again = fold(step.before, Record(seq=step.seq, at=NOW, event=step.event))
        assert again == step.result
        assert [e.id for e in again.effects] == ids


@PROPERTIES
@given(histories(resumes=True))
def test_restarts_and_relaunches_never_exceed_their_budgets_and_rounds_only_increase(
    history: tuple[JobSubmitted, list[Event]],
) -> None:
    """Within one run of the job (a resume starts the budgets afresh; rounds and incarnations go on)."""
    spec = history[0]
    for step in run(history[1]).steps:
        after = step.result.state
        assert after.rdzv.round >= step.before.rdzv.round
        assert after.life >= step.before.life
        same_life = after.life == step.before.life
        assert after.restarts >= step.before.restarts or not same_life
        if after.spec is not None:
            assert after.spec == spec  # a later JobSubmitted never replaces the spec (these resumes keep it)
            assert after.restarts <= spec.max_restarts
        for node_id, node in after.nodes.items():
            if node_id in step.before.nodes:
                assert node.incarnation >= step.before.nodes[node_id].incarnation
        if step.cause is not None and isinstance(step.event, NodeRequested):  # the machine's own (re)launch
            base = step.before.resumed_at.get(step.event.node_id, 0)
            assert step.event.incarnation - base <= spec.max_node_relaunches + 1


@PROPERTIES
@given(histories())
def test_rejected_transitions_never_change_state_or_ask_for_effects(
    history: tuple[JobSubmitted, list[Event]],
) -> None:
    for step in run(history[1]).steps:
        if step.rejected is not None:
            assert step.rejected.strip()
            assert transition(step.before, step.event, now=NOW, seq=step.seq).state is step.before
            assert step.result.state == dataclasses.replace(step.before, seq=max(step.seq, step.before.seq))
            assert step.result.effects == ()


@PROPERTIES
@given(histories())
def test_follow_up_events_are_never_rejected(history: tuple[JobSubmitted, list[Event]]) -> None:
    followed = run(history[1])  # also: no Emit id is emitted twice (Folder raises DuplicateEmit)
    causes = {step.seq: step for step in followed.steps}
    for step in followed.steps:
        if step.cause is not None and step.rejected is not None:
            cause = causes[step.cause]
            raise AssertionError(f"{step.event} emitted by {cause.event} was rejected: {step.rejected}")


def check_invariants(step: Step) -> None:
    state = step.result.state
    if state.awaiting_decision:
        assert state.phase is JobPhase.RECOVERING
        assert state.last_failure is not None and state.last_failure.round == state.rdzv.round
    if state.phase is JobPhase.RUNNING:
        assert state.rdzv.active
    if state.rdzv.active:
        assert state.phase in (JobPhase.RUNNING, JobPhase.RECOVERING)
        assert state.rdzv.members
        assert all(state.nodes[m].phase is NodePhase.JOINED for m in state.rdzv.members), state
        assert state.rdzv.started <= set(state.rdzv.members)
        assert state.rdzv.succeeded <= set(state.rdzv.members)
    if state.phase.terminal:
        assert not state.rdzv.active and not state.awaiting_decision
    if state.phase is not JobPhase.NEW:
        assert state.spec is not None
    assert len(state.rdzv.members) <= (state.spec.max_nodes if state.spec else 0)


@PROPERTIES
@given(histories())
def test_state_invariants_hold_after_every_event(history: tuple[JobSubmitted, list[Event]]) -> None:
    for step in run(history[1]).steps:
        check_invariants(step)


@PROPERTIES
@given(histories())
def test_every_end_stops_each_live_node_once(history: tuple[JobSubmitted, list[Event]]) -> None:
    for step in run(history[1]).steps:
        if step.result.state.phase.terminal and not step.before.phase.terminal:
            stopped = {(e.node_id, e.incarnation) for e in step.result.effects if isinstance(e, StopNode)}
            alive = {(n.node_id, n.incarnation) for n in step.before.nodes.values() if n.phase.alive}
            assert stopped == alive


@PROPERTIES
@given(histories(resumes=True))
def test_the_ready_count_kept_across_joins_is_the_count_of_ready_nodes(
        history: tuple[JobSubmitted, list[Event]]) -> None:
    """Planning a round reads how many nodes are ready from a count kept join by join (a scan at every join made
    a 10,000-node rendezvous quadratic); it must be the count a scan gives, at every point of every history."""
    from stead.core.statemachine.node_counts import Ready

    folder = Folder()
    for event in history[1]:
        for step in folder.feed(event, now=NOW):  # the events the machine emits are folded too
            state = step.result.state
            assert len(Ready(state)) == len(state.ready)
            assert list(Ready(state)) == list(state.ready)
