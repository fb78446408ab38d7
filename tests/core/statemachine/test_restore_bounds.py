"""A replica mismatch's decision bounds the restore: the job state keeps the bound (through a master restart: the
log's replay and the snapshot) and every later round's start carries it to the agents."""

from __future__ import annotations

import json

from stead.core.events import NodeJoined, NodeStarted, RecoveryAction, RestoreBound
from stead.core.master.command_streams import agent_command
from stead.core.serde import from_json, to_json
from stead.core.statemachine import JobState, StartWorkers
from stead.core.statemachine.commands import in_force
from tests.core.statemachine.test_job_machine import AWAITING, after, decided, failed

MISMATCH = decided(1, RecoveryAction.RELAUNCH, reason="numerical (replica-mismatch)", node_id="node-0",
                   restore_at_most=4)
#: the relaunched node-0 back: a new round starts
REJOINED = (NodeStarted(node_id="node-0", incarnation=2), NodeJoined(node_id="node-0", incarnation=2))


def test_a_decided_bound_is_kept_in_the_job_state_with_the_round_it_was_decided_in() -> None:
    state = after(MISMATCH, start=AWAITING)
    assert state.restore_bounds == (RestoreBound(step=4, round=1),)
    second = after(failed(round=2), decided(2, restore_at_most=-1), start=after(*REJOINED, start=state))
    assert second.restore_bounds == (RestoreBound(step=4, round=1), RestoreBound(step=-1, round=2))


def test_no_bound_without_one_decided_or_when_the_job_fails() -> None:
    assert after(decided(1), start=AWAITING).restore_bounds == ()
    assert after(decided(1, RecoveryAction.FAIL, restore_at_most=4), start=AWAITING).restore_bounds == ()


def test_the_bounds_survive_a_master_restart_in_the_snapshot() -> None:
    state = after(MISMATCH, start=AWAITING)
    assert from_json(JobState, json.loads(json.dumps(to_json(state)))) == state
    old = to_json(state)
    del old["restore_bounds"]  # a snapshot from before the field: no bound
    assert from_json(JobState, old).restore_bounds == ()


def test_the_next_round_s_start_is_given_with_the_bounds() -> None:
    state = after(*REJOINED, start=after(MISMATCH, start=AWAITING))
    starts = [order for node in state.nodes if isinstance(order := in_force(state, node), StartWorkers)]
    assert starts, "the relaunched round starts workers"
    command = agent_command(starts[0], ("127.0.0.1", 1), state)
    assert command.restore_bounds == (RestoreBound(step=4, round=1),)  # type: ignore[union-attr]

