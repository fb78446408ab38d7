"""The hand-over policy between masters as pure functions: which ends of a master leave the job's nodes running for
the next one and which stop them, and which nodes a master taking the job over adopts."""

from __future__ import annotations

import asyncio

import pytest

from stead.core.errors import (
    ConfigError,
    LogConflict,
    MasterTaskFailed,
    ReactorStopped,
    StoreError,
    StoreUnavailable,
)
from stead.core.master.takeover import leaf_errors, leaves_nodes, nodes_to_adopt
from stead.core.statemachine import JobPhase, JobState, NodePhase, NodeState

RUNNING = (JobPhase.NEW, JobPhase.STARTING, JobPhase.RUNNING, JobPhase.RECOVERING)
ENDED = (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.STOPPED)


def _leaves(exc: BaseException | None, *, reactor_failure: BaseException | None = None, job_ended: bool = False,
            leave_nodes_on_failure: bool = True) -> bool:
    return leaves_nodes(exc, reactor_failure=reactor_failure, job_ended=job_ended,
                        leave_nodes_on_failure=leave_nodes_on_failure)


@pytest.mark.parametrize("failure", [
    StoreUnavailable("etcd away past retry_deadline_s"),
    MasterTaskFailed("the heartbeat watcher kept failing"),
    ReactorStopped("the master stopped before it recorded the event"),
    LogConflict("another master appended seq 12 first"),
], ids=lambda e: type(e).__name__)
def test_a_failure_a_successor_takes_over_from_leaves_the_nodes_running(failure: BaseException) -> None:
    assert _leaves(failure)
    assert _leaves(BaseExceptionGroup("tasks", [ValueError("x"), ExceptionGroup("inner", [failure])]))
    assert _leaves(None, reactor_failure=failure)  # the reactor stopped the master, which itself ended cleanly
    assert _leaves(asyncio.CancelledError(), reactor_failure=failure)


@pytest.mark.parametrize("end", [
    None,  # a clean stop
    KeyboardInterrupt(),
    ValueError("a bug"),
    ConfigError("a token the job's verifier does not match"),
    StoreError("the store refused the write"),
    BaseExceptionGroup("tasks", [ValueError("a bug"), KeyboardInterrupt()]),
], ids=repr)
def test_a_stop_a_bug_or_a_permanent_error_stops_the_nodes(end: BaseException | None) -> None:
    assert not _leaves(end)


def test_a_job_that_ended_stops_its_nodes_whatever_stopped_the_master() -> None:
    assert not _leaves(StoreUnavailable("away"), job_ended=True)
    assert not _leaves(None, reactor_failure=LogConflict("another master"), job_ended=True)


def test_a_master_not_set_to_leave_its_nodes_stops_them_on_any_failure() -> None:
    assert not _leaves(StoreUnavailable("away"), leave_nodes_on_failure=False)
    assert not _leaves(None, reactor_failure=MasterTaskFailed("x"), leave_nodes_on_failure=False)


def test_the_errors_of_nested_groups_are_flattened_in_order() -> None:
    a, b, c = ValueError("a"), StoreUnavailable("b"), KeyboardInterrupt()
    assert leaf_errors(BaseExceptionGroup("outer", [a, BaseExceptionGroup("inner", [b, c])])) == [a, b, c]
    assert leaf_errors(a) == [a]


def _job(phase: JobPhase, **nodes: NodePhase) -> JobState:
    return JobState(phase=phase, nodes={name: NodeState(node_id=name, incarnation=2, phase=node_phase, pid=100 + i)
                                        for i, (name, node_phase) in enumerate(nodes.items())})


@pytest.mark.parametrize("phase", RUNNING)
def test_a_master_taking_over_a_running_job_adopts_the_nodes_that_started_or_joined(phase: JobPhase) -> None:
    state = _job(phase, a=NodePhase.REQUESTED, b=NodePhase.STARTED, c=NodePhase.JOINED, d=NodePhase.LOST,
                 e=NodePhase.EXITED)
    assert [(n.node_id, n.incarnation, n.pid) for n in nodes_to_adopt(state)] == [("b", 2, 101), ("c", 2, 102)]


@pytest.mark.parametrize("phase", ENDED)
def test_a_master_taking_over_a_job_that_ended_adopts_no_node(phase: JobPhase) -> None:
    assert nodes_to_adopt(_job(phase, b=NodePhase.STARTED, c=NodePhase.JOINED)) == []
