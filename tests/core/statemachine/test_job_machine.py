"""Table tests of the job machine: every allowed transition and a sample of forbidden ones.

Each start state is built by folding a short history with :mod:`stead.testing.replay`;
the row's event is then applied with one call to ``transition`` (its ``Emit``
effects are *not* followed, so the table shows exactly what one step asks for).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

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
    KillId,
    LastCall,
    LaunchId,
    NodeExited,
    NodeJoined,
    NodeLost,
    NodePending,
    NodeRequested,
    NodeResourcesDecided,
    NodeStarted,
    PluginFailed,
    PluginsStarted,
    RecoveryAction,
    RecoveryDecided,
    RejoinTimeout,
    RelaunchRequested,
    ResourcesTimeout,
    RestartRequested,
    RoundCompleted,
    RoundStarted,
    StacksRequested,
    StartWorkersId,
    StepProgress,
    TimerFired,
    TransitionRejected,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.statemachine import (
    DumpStacks,
    Emit,
    JobPhase,
    JobState,
    KillNode,
    LaunchNode,
    NodePhase,
    StartTimer,
    StartWorkers,
    StopNode,
    StopWorkers,
    transition,
)
from stead.core.statemachine.rendezvous import round_key
from stead.testing.replay import folded, node_up

NOW = 1000.0
SPEC = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=2, max_restarts=1, max_node_relaunches=1,
                    last_call_timeout_s=5.0, join_timeout_s=60.0)
ELASTIC = dataclasses.replace(SPEC, min_nodes=2, max_nodes=3)
ELASTIC_NO_RELAUNCH = dataclasses.replace(ELASTIC, max_node_relaunches=0)
MEMBERS = ("node-0", "node-1")
TAIL = "Traceback (most recent call last):\nRuntimeError: NCCL timeout"


def after(*events: Event, follow: bool = True, start: JobState | None = None) -> JobState:
    return folded(*events, now=NOW, start=start, follow_emits=follow)


up = node_up


def failed(node: str = "node-0", round: int = 1, rank: int = 1) -> WorkerFailed:
    return WorkerFailed(node_id=node, round=round, local_rank=1, rank=rank, exit_code=1, error_tail=TAIL)


def decided(round: int, action: RecoveryAction = RecoveryAction.RESTART, **kw: Any) -> RecoveryDecided:
    return RecoveryDecided(round=round, action=action, reason=kw.pop("reason", "transient"), **kw)


def round_started(round: int, members: tuple[str, ...] = MEMBERS, restarts: int = 0) -> RoundStarted:
    return RoundStarted(round=round, members=members, nproc_per_node=2, restart_count=restarts)


# -- start states ----------------------------------------------------------------------------------------------

NEW = JobState()
STARTING = after(SPEC)
SUBMITTED_ONLY = after(SPEC, follow=False)  # the NodeRequested follow-ups not folded yet
ONE_JOINED = after(SPEC, *up("node-0"))
ALL_JOINED_NO_ROUND = after(SPEC, NodeRequested(node_id="node-0", incarnation=1),
                            NodeRequested(node_id="node-1", incarnation=1), *up("node-0"), *up("node-1"), follow=False)
RUNNING = after(SPEC, *up("node-0"), *up("node-1"))
RUNNING_AT_STEP_10 = after(StepProgress(round=1, step=10), start=RUNNING)
ONE_UP = after(WorkersStarted(node_id="node-0", round=1), start=RUNNING)
ALL_SUCCEEDED_NO_END = after(WorkersSucceeded(node_id="node-0", round=1), WorkersSucceeded(node_id="node-1", round=1),
                             start=RUNNING, follow=False)
AWAITING = after(failed(), start=RUNNING)
RESTART_DECIDED = after(decided(1), start=AWAITING, follow=False)
RESTARTED = after(decided(1), start=AWAITING)
AWAITING_LAST_RESTART = after(failed("node-1", round=2, rank=3), start=RESTARTED)
#: the last restart's failure waits for its decision when its node is OOM-killed (its pod's end seen first as a
#: worker's SIGKILL or a peer's collective error)
MEMBER_GONE_AWAITING = after(NodeExited(node_id="node-1", incarnation=1, exit_code=137, oom=True),
                             start=AWAITING_LAST_RESTART)
LOST_NO_FOLLOW = after(NodeLost(node_id="node-1", incarnation=1), start=RUNNING, follow=False)
LOST = after(NodeLost(node_id="node-1", incarnation=1), start=RUNNING)
RELAUNCHED_STARTED = after(NodeStarted(node_id="node-1", incarnation=2), start=LOST)
RUNNING_AFTER_RELAUNCH = after(NodeJoined(node_id="node-1", incarnation=2), start=RELAUNCHED_STARTED)
E_ONE_JOINED_ONE_STARTED = after(ELASTIC, *up("node-0"), NodeStarted(node_id="node-1", incarnation=1))
E_TWO_JOINED = after(ELASTIC, *up("node-0"), *up("node-1"))
E_TWO_JOINED_THIRD_STARTED = after(NodeStarted(node_id="node-2", incarnation=1), start=E_TWO_JOINED)
E_TWO_JOINED_THEN_LOST = after(NodeLost(node_id="node-1", incarnation=1), start=E_TWO_JOINED)
E_RUNNING_TWO = after(TimerFired(name=LastCall(round=1)), start=E_TWO_JOINED)
E0_RUNNING_THREE = after(ELASTIC_NO_RELAUNCH, *up("node-0"), *up("node-1"), *up("node-2"))
E0_SHRUNK = after(NodeLost(node_id="node-2", incarnation=1), start=E0_RUNNING_THREE)
SUCCEEDED = after(WorkersSucceeded(node_id="node-0", round=1), WorkersSucceeded(node_id="node-1", round=1),
                  start=RUNNING)
STOPPED = after(JobStopped(), start=LOST)
SUCCEEDED_EXITED = after(NodeExited(node_id="node-0", incarnation=1, exit_code=0),
                         NodeExited(node_id="node-1", incarnation=1, exit_code=0), start=SUCCEEDED)
RESUME = JobResumed(**{f.name: getattr(SPEC, f.name) for f in dataclasses.fields(SPEC)})
FAILED = after(decided(1, RecoveryAction.FAIL), start=AWAITING)
WITH_DIAGNOSIS = PluginsStarted(plugins=("diagnosis", "ckpt"), deciders=("diagnosis",))
NO_DECIDER = PluginsStarted(plugins=("ckpt",), deciders=())
RUNNING_NO_DECIDER = after(NO_DECIDER, start=RUNNING)
AWAITING_DIAGNOSIS = after(WITH_DIAGNOSIS, start=AWAITING)


def effect_failed(kind: str, node: str = "node-0", incarnation: int | None = 1,
                  round: int | None = None) -> EffectFailed:
    ids = {"launch-node": LaunchId(node_id=node, incarnation=incarnation or 0),
           "kill-node": KillId(node_id=node, incarnation=incarnation or 0),
           "start-workers": StartWorkersId(round=round or 0, node_id=node)}
    return EffectFailed(effect_id=ids[kind], kind=kind, error="OSError: boom", node_id=node,
                        incarnation=incarnation, round=round)


def field(state: object, path: str) -> object:
    value = state
    for part in path.split("."):
        # a mapping's key by its string form: a timer's name too
        value = {str(k): v for k, v in value.items()}[part] if isinstance(value, Mapping) else getattr(value, part)
    return value


def test_start_states_are_what_their_names_say() -> None:
    assert (STARTING.phase, SUBMITTED_ONLY.nodes) == (JobPhase.STARTING, {})
    assert (RUNNING.phase, RUNNING.rdzv.round, RUNNING.rdzv.members) == (JobPhase.RUNNING, 1, MEMBERS)
    assert (AWAITING.phase, AWAITING.awaiting_decision) == (JobPhase.RECOVERING, True)
    assert (RESTARTED.phase, RESTARTED.rdzv.round, RESTARTED.restarts) == (JobPhase.RUNNING, 2, 1)
    assert (LOST.phase, LOST.nodes["node-1"].incarnation) == (JobPhase.RECOVERING, 2)
    assert (RUNNING_AFTER_RELAUNCH.phase, RUNNING_AFTER_RELAUNCH.rdzv.round) == (JobPhase.RUNNING, 2)
    assert (E_TWO_JOINED.phase, E_RUNNING_TWO.phase, E_RUNNING_TWO.rdzv.members) == (
        JobPhase.STARTING, JobPhase.RUNNING, MEMBERS)
    assert (E0_SHRUNK.phase, E0_SHRUNK.rdzv.round, E0_SHRUNK.rdzv.members) == (JobPhase.RUNNING, 2, MEMBERS)
    assert [s.phase for s in (SUCCEEDED, STOPPED, FAILED)] == [JobPhase.SUCCEEDED, JobPhase.STOPPED, JobPhase.FAILED]


# -- allowed transitions -----------------------------------------------------------------------------------------

EffectIds = list[tuple[type, str]]
# (name, start, event, expected phase, expected fields, expected effects as (type, id))
ALLOWED: list[tuple[str, JobState, Event, JobPhase, dict[str, object], EffectIds]] = [
    ("submit requests MAX nodes and arms the join timeout", NEW, SPEC, JobPhase.STARTING, {"spec": SPEC},
     [(Emit, "emit/request/node-0/1"), (Emit, "emit/request/node-1/1"), (StartTimer, "timer/join-timeout")]),
    ("stop before submission", NEW, JobStopped(), JobPhase.STOPPED, {"reason": "stopped by user"}, []),
    ("failure before submission", NEW, JobFailed(reason="bad", message="m"), JobPhase.FAILED,
     {"reason": "bad", "message": "m"}, []),
    ("requested node is launched", SUBMITTED_ONLY, NodeRequested(node_id="node-0", incarnation=1), JobPhase.STARTING,
     {"nodes.node-0.phase": NodePhase.REQUESTED}, [(LaunchNode, "launch/node-0/1")]),
    ("platform reports a node started", STARTING, NodeStarted(node_id="node-0", incarnation=1, host="h", pid=5),
     JobPhase.STARTING, {"nodes.node-0.phase": NodePhase.STARTED, "nodes.node-0.pid": 5}, []),
    ("NodeJoined before NodeStarted, below MIN", STARTING, NodeJoined(node_id="node-0", incarnation=1),
     JobPhase.STARTING, {"nodes.node-0.phase": NodePhase.JOINED, "joined": ("node-0",)}, []),
    ("MAX joined: round 1 at once", after(NodeStarted(node_id="node-1", incarnation=1), start=ONE_JOINED),
     NodeJoined(node_id="node-1", incarnation=1), JobPhase.STARTING, {"joined": MEMBERS}, [(Emit, "emit/round/1")]),
    ("round 1 starts the workers", ALL_JOINED_NO_ROUND, round_started(1), JobPhase.RUNNING,
     {"rdzv.round": 1, "rdzv.active": True, "rdzv.members": MEMBERS},
     [(StartWorkers, "start-workers/1/node-0"), (StartWorkers, "start-workers/1/node-1")]),
    ("a member's workers are up", RUNNING, WorkersStarted(node_id="node-0", round=1), JobPhase.RUNNING,
     {"rdzv.started": frozenset({"node-0"}), "rdzv.completed": False}, []),
    ("the last member's workers are up", ONE_UP, WorkersStarted(node_id="node-1", round=1), JobPhase.RUNNING,
     {"rdzv.started": frozenset(MEMBERS)}, [(Emit, "emit/round-completed/1")]),
    ("round completed", RUNNING, RoundCompleted(round=1), JobPhase.RUNNING, {"rdzv.completed": True}, []),
    ("step progress", RUNNING, StepProgress(round=1, step=10), JobPhase.RUNNING, {"step": 10}, []),
    ("step progress never goes back", RUNNING_AT_STEP_10, StepProgress(round=1, step=3), JobPhase.RUNNING,
     {"step": 10}, []),
    ("checkpoint committed", RUNNING, CheckpointCommitted(step=7), JobPhase.RUNNING, {"checkpoint_step": 7}, []),
    ("an older step committed after a rollback is the one in force",
     dataclasses.replace(RUNNING, checkpoint_step=12), CheckpointCommitted(step=6), JobPhase.RUNNING,
     {"checkpoint_step": 6}, []),
    ("one member succeeded", RUNNING, WorkersSucceeded(node_id="node-0", round=1), JobPhase.RUNNING,
     {"rdzv.succeeded": frozenset({"node-0"})}, []),
    ("all members succeeded: JobSucceeded", after(WorkersSucceeded(node_id="node-0", round=1), start=RUNNING),
     WorkersSucceeded(node_id="node-1", round=1), JobPhase.RUNNING, {"rdzv.succeeded": frozenset(MEMBERS)},
     [(Emit, "emit/job-end")]),
    ("job succeeded stops every live node", ALL_SUCCEEDED_NO_END, JobSucceeded(), JobPhase.SUCCEEDED,
     {"rdzv.active": False, "reason": "all workers exited 0"},
     [(StopNode, "stop-node/node-0/1"), (StopNode, "stop-node/node-1/1")]),
    ("an ended job is resumed: its nodes as new incarnations, fresh budgets, its rounds numbered on",
     SUCCEEDED_EXITED, RESUME, JobPhase.STARTING,
     {"life": 1, "restarts": 0, "reason": "", "rdzv.round": 1, "rdzv.active": False,
      "resumed_at": {"node-0": 1, "node-1": 1}, "timers.join-timeout/1": NOW + 60.0},
     [(Emit, "emit/request/node-0/2"), (Emit, "emit/request/node-1/2"), (StartTimer, "timer/join-timeout/1")]),
    ("a job whose runner died is resumed: its nodes still on record as alive are killed first", RUNNING, RESUME,
     JobPhase.STARTING, {"life": 1, "nodes.node-0.phase": NodePhase.LOST, "awaiting_decision": False},
     [(KillNode, "kill/node-0/1"), (KillNode, "kill/node-1/1"), (Emit, "emit/request/node-0/2"),
      (Emit, "emit/request/node-1/2"), (StartTimer, "timer/join-timeout/1")]),
    ("worker failed: RECOVERING awaiting the decision, with a decision timer", RUNNING, failed(), JobPhase.RECOVERING,
     {"awaiting_decision": True, "last_failure": failed(), "rdzv.active": True, "timers.decision/1": NOW + 3.0},
     [(StartTimer, "timer/decision/1")]),
    ("worker failed with no decider running: the default policy decides at once", RUNNING_NO_DECIDER, failed(),
     JobPhase.RECOVERING, {"awaiting_decision": True}, [(Emit, "emit/decision/1")]),
    ("decision timer fires while the failure waits: the default policy decides", AWAITING,
     TimerFired(name=DecisionTimeout(round=1)), JobPhase.RECOVERING,
     {"awaiting_decision": True, "timers": {JoinTimeout(): NOW + 60.0}},
     [(Emit, "emit/decision/1")]),
    ("decision timer after a decision was taken: nothing", RESTARTED, TimerFired(name=DecisionTimeout(round=1)),
     JobPhase.RUNNING, {"rdzv.round": 2}, []),
    ("plugins announced with a decider", RUNNING, WITH_DIAGNOSIS, JobPhase.RUNNING,
     {"deciders": frozenset({"diagnosis"})}, []),
    ("plugins announced before the job is submitted", NEW, WITH_DIAGNOSIS, JobPhase.NEW,
     {"deciders": frozenset({"diagnosis"})}, []),
    ("a plugin's failure before the job is submitted is a report", NEW,
     PluginFailed(plugin="p", event_type="start", error="boom"), JobPhase.NEW, {}, []),
    ("no decider any more while a failure waits: the default policy decides now", AWAITING, NO_DECIDER,
     JobPhase.RECOVERING, {"deciders": frozenset()}, [(Emit, "emit/decision/1")]),
    ("the last decider disabled while a failure waits: the default policy decides now", AWAITING_DIAGNOSIS,
     PluginFailed(plugin="diagnosis", event_type="worker.failed", error="boom", disabled=True), JobPhase.RECOVERING,
     {"deciders": frozenset()}, [(Emit, "emit/decision/1")]),
    ("a decider failing but not disabled: still waiting for it", AWAITING_DIAGNOSIS,
     PluginFailed(plugin="diagnosis", event_type="worker.failed", error="boom"), JobPhase.RECOVERING,
     {"deciders": frozenset({"diagnosis"})}, []),
    ("a failed launch counts as the node lost: relaunched", STARTING, effect_failed("launch-node"),
     JobPhase.STARTING, {"nodes.node-0.phase": NodePhase.LOST},
     [(KillNode, "kill/node-0/1"), (Emit, "emit/request/node-0/2"),
      (StartTimer, "timer/rejoin/node-0/2")]),
    ("a failed launch of a replaced incarnation: nothing", LOST, effect_failed("launch-node", "node-1", 1),
     JobPhase.RECOVERING, {"nodes.node-1.incarnation": 2}, []),
    ("workers that could not start break the round: a restart", RUNNING,
     effect_failed("start-workers", round=1, incarnation=1), JobPhase.RECOVERING,
     {"restarts": 1, "rdzv.active": False},
     [(StopWorkers, "stop-workers/1/node-0"), (StopWorkers, "stop-workers/1/node-1"), (Emit, "emit/round/2")]),
    ("a failed kill is on record only", RUNNING, effect_failed("kill-node"), JobPhase.RUNNING, {}, []),
    ("restart requested by a plugin: a new round, one restart spent", RUNNING,
     RestartRequested(round=1, reason="hung", by="diagnosis"), JobPhase.RECOVERING,
     {"restarts": 1, "rdzv.active": False},
     [(StopWorkers, "stop-workers/1/node-0"), (StopWorkers, "stop-workers/1/node-1"), (Emit, "emit/round/2")]),
    ("restart requested with the budget spent: JobFailed", RESTARTED,
     RestartRequested(round=2, reason="hung", by="diagnosis"), JobPhase.RUNNING, {"restarts": 1},
     [(Emit, "emit/job-end")]),
    ("stacks requested by a plugin: every member dumps its workers' stacks, nothing else changes", RUNNING,
     StacksRequested(round=1, reason="no step for 30 s", by="diagnosis"), JobPhase.RUNNING, {"restarts": 0},
     [(DumpStacks, f"dump-stacks/{RUNNING.seq + 1}/node-0"), (DumpStacks, f"dump-stacks/{RUNNING.seq + 1}/node-1")]),
    ("relaunch requested by a plugin: killed, the others stopped, relaunched", RUNNING,
     RelaunchRequested(node_id="node-1", incarnation=1, reason="straggler", by="diagnosis"), JobPhase.RECOVERING,
     {"nodes.node-1.phase": NodePhase.LOST},
     [(KillNode, "kill/node-1/1"), (StopWorkers, "stop-workers/1/node-0"), (Emit, "emit/request/node-1/2"),
      (StartTimer, "timer/rejoin/node-1/2")]),
    ("follow-on failure of the same round ignored", AWAITING, failed("node-1", rank=3), JobPhase.RECOVERING,
     {"awaiting_decision": True, "last_failure": failed()}, []),
    ("failure of an older round ignored", RESTARTED, failed(round=1), JobPhase.RUNNING,
     {"awaiting_decision": False, "rdzv.round": 2}, []),
    ("failure before any round ignored", STARTING, failed(round=0), JobPhase.STARTING, {"awaiting_decision": False},
     []),
    ("RESTART within budget: round 2, same members, at once", AWAITING, decided(1), JobPhase.RECOVERING,
     {"restarts": 1, "awaiting_decision": False, "rdzv.active": False, "rdzv.round": 1}, [(Emit, "emit/round/2")]),
    ("restarted round starts the workers again", RESTART_DECIDED, round_started(2, restarts=1), JobPhase.RUNNING,
     {"rdzv.round": 2, "rdzv.active": True, "restarts": 1},
     [(StartWorkers, "start-workers/2/node-0"), (StartWorkers, "start-workers/2/node-1")]),
    ("RESTART with the budget spent: JobFailed", AWAITING_LAST_RESTART, decided(2), JobPhase.RECOVERING,
     {"restarts": 1, "awaiting_decision": False}, [(Emit, "emit/job-end")]),
    ("FAIL: JobFailed", AWAITING, decided(1, RecoveryAction.FAIL, reason="user error"), JobPhase.RECOVERING,
     {"restarts": 0, "awaiting_decision": False}, [(Emit, "emit/job-end")]),
    ("RESTART for a round a member's end broke meanwhile: no restart spent, the node's relaunch pays",
     MEMBER_GONE_AWAITING, decided(2), JobPhase.RECOVERING,
     {"restarts": 1, "awaiting_decision": False, "rdzv.active": False}, []),
    ("FAIL for a round a member's end broke meanwhile: JobFailed all the same", MEMBER_GONE_AWAITING,
     decided(2, RecoveryAction.FAIL, reason="user error"), JobPhase.RECOVERING,
     {"restarts": 1, "awaiting_decision": False}, [(Emit, "emit/job-end")]),
    ("member lost: kill it, stop the others, relaunch", RUNNING, NodeLost(node_id="node-1", incarnation=1),
     JobPhase.RECOVERING, {"rdzv.active": False, "nodes.node-1.phase": NodePhase.LOST},
     [(KillNode, "kill/node-1/1"), (StopWorkers, "stop-workers/1/node-0"), (Emit, "emit/request/node-1/2"),
      (StartTimer, "timer/rejoin/node-1/2")]),
    ("member exited: stop the others, relaunch", RUNNING, NodeExited(node_id="node-1", incarnation=1, exit_code=137),
     JobPhase.RECOVERING, {"rdzv.active": False, "nodes.node-1.phase": NodePhase.EXITED,
                           "nodes.node-1.exit_code": 137},
     [(StopWorkers, "stop-workers/1/node-0"), (Emit, "emit/request/node-1/2"),
      (StartTimer, "timer/rejoin/node-1/2")]),
    ("member lost while a failure awaits its decision", AWAITING, NodeLost(node_id="node-0", incarnation=1),
     JobPhase.RECOVERING, {"rdzv.active": False, "awaiting_decision": True},
     [(KillNode, "kill/node-0/1"), (StopWorkers, "stop-workers/1/node-1"), (Emit, "emit/request/node-0/2"),
      (StartTimer, "timer/rejoin/node-0/2")]),
    ("relaunch request launches incarnation 2", LOST_NO_FOLLOW, NodeRequested(node_id="node-1", incarnation=2),
     JobPhase.RECOVERING, {"nodes.node-1.phase": NodePhase.REQUESTED, "nodes.node-1.incarnation": 2},
     [(LaunchNode, "launch/node-1/2")]),
    ("relaunched node rejoins: round 2 at once", RELAUNCHED_STARTED, NodeJoined(node_id="node-1", incarnation=2),
     JobPhase.RECOVERING, {"nodes.node-1.phase": NodePhase.JOINED}, [(Emit, "emit/round/2")]),
    ("event of the lost incarnation ignored", LOST, NodeExited(node_id="node-1", incarnation=1, exit_code=-9),
     JobPhase.RECOVERING, {"nodes.node-1.incarnation": 2, "nodes.node-1.phase": NodePhase.REQUESTED}, []),
    ("relaunch budget spent and fewer than MIN alive: JobFailed", RUNNING_AFTER_RELAUNCH,
     NodeLost(node_id="node-1", incarnation=2), JobPhase.RECOVERING, {"nodes.node-1.phase": NodePhase.LOST},
     [(KillNode, "kill/node-1/2"), (StopWorkers, "stop-workers/2/node-0"), (Emit, "emit/job-end")]),
    ("relaunch budget spent but MIN alive: the survivors' round at once (no one else is coming)", E0_RUNNING_THREE,
     NodeLost(node_id="node-2", incarnation=1), JobPhase.RECOVERING, {"rdzv.active": False},
     [(KillNode, "kill/node-2/1"), (StopWorkers, "stop-workers/1/node-0"), (StopWorkers, "stop-workers/1/node-1"),
      (Emit, "emit/round/2")]),
    ("a last call after the shrink is stale: ignored", E0_SHRUNK, TimerFired(name=LastCall(round=2)),
     JobPhase.RUNNING, {"rdzv.round": 2}, []),
    ("elastic: MIN joined arms the last call", E_ONE_JOINED_ONE_STARTED, NodeJoined(node_id="node-1", incarnation=1),
     JobPhase.STARTING, {"joined": MEMBERS}, [(StartTimer, "timer/last-call/1")]),
    ("elastic: last call fires, round 1 with those joined", E_TWO_JOINED, TimerFired(name=LastCall(round=1)),
     JobPhase.STARTING, {"rdzv.round": 0}, [(Emit, "emit/round/1")]),
    ("elastic: MAX joined, round 1 at once", E_TWO_JOINED_THIRD_STARTED, NodeJoined(node_id="node-2", incarnation=1),
     JobPhase.STARTING, {"joined": ("node-0", "node-1", "node-2")}, [(Emit, "emit/round/1")]),
    ("elastic: last call with fewer than MIN ignored", E_TWO_JOINED_THEN_LOST, TimerFired(name=LastCall(round=1)),
     JobPhase.STARTING, {"rdzv.round": 0}, []),
    ("elastic: last call of a started round ignored", E_RUNNING_TWO, TimerFired(name=LastCall(round=1)),
     JobPhase.RUNNING, {"rdzv.round": 1}, []),
    ("elastic: a node joining a running round grows it at once (no checkpoint to wait for), no restart spent",
     E_RUNNING_TWO, NodeJoined(node_id="node-2", incarnation=1), JobPhase.RECOVERING,
     {"nodes.node-2.phase": NodePhase.JOINED, "rdzv.active": False, "restarts": 0},
     [(StopWorkers, "stop-workers/1/node-0"), (StopWorkers, "stop-workers/1/node-1"), (Emit, "emit/round/2")]),
    ("a non-member lost while running: relaunched, the round goes on", E_RUNNING_TWO,
     NodeLost(node_id="node-2", incarnation=1), JobPhase.RUNNING, {"rdzv.active": True},
     [(KillNode, "kill/node-2/1"), (Emit, "emit/request/node-2/2"),
      (StartTimer, "timer/rejoin/node-2/2")]),
    ("a node lost while starting is relaunched", STARTING, NodeLost(node_id="node-0", incarnation=1),
     JobPhase.STARTING, {"nodes.node-0.phase": NodePhase.LOST},
     [(KillNode, "kill/node-0/1"), (Emit, "emit/request/node-0/2"),
      (StartTimer, "timer/rejoin/node-0/2")]),
    ("agent re-registers while running", RUNNING, NodeJoined(node_id="node-0", incarnation=1), JobPhase.RUNNING,
     {"nodes.node-0.phase": NodePhase.JOINED}, []),
    ("join timeout while starting: JobFailed", ONE_JOINED, TimerFired(name=JoinTimeout()), JobPhase.STARTING, {},
     [(Emit, "emit/job-end")]),
    ("join timeout once running ignored", RUNNING, TimerFired(name=JoinTimeout()), JobPhase.RUNNING, {}, []),
    ("a join timeout of an earlier run ignored", STARTING, TimerFired(name=JoinTimeout(life=3)), JobPhase.STARTING,
     {}, []),
    ("plugin failure does not change the job", RUNNING,
     PluginFailed(plugin="p", event_type="node.joined", error="boom"), JobPhase.RUNNING, {}, []),
    ("rejection report does not change the job", RUNNING,
     TransitionRejected(event_type="round.started", seq=3, reason="r"), JobPhase.RUNNING, {}, []),
    ("user stop while running stops every live node", RUNNING, JobStopped(), JobPhase.STOPPED,
     {"rdzv.active": False, "reason": "stopped by user"},
     [(StopNode, "stop-node/node-0/1"), (StopNode, "stop-node/node-1/1")]),
    ("external failure while recovering stops live nodes, relaunched ones too", LOST,
     JobFailed(reason="quota", message="m"), JobPhase.FAILED, {"reason": "quota", "message": "m"},
     [(StopNode, "stop-node/node-0/1"), (StopNode, "stop-node/node-1/2")]),
    ("a succeeded job records a node exit", SUCCEEDED, NodeExited(node_id="node-0", incarnation=1, exit_code=0),
     JobPhase.SUCCEEDED, {"nodes.node-0.phase": NodePhase.EXITED, "nodes.node-0.exit_code": 0}, []),
    ("a stopped job records a node loss and still kills it", STOPPED, NodeLost(node_id="node-0", incarnation=1),
     JobPhase.STOPPED, {"nodes.node-0.phase": NodePhase.LOST}, [(KillNode, "kill/node-0/1")]),
]


@pytest.mark.parametrize(("start", "event", "phase", "fields", "effects"), [r[1:] for r in ALLOWED],
                         ids=[r[0] for r in ALLOWED])
def test_allowed_job_transition(
    start: JobState, event: Event, phase: JobPhase, fields: dict[str, object], effects: EffectIds
) -> None:
    result = transition(start, event, now=NOW, seq=start.seq + 1)
    assert result.rejected is None
    assert result.state.phase is phase
    for path, value in fields.items():
        assert field(result.state, path) == value, path
    # a round's start is keyed by the record that planned it too (see rendezvous.round_key): "emit/round/N" here
    planned_at = f"/at/{start.seq + 1}"
    assert [(type(e), e.id.removesuffix(planned_at) if e.id.startswith("emit/round/") else e.id)
            for e in result.effects] == effects
    assert result.state.seq == start.seq + 1


# -- terminal phases absorb ---------------------------------------------------------------------------------------

LATE_EVENTS: list[Event] = [
    SPEC, NodeRequested(node_id="node-0", incarnation=2), NodeStarted(node_id="node-0", incarnation=1),
    NodeJoined(node_id="node-0", incarnation=1), round_started(2), WorkersStarted(node_id="node-0", round=1),
    WorkersSucceeded(node_id="node-0", round=1), RoundCompleted(round=1), failed(), decided(1),
    TimerFired(name=JoinTimeout()), TimerFired(name=LastCall(round=2)), StepProgress(round=1, step=99),
    CheckpointCommitted(step=99), JobSucceeded(), JobFailed(reason="late"), JobStopped(),
]


@pytest.mark.parametrize("end", [SUCCEEDED, STOPPED, FAILED], ids=lambda s: s.phase.value)
@pytest.mark.parametrize("event", LATE_EVENTS, ids=lambda e: type(e).__name__)
def test_terminal_phase_absorbs_every_later_event(end: JobState, event: Event) -> None:
    result = transition(end, event, now=NOW)
    assert result.rejected is None
    assert result.state == end
    assert result.effects == ()


# -- forbidden transitions ---------------------------------------------------------------------------------------

FORBIDDEN: list[tuple[str, JobState, Event, str]] = [
    ("node event before submission", NEW, NodeJoined(node_id="node-0", incarnation=1),
     "node.joined before the job was submitted"),
    ("success before submission", NEW, JobSucceeded(), "job.succeeded before the job was submitted"),
    ("decision before submission", NEW, decided(1), "before the job was submitted"),
    ("timer before submission", NEW, TimerFired(name=JoinTimeout()), "before the job was submitted"),
    ("submitted twice", STARTING, SPEC, "job 'j' was already submitted"),
    ("resumed before it was submitted", NEW, RESUME, "cannot be resumed: it was never submitted"),
    ("resumed with a bad spec", SUCCEEDED_EXITED, dataclasses.replace(RESUME, min_nodes=0), "1 <= MIN <= MAX"),
    ("MIN of zero", NEW, dataclasses.replace(SPEC, min_nodes=0), "1 <= MIN <= MAX"),
    ("MAX below MIN", NEW, dataclasses.replace(SPEC, min_nodes=3, max_nodes=2), "1 <= MIN <= MAX"),
    ("no processes per node", NEW, dataclasses.replace(SPEC, nproc_per_node=0), "nproc_per_node 0"),
    ("negative restart budget", NEW, dataclasses.replace(SPEC, max_restarts=-1), "must not be negative"),
    ("negative relaunch budget", NEW, dataclasses.replace(SPEC, max_node_relaunches=-1), "must not be negative"),
    ("a node never requested starts", STARTING, NodeStarted(node_id="node-5", incarnation=1), "never requested"),
    ("relaunch of a live node", RUNNING, NodeRequested(node_id="node-0", incarnation=2), "lost or exit first"),
    ("join of an incarnation never requested", RUNNING, NodeJoined(node_id="node-0", incarnation=2),
     "incarnation 2 was never requested"),
    ("round number skips ahead", ALL_JOINED_NO_ROUND, round_started(2), "cannot start after round 0"),
    ("round names a node that never joined", ALL_JOINED_NO_ROUND, round_started(1, ("node-0", "node-9")),
     "have not joined: ['node-9']"),
    ("round names a node that has not joined yet", ONE_JOINED, round_started(1), "have not joined: ['node-1']"),
    ("round names a lost node", LOST, round_started(2), "have not joined: ['node-1']"),
    ("round with no members", ALL_JOINED_NO_ROUND, round_started(1, ()), "unknown nodes (none)"),
    ("round while running", RUNNING, round_started(2), "cannot start while the job is running"),
    ("round while a failure awaits its decision", AWAITING, round_started(2),
     "cannot start while the job is recovering"),
    ("decision with no failure", RUNNING, decided(1), "no failure of round 1 is waiting"),
    ("decision for another round", AWAITING, decided(7), "no failure of round 7 is waiting"),
    ("second decision for the same failure", RESTARTED, decided(1, RecoveryAction.FAIL), "no failure of round 1"),
    ("workers started on a non-member", E_RUNNING_TWO, WorkersStarted(node_id="node-2", round=1),
     "node node-2 is not a member of round 1"),
    ("workers succeeded on a non-member", E_RUNNING_TWO, WorkersSucceeded(node_id="node-2", round=1),
     "node node-2 is not a member of round 1"),
    ("restart requested of a round that is not running", STARTING,
     RestartRequested(round=1, reason="r", by="p"), "p asked to restart round 1, but round 0 is not running"),
    ("restart requested while a failure awaits its decision", AWAITING,
     RestartRequested(round=1, reason="r", by="p"), "a failure awaits a decision"),
    ("stacks requested of a round that is not running", STARTING,
     StacksRequested(round=1, reason="r", by="p"), "p asked for the stacks of round 1, but round 0 is not running"),
    ("relaunch requested of a replaced incarnation", LOST,
     RelaunchRequested(node_id="node-1", incarnation=1, reason="r", by="p"), "but incarnation 2 is requested"),
    ("relaunch requested of an unknown node", RUNNING,
     RelaunchRequested(node_id="node-9", incarnation=1, reason="r", by="p"), "but it is unknown"),
]


@pytest.mark.parametrize(("start", "event", "reason"), [r[1:] for r in FORBIDDEN], ids=[r[0] for r in FORBIDDEN])
def test_forbidden_job_transition_is_rejected_unchanged(start: JobState, event: Event, reason: str) -> None:
    result = transition(start, event, now=NOW, seq=start.seq + 1)
    assert result.rejected is not None
    assert reason in result.rejected
    assert result.state is start
    assert result.effects == ()


# -- what the effects carry --------------------------------------------------------------------------------------


def test_submit_requests_nodes_through_emitted_events_and_times_the_join() -> None:
    effects = transition(NEW, SPEC, now=NOW).effects
    assert effects == (
        Emit(key="request/node-0/1", event=NodeRequested(node_id="node-0", incarnation=1)),
        Emit(key="request/node-1/1", event=NodeRequested(node_id="node-1", incarnation=1)),
        StartTimer(name=JoinTimeout(), at=NOW + 60.0),
    )


def test_last_call_timer_is_due_after_the_last_call_timeout() -> None:
    result = transition(E_ONE_JOINED_ONE_STARTED, NodeJoined(node_id="node-1", incarnation=1), now=NOW)
    assert result.effects == (StartTimer(name=LastCall(round=1), at=NOW + 5.0),)


def test_last_call_starts_a_round_with_the_nodes_joined_so_far() -> None:
    (effect,) = transition(E_TWO_JOINED, TimerFired(name=LastCall(round=1)), now=NOW).effects
    assert effect == Emit(key=round_key(1, E_TWO_JOINED.seq), event=round_started(1, MEMBERS))


def test_restart_within_budget_starts_the_same_members_in_the_same_order() -> None:
    (effect,) = transition(AWAITING, decided(1), now=NOW).effects
    assert effect == Emit(key=round_key(2, AWAITING.seq), event=round_started(2, MEMBERS, restarts=1))


def test_restart_with_budget_spent_fails_with_the_failures_error_tail() -> None:
    (effect,) = transition(AWAITING_LAST_RESTART, decided(2, reason="NCCL error"), now=NOW).effects
    assert isinstance(effect, Emit) and isinstance(effect.event, JobFailed)
    assert effect.event == JobFailed(reason="max restarts exhausted (1); last failure: NCCL error", message=TAIL,
                                     node_id="node-1", rank=3)


def test_fail_decision_fails_with_its_own_words_before_the_failures() -> None:
    event = decided(1, RecoveryAction.FAIL, reason="user code error", message="same traceback twice",
                    node_id="node-1", rank=2)
    (effect,) = transition(AWAITING, event, now=NOW).effects
    assert effect == Emit(key="job-end", event=JobFailed(reason="user code error", message="same traceback twice",
                                                         node_id="node-1", rank=2))
    (fallback,) = transition(AWAITING, decided(1, RecoveryAction.FAIL, reason="r"), now=NOW).effects
    assert fallback == Emit(key="job-end", event=JobFailed(reason="r", message=TAIL, node_id="node-0", rank=1))


def test_member_lost_stops_the_other_members_workers_and_relaunches_it() -> None:
    result = transition(RUNNING, NodeLost(node_id="node-1", incarnation=1), now=NOW)
    assert result.effects == (
        KillNode(node_id="node-1", incarnation=1),
        StopWorkers(node_id="node-0", incarnation=1, round=1, reason="node node-1 lost"),
        Emit(key="request/node-1/2", event=NodeRequested(node_id="node-1", incarnation=2)),
        # the replacement must join in time
        StartTimer(name=RejoinTimeout(node_id="node-1", incarnation=2), at=NOW + SPEC.join_timeout_s),
    )


def test_relaunched_member_keeps_its_node_rank() -> None:
    restarted = after(*up("node-0", 2), start=after(NodeLost(node_id="node-0", incarnation=1), start=RUNNING))
    assert restarted.rdzv.round == 2
    assert restarted.rdzv.members == MEMBERS


def test_relaunch_budget_spent_fails_naming_the_node() -> None:
    (*_, effect) = transition(RUNNING_AFTER_RELAUNCH, NodeLost(node_id="node-1", incarnation=2), now=NOW).effects
    assert isinstance(effect, Emit) and isinstance(effect.event, JobFailed)
    assert effect.event.node_id == "node-1"
    assert "max_node_relaunches=1" in effect.event.reason
    assert "fewer than 2 nodes remain" in effect.event.reason


def test_join_timeout_failure_says_how_many_joined_and_what_to_do() -> None:
    (effect,) = transition(ONE_JOINED, TimerFired(name=JoinTimeout()), now=NOW).effects
    assert isinstance(effect, Emit) and isinstance(effect.event, JobFailed)
    assert "only 1 of at least 2 nodes joined within 60 s" in effect.event.reason
    assert "raise the join timeout" in effect.event.reason


def test_end_keeps_the_reason_and_message() -> None:
    result = transition(RUNNING, JobFailed(reason="r", message="tail"), now=NOW)
    assert (result.state.reason, result.state.message) == ("r", "tail")


def test_seq_records_the_last_event_folded_and_never_goes_back() -> None:
    assert transition(RUNNING, StepProgress(round=1, step=1), now=NOW, seq=500).state.seq == 500
    assert transition(RUNNING, StepProgress(round=1, step=1), now=NOW, seq=1).state.seq == RUNNING.seq
    assert transition(RUNNING, round_started(5), now=NOW, seq=500).state.seq == RUNNING.seq  # rejected


def test_the_default_decision_says_why_no_plugin_decided_and_who_decided() -> None:
    (now,) = transition(RUNNING_NO_DECIDER, failed(), now=NOW).effects
    assert isinstance(now, Emit) and isinstance(now.event, RecoveryDecided)
    assert now.event.decided_by == "default" and now.event.action is RecoveryAction.RESTART
    assert "no diagnosis plugin is running" in now.event.reason
    (late,) = transition(AWAITING, TimerFired(name=DecisionTimeout(round=1)), now=NOW).effects
    assert isinstance(late, Emit) and isinstance(late.event, RecoveryDecided)
    assert "no decision within 3 s (decision_timeout_s)" in late.event.reason
    name_error = WorkerFailed(node_id="node-0", round=1, local_rank=0, rank=0, exit_code=1,
                              error_tail="Traceback (most recent call last):\nNameError: name 'x' is not defined")
    (fatal,) = transition(RUNNING_NO_DECIDER, name_error, now=NOW).effects
    assert isinstance(fatal, Emit) and isinstance(fatal.event, RecoveryDecided)
    assert fatal.event.action is RecoveryAction.FAIL and "NameError in rank 0" in fatal.event.reason


def test_timers_are_part_of_the_state_armed_once_and_disarmed_when_fired() -> None:
    assert RUNNING.timers == {JoinTimeout(): NOW + 60.0}
    assert AWAITING.timers == {JoinTimeout(): NOW + 60.0, DecisionTimeout(round=1): NOW + 3.0}
    again = transition(AWAITING, failed("node-1"), now=NOW + 100).state  # a follow-on failure arms nothing new
    assert again.timers == AWAITING.timers
    fired = transition(AWAITING, TimerFired(name=JoinTimeout()), now=NOW).state
    assert fired.timers == {DecisionTimeout(round=1): NOW + 3.0}


def test_a_resumed_job_has_fresh_budgets_and_ends_again_under_a_key_of_its_own() -> None:
    resumed = after(RESUME, *up("node-0", 2), *up("node-1", 2), start=SUCCEEDED_EXITED)
    assert (resumed.phase, resumed.rdzv.round, resumed.rdzv.members) == (JobPhase.RUNNING, 2, MEMBERS)
    relaunch = transition(resumed, NodeLost(node_id="node-1", incarnation=2), now=NOW).effects
    assert (Emit, "emit/request/node-1/3") in [(type(e), e.id) for e in relaunch]  # budget 1, counted anew
    one_done = after(WorkersSucceeded(node_id="node-0", round=2), start=resumed)
    ends = transition(one_done, WorkersSucceeded(node_id="node-1", round=2), now=NOW).effects
    assert [e.id for e in ends] == ["emit/job-end/1"]
    again = after(JobSucceeded(), NodeExited(node_id="node-0", incarnation=2),
                  NodeExited(node_id="node-1", incarnation=2), RESUME, start=one_done)
    assert (again.life, again.phase, again.timers) == (2, JobPhase.STARTING, {JoinTimeout(life=2): NOW + 60.0})


def test_relaunch_decision_replaces_the_failed_workers_node_and_keeps_its_host_out() -> None:
    result = transition(AWAITING, decided(1, RecoveryAction.RELAUNCH, reason="GPU 0: XID 79", node_id="node-0"),
                        now=NOW)
    assert result.effects == (
        KillNode(node_id="node-0", incarnation=1),
        StopWorkers(node_id="node-1", incarnation=1, round=1, reason="node node-0 lost"),
        Emit(key="request/node-0/2", event=NodeRequested(node_id="node-0", incarnation=2,
                                                          avoid_hosts=("host-node-0",))),
        StartTimer(name=RejoinTimeout(node_id="node-0", incarnation=2), at=NOW + SPEC.join_timeout_s),
    )
    state = result.state
    assert (state.awaiting_decision, state.restarts, state.phase) == (False, 1, JobPhase.RECOVERING)
    assert state.excluded_hosts == {"host-node-0"}
    request = result.effects[2]
    assert isinstance(request, Emit)
    assert after(request.event, start=state).nodes["node-0"].incarnation == 2


def test_relaunch_decision_with_the_restart_budget_spent_fails_the_job() -> None:
    (effect,) = transition(AWAITING_LAST_RESTART, decided(2, RecoveryAction.RELAUNCH, reason="XID 79",
                                                          node_id="node-1"), now=NOW).effects
    assert isinstance(effect, Emit) and isinstance(effect.event, JobFailed)
    assert effect.event.reason == "max restarts exhausted (1); last failure: XID 79"


def test_a_relaunched_node_is_launched_away_from_the_excluded_hosts() -> None:
    state = after(decided(1, RecoveryAction.RELAUNCH, reason="XID 79", node_id="node-0"), start=AWAITING)
    launch = transition(state, NodeRequested(node_id="node-0", incarnation=3, avoid_hosts=("host-node-0",)),
                        now=NOW)
    assert launch.rejected is not None  # incarnation 2 is already requested (the follow-up was folded)
    assert state.nodes["node-0"].incarnation == 2
    # the launch effect of the folded request carried the hosts to avoid
    fresh = transition(after(NodeLost(node_id="node-0", incarnation=1), start=RUNNING, follow=False),
                       NodeRequested(node_id="node-0", incarnation=2, avoid_hosts=("h",)), now=NOW)
    assert LaunchNode(node_id="node-0", incarnation=2, avoid_hosts=("h",)) in fresh.effects


def test_a_node_the_platform_cannot_start_fails_the_job_at_once_with_its_reason() -> None:
    exited = NodeExited(node_id="node-1", incarnation=1, reason="ErrImagePull: no such image", permanent=True)
    result = transition(RUNNING, exited, now=NOW)
    (*_, effect) = result.effects
    assert isinstance(effect, Emit) and isinstance(effect.event, JobFailed)
    assert effect.event.node_id == "node-1"
    assert "node node-1 cannot be started: ErrImagePull: no such image" in effect.event.reason
    assert not any(isinstance(e, Emit) and isinstance(e.event, NodeRequested) for e in result.effects)


def test_a_launch_the_platform_refuses_as_specified_fails_the_job_instead_of_relaunching() -> None:
    refused = dataclasses.replace(effect_failed("launch-node", "node-1"), error="PlatformRejected: memory 'lots'",
                                  permanent=True)
    (effect,) = transition(after(SPEC, *up("node-0")), refused, now=NOW).effects
    assert isinstance(effect, Emit) and isinstance(effect.event, JobFailed)
    assert "memory 'lots'" in effect.event.reason and "fix the job's specification" in effect.event.reason
    transient = transition(after(SPEC, *up("node-0")), effect_failed("launch-node", "node-1"), now=NOW)
    assert any(isinstance(e, Emit) and isinstance(e.event, NodeRequested) for e in transient.effects)


def test_a_pending_node_is_noted_and_a_join_timeout_says_what_the_platform_said_of_it() -> None:
    pending = NodePending(node_id="node-1", incarnation=1, pending_s=120.0, reason="Unschedulable: 0/3 nodes")
    noted = transition(ONE_JOINED, pending, now=NOW).state
    assert noted.nodes["node-1"].pending == "not scheduled for 120 s: Unschedulable: 0/3 nodes"
    assert noted.phase is ONE_JOINED.phase and noted.nodes["node-0"] == ONE_JOINED.nodes["node-0"]
    (effect,) = transition(noted, TimerFired(name=JoinTimeout()), now=NOW).effects
    assert isinstance(effect, Emit) and isinstance(effect.event, JobFailed)
    assert "node-1 not scheduled for 120 s: Unschedulable: 0/3 nodes" in effect.event.reason
    started = transition(noted, NodeStarted(node_id="node-1", incarnation=1, host="h"), now=NOW).state
    assert started.nodes["node-1"].pending == ""
    assert transition(started, pending, now=NOW).state == started  # stale: it started since


def test_a_node_killed_for_its_memory_is_relaunched_with_the_resources_decided_for_it() -> None:
    oom = NodeExited(node_id="node-1", incarnation=1, signal=9, reason="OOMKilled", oom=True)
    waiting = transition(RUNNING, oom, now=NOW)
    assert waiting.state.awaiting_resources == frozenset({"node-1"})
    resources = ResourcesTimeout(node_id="node-1", incarnation=1)
    assert StartTimer(name=resources, at=NOW + SPEC.decision_timeout_s) in waiting.effects
    assert not any(isinstance(e, Emit) and isinstance(e.event, NodeRequested) for e in waiting.effects)
    more = NodeResourcesDecided(node_id="node-1", incarnation=1, resources=(("memory", "12Gi"),), reason="x1.5")
    decided_ = transition(waiting.state, more, now=NOW)
    request = next(e.event for e in decided_.effects if isinstance(e, Emit))
    assert request == NodeRequested(node_id="node-1", incarnation=2, resources=(("memory", "12Gi"),))
    assert decided_.state.awaiting_resources == frozenset()
    launched = transition(decided_.state, request, now=NOW)
    assert LaunchNode(node_id="node-1", incarnation=2, resources=(("memory", "12Gi"),)) in launched.effects
    assert transition(decided_.state, more, now=NOW).rejected is not None  # decided once
    assert transition(decided_.state, TimerFired(name=resources), now=NOW).effects == ()


def test_with_no_decision_in_time_the_node_is_relaunched_with_what_it_had() -> None:
    started = after(NodeStarted(node_id="node-1", incarnation=1, host="h", resources=(("memory", "8Gi"),)),
                    start=RUNNING)
    assert started.nodes["node-1"].resources == (("memory", "8Gi"),)
    waiting = transition(started, NodeExited(node_id="node-1", incarnation=1, oom=True), now=NOW).state
    late = transition(waiting, TimerFired(name=ResourcesTimeout(node_id="node-1", incarnation=1)), now=NOW)
    request = next(e.event for e in late.effects if isinstance(e, Emit))
    assert request == NodeRequested(node_id="node-1", incarnation=2, resources=(("memory", "8Gi"),))
