"""The commands in force: kept in the job state from the record that asks for one until its agent acknowledges it."""

from __future__ import annotations

import dataclasses

from stead.core.events import (
    CommandAck,
    CommandsAcked,
    Event,
    JobStopped,
    JobSubmitted,
    NodeLost,
    RecoveryAction,
    RecoveryDecided,
    WorkerFailed,
    WorkersStarted,
)
from stead.core.serde import from_json, to_json
from stead.core.statemachine import JobState, StartWorkers, StopNode, StopWorkers, in_force
from stead.testing.replay import folded, node_up

SPEC = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=2, max_restarts=3)
ROUND_1 = (SPEC, *node_up("node-0"), *node_up("node-1"))


def _ack(node: str, command: str, incarnation: int = 1) -> CommandsAcked:
    return CommandsAcked(acks=(CommandAck(node_id=node, incarnation=incarnation, command_id=command),))


def _failed_and_restarted(round_: int) -> tuple[Event, ...]:
    failure = WorkerFailed(node_id="node-1", round=round_, local_rank=0, rank=2, exit_code=1)
    return failure, RecoveryDecided(round=round_, action=RecoveryAction.RESTART, reason="transient")


def test_a_round_s_start_is_in_force_for_every_member_until_each_acknowledges_it() -> None:
    state = folded(*ROUND_1)
    starts = {n: in_force(state, n) for n in ("node-0", "node-1")}
    assert {n: (type(c), c.id if c else None) for n, c in starts.items()} == {
        "node-0": (StartWorkers, "start-workers/1/node-0"), "node-1": (StartWorkers, "start-workers/1/node-1")}
    acked = folded(_ack("node-0", "start-workers/1/node-0"), start=state)
    assert in_force(acked, "node-0") is None
    assert in_force(acked, "node-1") == starts["node-1"]
    assert set(acked.commands) == {"node-1"}


def test_a_repeated_unknown_or_stale_acknowledgement_changes_nothing() -> None:
    state = folded(*ROUND_1, _ack("node-0", "start-workers/1/node-0"))
    for ack in (_ack("node-0", "start-workers/1/node-0"),  # repeated
                _ack("node-1", "start-workers/7/node-1"),  # no such command
                _ack("node-1", "dump-stacks/12/node-1"),  # a one-off: never awaited
                _ack("node-1", "start-workers/1/node-1", incarnation=2),  # of another incarnation
                _ack("node-9", "start-workers/1/node-9")):  # of an unknown node
        after = folded(ack, start=state)
        assert after.commands == state.commands, ack


def test_many_nodes_acknowledgements_in_one_record_each_drop_their_node_s_command() -> None:
    state = folded(*ROUND_1)
    both = CommandsAcked(acks=tuple(CommandAck(node_id=n, incarnation=1, command_id=f"start-workers/1/{n}")
                                    for n in ("node-0", "node-1")))
    assert folded(both, start=state).commands == {}


def test_a_broken_round_s_start_is_superseded_by_its_stop_and_the_next_round_s_start() -> None:
    state = folded(*ROUND_1, WorkersStarted(node_id="node-0", round=1), *_failed_and_restarted(1))
    assert state.rdzv.round == 2  # every member is still here: the next round started at once
    assert [in_force(state, n).id for n in ("node-0", "node-1")] == [  # type: ignore[union-attr]
        "start-workers/2/node-0", "start-workers/2/node-1"]
    # a start of round 1 never acknowledged is no longer in force, even where the state still holds it
    stale = dataclasses.replace(state, commands={**state.commands, "node-0": StartWorkers(
        node_id="node-0", incarnation=1, round=1, node_rank=0, nnodes=2, nproc_per_node=2, restart_count=0)})
    assert in_force(stale, "node-0") is None


def test_a_round_that_broke_leaves_its_stop_in_force_until_the_next_round_starts() -> None:
    lost = NodeLost(node_id="node-1", incarnation=1, reason="gone")
    state = folded(*ROUND_1, lost)
    stop = in_force(state, "node-0")
    assert isinstance(stop, StopWorkers) and stop.round == 1
    assert in_force(state, "node-1") is None  # its incarnation ended: nothing is resent to it
    assert in_force(folded(*node_up("node-1", 2), start=state), "node-0").id == "start-workers/2/node-0"  # type: ignore[union-attr]


def test_an_ended_job_keeps_its_nodes_stop_in_force_until_they_are_gone() -> None:
    state = folded(*ROUND_1, JobStopped(reason="by hand"))
    assert [type(in_force(state, n)) for n in ("node-0", "node-1")] == [StopNode, StopNode]
    gone = folded(NodeLost(node_id="node-0", incarnation=1, reason="exited"), start=state)
    assert in_force(gone, "node-0") is None


def test_the_commands_in_force_survive_a_snapshot_each_as_its_own_kind() -> None:
    state = folded(*ROUND_1, WorkersStarted(node_id="node-0", round=1), JobStopped(reason="by hand"))
    mixed = dataclasses.replace(state, commands={
        "node-0": StartWorkers(node_id="node-0", incarnation=1, round=1, node_rank=0, nnodes=2, nproc_per_node=2,
                               restart_count=0),
        "node-1": StopWorkers(node_id="node-1", incarnation=1, round=1, reason="broken"),
        "node-2": StopNode(node_id="node-2", incarnation=1, reason="job stopped"),
    })
    assert from_json(JobState, to_json(mixed)) == mixed
