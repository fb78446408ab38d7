"""The job machine: the whole job's state, folded from its event log.

Phases and allowed transitions::

    NEW ──submitted──▶ STARTING ──round started──▶ RUNNING ◀──round started──┐
                                                     │                        │
                                                     └──worker failed /──▶ RECOVERING
                                                        node lost
    STARTING | RUNNING | RECOVERING ──▶ SUCCEEDED | FAILED | STOPPED   (terminal: absorb every later event)
    any phase but NEW ──resumed──▶ STARTING   (``stead run`` again under the same job name)

The job machine owns the node machines (one per node id) and the rendezvous
machine, routes each event to them, and adds the job-level decisions: when to
start a round, when the job succeeded, when the restart budget is spent.

A worker failure always reaches a decision. The plugins that decide failures
(``deciders``, announced by ``PluginsStarted``) get ``decision_timeout_s``; when
none is running, none answered in time, or the last one was disabled while a
failure waited, the built-in policy (:mod:`.policy`) decides. An effect that
could not be carried out (``EffectFailed``) is decided here too: a node that
could not be launched counts as lost (relaunched within its budget), workers
that could not be started break the round (a restart within the budget).
Plugins ask for actions through request events (``RestartRequested``,
``RelaunchRequested``), checked here like any other event.

The armed timers are part of the state (``timers``), so that replaying the log
re-arms exactly the timers that were pending; so are the commands agents have not
acknowledged (``commands``, see :mod:`.commands`), so that a new master resends
exactly those.
"""

from __future__ import annotations

import dataclasses

from stead.core.events import (
    CheckHealthId,
    CheckpointCommitted,
    DecisionTimeout,
    EffectFailed,
    Event,
    GrowWindow,
    HealthChecked,
    HealthCheckStarted,
    HealthTimeout,
    JobFailed,
    JobResumed,
    JobStopped,
    JobSubmitted,
    JobSucceeded,
    JoinTimeout,
    LastCall,
    MembershipDecided,
    NodeExited,
    NodeHealthReported,
    NodeJoined,
    NodeLost,
    NodePending,
    NodeRequested,
    NodeResourcesDecided,
    NodeStarted,
    NumericsReported,
    PluginFailed,
    PluginsStarted,
    RecoveryAction,
    RecoveryDecided,
    RejoinTimeout,
    RelaunchRequested,
    ResizeWait,
    ResourcesTimeout,
    RestartRequested,
    RestoreBound,
    RoundCompleted,
    RoundStarted,
    StacksRequested,
    StepProgress,
    TimerFired,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.statemachine import commands, membership, node_end, rounds
from stead.core.statemachine import health as health_machine
from stead.core.statemachine import node as node_machine
from stead.core.statemachine import rendezvous as rdzv_machine
from stead.core.statemachine.base import Transition, reject
from stead.core.statemachine.effects import (
    DumpStacks,
    Effect,
    Emit,
    LaunchNode,
    StartTimer,
    StartWorkers,
    StopNode,
    StopWorkers,
)
from stead.core.statemachine.node import NodePhase, NodeState
from stead.core.statemachine.node_counts import Incarnations, with_node
from stead.core.statemachine.policy import default_decision
from stead.core.statemachine.rendezvous import RendezvousState
from stead.core.statemachine.state import HealthState, JobPhase, JobState

__all__ = ["JobPhase", "JobState", "node_ids", "transition"]


#: events that make sense only for a submitted job
_NEEDS_JOB = (NodeRequested, NodeStarted, NodeJoined, NodeLost, NodeExited, RoundStarted, RoundCompleted,
              WorkersStarted, WorkersSucceeded, WorkerFailed, RecoveryDecided, TimerFired, StepProgress,
              CheckpointCommitted, JobSucceeded, EffectFailed, RestartRequested, RelaunchRequested,
              StacksRequested, HealthCheckStarted, NodeHealthReported, HealthChecked, MembershipDecided,
              NodeResourcesDecided)


def node_ids(count: int) -> tuple[str, ...]:
    return tuple(f"node-{i}" for i in range(count))


def transition(state: JobState, event: Event, *, now: float, seq: int = 0) -> Transition[JobState]:
    """Apply ``event`` (the log's record ``seq``) to ``state``: pure, no IO, no clock.

    A refused event returns ``state`` unchanged (see :func:`~stead.core.statemachine.fold.fold`
    for the log's bookkeeping of refused records).
    """
    result = _transition(dataclasses.replace(state, seq=max(seq, state.seq)), event, now=now)
    if result.rejected is not None:
        return Transition(state, (), result.rejected)
    tracked = commands.track(_with_timers(result.state, event, result.effects), event, result.effects)
    return Transition(tracked, result.effects)


def _with_timers(state: JobState, event: Event, effects: tuple[Effect, ...]) -> JobState:
    """Track armed timers: a StartTimer arms one (the first arming of a name holds), TimerFired disarms it."""
    armed = [e for e in effects if isinstance(e, StartTimer) and e.name not in state.timers]
    fired = event.name if isinstance(event, TimerFired) and event.name in state.timers else None
    if not armed and fired is None:
        return state
    timers = {name: at for name, at in state.timers.items() if name != fired}
    timers.update((e.name, e.at) for e in armed)
    return dataclasses.replace(state, timers=timers)


def _transition(state: JobState, event: Event, *, now: float) -> Transition[JobState]:
    if isinstance(event, PluginsStarted):  # in any phase: a master announces its plugins when it starts
        return _deciders(dataclasses.replace(state, deciders=frozenset(event.deciders)),
                         why="no diagnosis plugin is running")
    if isinstance(event, JobResumed):
        return _resume(state, event, now=now)
    if state.phase.terminal:
        return _absorb(state, event, now=now)
    if state.phase is JobPhase.NEW and not isinstance(event, JobSubmitted):
        if isinstance(event, (JobFailed, JobStopped)):
            return _end(state, event)
        if isinstance(event, _NEEDS_JOB):
            return reject(state, f"{event.type_name} before the job was submitted")
        return Transition(state)  # a report (a plugin's failure, a plugin's own event) changes no job
    match event:
        case JobSubmitted():
            return _submit(state, event, now=now)
        case NodeRequested() | NodeStarted() | NodeJoined() | NodeLost() | NodeExited():
            return _node_event(state, event, now=now)
        case RoundStarted():
            return _round_started(state, event)
        case WorkersStarted() | RoundCompleted():
            return _rdzv_event(state, event)
        case WorkersSucceeded():
            result = _rdzv_event(state, event)
            if result.rejected is None and result.state.rdzv.all_succeeded:
                done = Emit(key=state.end_key, event=JobSucceeded())
                return Transition(result.state, (*result.effects, done))
            return result
        case WorkerFailed():
            return _worker_failed(state, event, now=now)
        case RecoveryDecided():
            return _decided(state, event, now=now)
        case PluginFailed(disabled=True) if state.deciders and event.plugin in state.deciders:
            return _deciders(dataclasses.replace(state, deciders=state.deciders - {event.plugin}),
                             why=f"the plugin {event.plugin} was disabled")
        case EffectFailed():
            return _effect_failed(state, event, now=now)
        case RestartRequested():
            return _restart_requested(state, event, now=now)
        case RelaunchRequested():
            return _relaunch_requested(state, event, now=now)
        case StacksRequested():
            return _stacks_requested(state, event, seq=state.seq)
        case MembershipDecided():
            return rounds.decided(state, event, now=now)
        case NodeResourcesDecided():
            return node_end.resources_decided(state, event, now=now)
        case NodePending():
            node = state.nodes.get(event.node_id)
            if node is None or node.incarnation != event.incarnation or node.phase is not NodePhase.REQUESTED:
                return Transition(state)  # it started meanwhile, or was replaced: nothing pends
            return Transition(_with_node(state, dataclasses.replace(
                node, pending=f"not scheduled for {event.pending_s:.0f} s: {event.reason}")))
        case HealthCheckStarted() | NodeHealthReported() | HealthChecked():
            return _health_event(state, event, now=now)
        case TimerFired():
            return _timer(state, event, now=now)
        case StepProgress():
            return Transition(dataclasses.replace(state, step=max(event.step, state.step or 0)))
        case CheckpointCommitted():
            # the latest commit, not the highest: after a rollback to an older step, that step is in force
            committed = dataclasses.replace(state, checkpoint_step=event.step)
            if state.resizing:  # a step boundary every rank holds: the waiting resize goes now
                return rounds.resize(committed, now=now)
            return Transition(committed)
        case JobSucceeded() | JobFailed() | JobStopped():
            return _end(state, event)
        case NumericsReported():
            return Transition(dataclasses.replace(state, numerics_reports=state.numerics_reports + 1))
        case _:
            return Transition(state)  # plugin events and error reports do not change the job


def _absorb(state: JobState, event: Event, *, now: float) -> Transition[JobState]:
    """A finished job stays finished; it only keeps track of its nodes going away."""
    if isinstance(event, (NodeExited, NodeLost)):
        result = node_machine.transition(state.nodes.get(event.node_id), event, now=now)
        if result.rejected is None and result.state is not None:
            return Transition(_with_node(state, result.state), result.effects)  # a lost node is still killed
    return Transition(state)


def _submit(state: JobState, event: JobSubmitted, *, now: float) -> Transition[JobState]:
    if state.phase is not JobPhase.NEW:
        return reject(state, f"job {event.job!r} was already submitted")
    problem = _spec_problem(event)
    if problem:
        return reject(state, f"job {event.job!r} cannot run: {problem}")
    effects: list[Effect] = [
        Emit(key=f"request/{node}/1", event=NodeRequested(node_id=node, incarnation=1))
        for node in node_ids(event.start_nodes or event.max_nodes)
    ]
    effects.append(StartTimer(name=_join_timer(state), at=now + event.join_timeout_s))
    return Transition(dataclasses.replace(state, phase=JobPhase.STARTING, spec=event), tuple(effects))


def _resume(state: JobState, event: JobResumed, *, now: float) -> Transition[JobState]:
    """Run the job again: every node a new incarnation, the rounds numbered on, fresh budgets."""
    if state.phase is JobPhase.NEW:
        return reject(state, f"job {event.job!r} cannot be resumed: it was never submitted")
    problem = _spec_problem(event)
    if problem:
        return reject(state, f"job {event.job!r} cannot resume: {problem}")
    effects: list[Effect] = []
    nodes = dict(state.nodes)
    for node in list(nodes.values()):
        if node.phase.alive:  # the previous run's runner died without stopping it
            lost = NodeLost(node_id=node.node_id, incarnation=node.incarnation, reason="the job was resumed")
            result = node_machine.transition(node, lost, now=now)
            if result.state is not None:
                nodes[node.node_id] = result.state
            effects += result.effects
    life = state.life + 1
    resumed = dataclasses.replace(
        state, phase=JobPhase.STARTING, spec=event.submitted(), nodes=nodes, restarts=0, awaiting_decision=False,
        last_failure=None, reason="", message="", timers={}, life=life,
        rdzv=RendezvousState(round=state.rdzv.round), health=HealthState(check=state.health.check),
        resumed_at={n: s.incarnation for n, s in nodes.items()}, target=None, retired=frozenset(), resizing=False,
        awaiting_resources=frozenset())
    for node_id in node_ids(event.start_nodes or event.max_nodes):
        incarnation = nodes[node_id].incarnation + 1 if node_id in nodes else 1
        effects.append(Emit(key=f"request/{node_id}/{incarnation}",
                            event=NodeRequested(node_id=node_id, incarnation=incarnation)))
    effects.append(StartTimer(name=_join_timer(resumed), at=now + event.join_timeout_s))
    return Transition(resumed, tuple(effects))


def _join_timer(state: JobState) -> JoinTimeout:
    return JoinTimeout(life=state.life)


def _spec_problem(spec: JobSubmitted) -> str:
    if spec.min_nodes < 1 or spec.max_nodes < spec.min_nodes:
        return f"nodes {spec.min_nodes}:{spec.max_nodes} must satisfy 1 <= MIN <= MAX"
    if spec.start_nodes is not None and not spec.min_nodes <= spec.start_nodes <= spec.max_nodes:
        return f"start_nodes {spec.start_nodes} must be within MIN:MAX {spec.min_nodes}:{spec.max_nodes}"
    if spec.nproc_per_node < 1:
        return f"nproc_per_node {spec.nproc_per_node} must be at least 1"
    if spec.max_restarts < 0 or spec.max_node_relaunches < 0:
        return "max_restarts and max_node_relaunches must not be negative"
    if spec.health_check not in health_machine.HEALTH_MODES:
        return f"health_check {spec.health_check!r} must be one of {', '.join(health_machine.HEALTH_MODES)}"
    if not spec.health_timeout_s > 0 or not spec.health_slow_factor >= 1:
        return "health_timeout_s must be positive and health_slow_factor at least 1"
    return ""


def _with_node(state: JobState, node: NodeState) -> JobState:
    return dataclasses.replace(state, nodes=with_node(state.nodes, node))


def _node_event(
    state: JobState, event: NodeRequested | NodeStarted | NodeJoined | NodeLost | NodeExited, *, now: float
) -> Transition[JobState]:
    before = state.nodes.get(event.node_id)
    result = node_machine.transition(before, event, now=now)
    if result.rejected is not None or result.state is None:
        return reject(state, result.rejected or "node event rejected")
    after = result.state
    if isinstance(event, NodeJoined) and before is not None and before.phase is not NodePhase.JOINED:
        assert state.spec is not None
        first = state.resumed_at.get(after.node_id, 0) + 1
        after = dataclasses.replace(after, unchecked=health_machine.needs_check(
            state.spec.health_check, after.incarnation, first))
    new = _with_node(state, after)
    effects = list(result.effects)
    if isinstance(event, NodeJoined) and (before is None or before.phase is not NodePhase.JOINED):
        # (a node registering again, for a new master or a retried call, changes no plan)
        new, planned = rounds.plan_or_grow(new, now=now)
        effects += planned
    went_away = before is not None and before.phase.alive and not after.phase.alive
    if went_away and isinstance(event, NodeExited) and event.permanent and after.node_id not in new.retired:
        return Transition(new, (*effects, node_end.cannot_start(new, after.node_id, event.reason)))
    if went_away:
        new, more = node_end.node_gone(new, after, now=now, oom=isinstance(event, NodeExited) and event.oom)
        effects += more
        if after.node_id in new.health.nodes:
            effects += health_machine.due(new)
    return Transition(new, tuple(effects))


def _round_started(state: JobState, event: RoundStarted) -> Transition[JobState]:
    if state.phase not in (JobPhase.STARTING, JobPhase.RECOVERING) or state.awaiting_decision:
        return reject(state, f"round {event.round} cannot start while the job is {state.phase.value}")
    joined, ready = set(state.joined), set(state.ready)
    not_joined = [n for n in event.members if n not in joined]
    if not_joined:
        return reject(state, f"round {event.round} names nodes that have not joined: {not_joined}")
    unchecked = [n for n in event.members if n not in ready]
    if unchecked:
        return reject(state, f"round {event.round} names nodes that have not passed their health check: {unchecked}")
    retired = [n for n in event.members if n in state.retired]
    if retired:
        return reject(state, f"round {event.round} names nodes retired when the job shrank: {retired}")
    result = rdzv_machine.transition(state.rdzv, event, incarnations=Incarnations(state.nodes))
    if result.rejected is not None:
        return reject(state, result.rejected)
    started = dataclasses.replace(state, phase=JobPhase.RUNNING, rdzv=result.state, resizing=False)
    return Transition(started, result.effects)


def _rdzv_event(
    state: JobState, event: WorkersStarted | RoundCompleted | WorkersSucceeded
) -> Transition[JobState]:
    result = rdzv_machine.transition(state.rdzv, event, incarnations=Incarnations(state.nodes))
    if result.rejected is not None:
        return reject(state, result.rejected)
    return Transition(dataclasses.replace(state, rdzv=result.state), result.effects)


def _worker_failed(state: JobState, event: WorkerFailed, *, now: float) -> Transition[JobState]:
    if event.round != state.rdzv.round or not state.rdzv.active or state.awaiting_decision:
        return Transition(state)  # a late or follow-on failure of a round already being handled
    assert state.spec is not None
    waiting = dataclasses.replace(state, phase=JobPhase.RECOVERING, awaiting_decision=True, last_failure=event)
    if state.deciders is not None and not state.deciders:
        return Transition(waiting, (_default(event, why="no diagnosis plugin is running"),))
    timer = StartTimer(name=DecisionTimeout(round=event.round), at=now + state.spec.decision_timeout_s)
    return Transition(waiting, (timer,))


def _default(failure: WorkerFailed, *, why: str) -> Emit:
    return Emit(key=f"decision/{failure.round}", event=default_decision(failure, why=why))


def _deciders(state: JobState, *, why: str) -> Transition[JobState]:
    """The deciders changed: a failure still waiting with none left is decided by the default policy now."""
    if state.awaiting_decision and not state.deciders and state.last_failure is not None:
        return Transition(state, (_default(state.last_failure, why=why),))
    return Transition(state)


def _decided(state: JobState, event: RecoveryDecided, *, now: float) -> Transition[JobState]:
    spec = state.spec
    assert spec is not None
    if not state.awaiting_decision or event.round != state.rdzv.round:
        return reject(state, f"no failure of round {event.round} is waiting for a decision")
    failure = state.last_failure
    if event.action is not RecoveryAction.FAIL and event.skip_steps:
        state = dataclasses.replace(state, skip_steps=state.skip_steps | frozenset(event.skip_steps))
    if event.action is not RecoveryAction.FAIL and event.restore_at_most is not None:
        bound = RestoreBound(step=event.restore_at_most, round=event.round)
        state = dataclasses.replace(state, restore_bounds=(*state.restore_bounds, bound))
    if event.action is not RecoveryAction.FAIL and not state.rdzv.active:
        # a member's end (its host lost, its pod OOM-killed) broke the round while the decision waited: the worker
        # failure was most likely that end seen from here, and the node's relaunch budget pays for it (as in
        # torchrun, a membership change spends no restart)
        settled = dataclasses.replace(state, awaiting_decision=False)
        return Transition(settled, rounds.plan(settled, now=now))
    if event.action is RecoveryAction.FAIL or state.restarts >= spec.max_restarts:
        reason = event.reason
        if event.action is not RecoveryAction.FAIL:
            reason = f"max restarts exhausted ({spec.max_restarts}); last failure: {event.reason}"
        failed = JobFailed(
            reason=reason,
            message=event.message or (failure.error_tail if failure else ""),
            node_id=event.node_id if event.node_id is not None else (failure.node_id if failure else None),
            rank=event.rank if event.rank is not None else (failure.rank if failure else None),
        )
        ended = Emit(key=state.end_key, event=failed)
        return Transition(dataclasses.replace(state, awaiting_decision=False), (ended,))
    restarted = dataclasses.replace(state, awaiting_decision=False, restarts=state.restarts + 1)
    node = state.nodes.get(event.node_id or "")
    if event.action is RecoveryAction.RELAUNCH and node is not None and node.phase.alive:
        # the node goes (its host excluded from then on) and the round with it: the node's loss stops the other
        # members' workers and relaunches it within its budget; the next round waits for it to join
        if node.host:
            restarted = dataclasses.replace(restarted, excluded_hosts=state.excluded_hosts | {node.host})
        lost = NodeLost(node_id=node.node_id, incarnation=node.incarnation, reason=f"relaunched: {event.reason}")
        return _node_event(restarted, lost, now=now)
    restarted = dataclasses.replace(restarted, rdzv=dataclasses.replace(state.rdzv, active=False))
    return Transition(restarted, rounds.plan(restarted, now=now))


def _timer(state: JobState, event: TimerFired, *, now: float) -> Transition[JobState]:
    spec = state.spec
    assert spec is not None
    match event.name:
        case DecisionTimeout(round=round_) if (round_ == state.rdzv.round and state.awaiting_decision
                                               and state.last_failure is not None):
            return Transition(state, (_default(state.last_failure, why=f"no decision within "
                                               f"{spec.decision_timeout_s:g} s (decision_timeout_s)"),))
        case JoinTimeout(life=life) if life == state.life and state.phase is JobPhase.STARTING:
            failed = JobFailed(
                reason=f"only {len(state.ready)} of at least {spec.min_nodes} nodes joined"
                f"{_awaiting_check(state)} within "
                f"{spec.join_timeout_s:g} s{_pending(state)}; check the nodes' logs or raise the join timeout "
                "(--rdzv-conf)"
            )
            return Transition(state, (Emit(key=state.end_key, event=failed),))
        case HealthTimeout(check=check) if check == state.health.check and state.health.running:
            return Transition(state, health_machine.verdict(state))
        case ResizeWait(round=round_) if round_ == state.rdzv.round and state.resizing:
            return rounds.resize(state, now=now)
        case GrowWindow(round=round_) if round_ == state.rdzv.round and state.phase is JobPhase.RUNNING:
            grown, effects = rounds.maybe_resize(state, now=now, gathered=True)
            return Transition(grown, effects)
        case RejoinTimeout():
            return rounds.rejoin_timeout(state, event.name)
        case ResourcesTimeout():
            return node_end.resources_timeout(state, event.name, now=now)
        case LastCall(round=round_) if (round_ == state.rdzv.round + 1 and not state.rdzv.active
                                        and not state.awaiting_decision):
            joined = membership.available(state)
            if len(joined) >= spec.min_nodes and state.phase in (JobPhase.STARTING, JobPhase.RECOVERING):
                members = rdzv_machine.order_members(state.rdzv.members, joined, state.target_nodes)
                started = RoundStarted(
                    round=state.rdzv.round + 1,
                    members=members,
                    nproc_per_node=spec.nproc_per_node,
                    restart_count=state.restarts,
                )
                return Transition(state, (Emit(key=rdzv_machine.round_key(started.round, state.seq),
                                               event=started),))
    return Transition(state)  # a timer of a round that has already started, of an earlier run, of a decided failure


def _pending(state: JobState) -> str:
    """What the platform said of the nodes it found no room for (", node-1 not scheduled for 120 s: ...")."""
    said = [f"{n} {s.pending}" for n, s in state.nodes.items() if s.pending and s.phase is NodePhase.REQUESTED]
    return "".join(f"; {line}" for line in said)


def _awaiting_check(state: JobState) -> str:
    waiting = len(state.joined) - len(state.ready)
    return f" ({waiting} more await their health check)" if waiting else ""


def _end(state: JobState, event: JobSucceeded | JobFailed | JobStopped) -> Transition[JobState]:
    phase = {JobSucceeded: JobPhase.SUCCEEDED, JobFailed: JobPhase.FAILED, JobStopped: JobPhase.STOPPED}[type(event)]
    message = event.message if isinstance(event, JobFailed) else ""
    ended = dataclasses.replace(
        state,
        phase=phase,
        reason=event.reason,
        message=message,
        awaiting_decision=False,
        rdzv=dataclasses.replace(state.rdzv, active=False),
        timers={},  # an ended job waits for nothing
    )
    effects = tuple(
        StopNode(node_id=n.node_id, incarnation=n.incarnation, reason=f"job {phase.value}")
        for n in state.nodes.values()
        if n.phase.alive
    )
    return Transition(ended, effects)


def _effect_failed(state: JobState, event: EffectFailed, *, now: float) -> Transition[JobState]:
    """An effect failed: a launch counts as the node lost, a start of workers breaks the round, a health check
    that could not be started lets its nodes in unchecked (the safety net broke: that is no verdict on them)."""
    if (isinstance(event.effect_id, CheckHealthId) and state.health.running
            and event.effect_id.check == state.health.check):
        skipped = HealthChecked(check=state.health.check, nodes=state.health.nodes,
                                skipped=f"the check could not be started on {event.node_id}: {event.error}")
        return Transition(state, (Emit(key=f"health-checked/{skipped.check}", event=skipped),))
    if event.kind == LaunchNode.kind and event.node_id is not None and event.incarnation is not None:
        node = state.nodes.get(event.node_id)
        if node is None or node.incarnation != event.incarnation or not node.phase.alive:
            return Transition(state)  # about a node that is already gone or replaced
        if event.permanent:
            gone = NodeExited(node_id=event.node_id, incarnation=event.incarnation, reason=event.error,
                              permanent=True)
            return _node_event(state, gone, now=now)
        lost = NodeLost(node_id=event.node_id, incarnation=event.incarnation,
                        reason=f"its launch failed: {event.error}")
        return _node_event(state, lost, now=now)
    if (event.kind == StartWorkers.kind and event.round == state.rdzv.round and state.rdzv.active
            and not state.awaiting_decision):  # (a decision pending for the round restarts it anyway)
        return _round_broken(state, f"workers of round {event.round} could not be started on {event.node_id}: "
                                    f"{event.error}", now=now)
    return Transition(state)  # a failed kill or stop changes nothing the machine tracks; it is on record


def _restart_requested(state: JobState, event: RestartRequested, *, now: float) -> Transition[JobState]:
    if event.round != state.rdzv.round or not state.rdzv.active or state.awaiting_decision:
        return reject(state, f"{event.by} asked to restart round {event.round}, but round {state.rdzv.round} is "
                             f"{'running' if state.rdzv.active else 'not running'}"
                             f"{' and a failure awaits a decision' if state.awaiting_decision else ''}")
    return _round_broken(state, f"restart requested by {event.by}: {event.reason}", now=now)


def _stacks_requested(state: JobState, event: StacksRequested, *, seq: int) -> Transition[JobState]:
    if event.round != state.rdzv.round or not state.rdzv.active:
        return reject(state, f"{event.by} asked for the stacks of round {event.round}, but round {state.rdzv.round} "
                             f"is {'running' if state.rdzv.active else 'not running'}")
    return Transition(state, tuple(
        DumpStacks(node_id=m, incarnation=state.nodes[m].incarnation, round=event.round, reason=event.reason,
                   request=seq)
        for m in state.rdzv.members if m in state.nodes and state.nodes[m].phase is NodePhase.JOINED))


def _relaunch_requested(state: JobState, event: RelaunchRequested, *, now: float) -> Transition[JobState]:
    node = state.nodes.get(event.node_id)
    if node is None or node.incarnation != event.incarnation or not node.phase.alive:
        current = f"incarnation {node.incarnation} is {node.phase.value}" if node else "it is unknown"
        return reject(state, f"{event.by} asked to relaunch node {event.node_id} incarnation {event.incarnation}, "
                             f"but {current}")
    lost = NodeLost(node_id=event.node_id, incarnation=event.incarnation,
                    reason=f"relaunch requested by {event.by}: {event.reason}")
    return _node_event(state, lost, now=now)


def _round_broken(state: JobState, reason: str, *, now: float) -> Transition[JobState]:
    """Stop the round's workers and start a new round, spending one restart; fail when the budget is spent."""
    assert state.spec is not None
    if state.restarts >= state.spec.max_restarts:
        failed = JobFailed(reason=f"max restarts exhausted ({state.spec.max_restarts}); last failure: {reason}")
        return Transition(state, (Emit(key=state.end_key, event=failed),))
    stops: list[Effect] = [
        StopWorkers(node_id=m, incarnation=state.nodes[m].incarnation, round=state.rdzv.round, reason=reason)
        for m in state.rdzv.members if m in state.nodes and state.nodes[m].phase is NodePhase.JOINED
    ]
    broken = dataclasses.replace(state, phase=JobPhase.RECOVERING, restarts=state.restarts + 1,
                                 rdzv=dataclasses.replace(state.rdzv, active=False))
    return Transition(broken, (*stops, *rounds.plan(broken, now=now)))


# -- health checks (the rest is in :mod:`.health`) -------------------------------------------


def _health_event(state: JobState, event: HealthCheckStarted | NodeHealthReported | HealthChecked, *,
                  now: float) -> Transition[JobState]:
    match event:
        case HealthCheckStarted():
            return health_machine.start(state, event, now=now)
        case NodeHealthReported():
            return health_machine.record(state, event)
        case HealthChecked():
            if not state.health.running or event.check != state.health.check:
                return reject(state, f"health check {event.check} is not running")
            return _health_checked(state, event, now=now)


def _health_checked(state: JobState, event: HealthChecked, *, now: float) -> Transition[JobState]:
    """The nodes that passed may train; the ones that failed are relaunched, their host excluded."""
    health = state.health
    failed = {v.node_id for v in event.failed}
    nodes = dict(state.nodes)
    for n in health.nodes:
        node = nodes.get(n)
        if node is not None and node.incarnation == health.incarnations[n] and n not in failed:
            nodes[n] = dataclasses.replace(node, unchecked=False)
    new = dataclasses.replace(state, nodes=nodes, health=HealthState(check=health.check))
    effects: list[Effect] = []
    for verdict in event.failed:
        node = new.nodes.get(verdict.node_id)
        if node is None or node.incarnation != verdict.incarnation or not node.phase.alive:
            continue
        if node.host:
            new = dataclasses.replace(new, excluded_hosts=new.excluded_hosts | {node.host})
        lost = NodeLost(node_id=node.node_id, incarnation=node.incarnation,
                        reason=f"failed its health check: {verdict.reason}")
        result = _node_event(new, lost, now=now)
        new, effects = result.state, effects + list(result.effects)
    new, more = rounds.plan_or_grow(new, now=now)
    effects += more
    unique = {effect.id: effect for effect in effects}  # a node's loss may have planned the same round already
    return Transition(new, tuple(unique.values()))
