"""Diagnosis: what a failure is, what it leads to, and what is wrong before anything fails.

Every worker failure is classified by a table of rules (:mod:`.rules`: the kernel's
OOM record, GPU faults, the last exception, NCCL/gloo errors, exit codes and
signals; users and packages add rules) into a class (user error, OOM, hardware,
node lost, collective, transient), and the class into an action: fail fast,
restart the workers, relaunch the node elsewhere, or ask for more memory. History
is added on top: a failure of unknown cause (transient) with the same exception and
message at the same step twice (or, with no step known, the same traceback twice in a
row) is a user error that fails fast instead of looping (``[repeats]`` in the rules
file), and the decision names both occurrences. A non-finite gradient (``stead.numerics``)
on a host that produced one before at another step follows the host, not the data: its
node is relaunched elsewhere and the host kept out (rule ``non-finite-follows-host``).
The decision carries its class, the rule that matched and the evidence.
Lost nodes are classified too (``diagnosis.classified``). The job machine gives
the plugin ``decision_timeout_s`` per failure; when it is disabled, slow or absent,
the default policy decides alone.

The failures already seen (their signature, round, rank and step) are kept under the
plugin's own store key, so a restarted master still recognises a repeated error.

It also watches for hangs (:mod:`stead.plugins.diagnosis.hang`): when the running
round has gone without a completed step for longer than its own pace allows, it
asks every node for its workers' stacks, names the rank that is not where the
others are, records ``diagnosis.hang`` and restarts the round (``hang_restarts``).

And for stragglers (:mod:`stead.plugins.diagnosis.straggler`): a node whose own
time per step stays over ``straggler_factor`` x the other nodes' median is reported
(``diagnosis.straggler``), and replaced at the next checkpoint if
``straggler_relaunch`` is set. What it currently sees (the hang threshold, the
stragglers) is kept under its store key ``status`` (JSON; ``summary``: the lines
``stead status`` shows for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re
import time
from collections.abc import Mapping, Sequence

from stead.plugin import (
    CheckpointCommitted,
    ChunkedValue,
    CodecError,
    JobPhase,
    JobState,
    NodeExited,
    NodeJoined,
    NodeLost,
    NumericsSettings,
    Plugin,
    PluginContext,
    PluginsStarted,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RetryableError,
    RoundCompleted,
    StacksDumped,
    StepProgress,
    WorkerFailed,
    load_settings,
)
from stead.plugins.diagnosis.events import (
    FailureClassified,
    HangDetected,
    StragglerCleared,
    StragglerDetected,
)
from stead.plugins.diagnosis.hang import Stall, StepClock, name_culprit
from stead.plugins.diagnosis.numerical import (
    SKIPPING_RULES,
    NumericalVerdict,
    bound_reason,
    decide_numerical,
    restore_bound,
)
from stead.plugins.diagnosis.repeats import Seen
from stead.plugins.diagnosis.repeats import signature as failure_signature
from stead.plugins.diagnosis.rules import (
    BUILTIN_RULES,
    DEFAULT_ACTIONS,
    Action,
    Classification,
    Facts,
    FailureClass,
    Repeats,
    Rule,
    RuleSet,
    installed_rules,
    load_repeats,
    load_rules_file,
)
from stead.plugins.diagnosis.settings import DiagnosisSettings
from stead.plugins.diagnosis.straggler import StragglerWatch

__all__ = ["DiagnosisPlugin", "DiagnosisSettings", "FailureClassified", "HangDetected", "StragglerCleared",
           "StragglerDetected"]

#: how often the status record under the plugin's key is rewritten, at most
_STATUS_EVERY_S = 2.0
#: NodeLost reasons that are stead's own doing (a decision, a resume), not a failure to classify
_OWN_LOSSES = ("relaunched: ", "relaunch requested by ", "the job was resumed")

Ctx = PluginContext[DiagnosisSettings]


class DiagnosisPlugin(Plugin[DiagnosisSettings]):
    name = "diagnosis"
    settings_class = DiagnosisSettings
    subscriptions = (PluginsStarted, WorkerFailed, RoundCompleted, StepProgress, StacksDumped, NodeJoined, NodeLost,
                     NodeExited, CheckpointCommitted)
    decides_recovery = True

    def __init__(self, *, settings: DiagnosisSettings | None = None) -> None:
        super().__init__(settings=settings or DiagnosisSettings())
        self._seen: Seen | None = None
        s = self.settings
        actions = dict(DEFAULT_ACTIONS)
        user_rules: tuple[Rule, ...] = ()
        self.repeats = Repeats()
        if s.rules_file:  # read now: a bad file stops the job before anything launches, with the file's problem
            user_rules, overrides = load_rules_file(s.rules_file)
            actions.update(overrides)
            self.repeats = load_repeats(s.rules_file)
        self.rules = RuleSet((*user_rules, *installed_rules(), *BUILTIN_RULES), actions)
        self.stragglers = StragglerWatch(factor=s.straggler_factor, window_s=s.straggler_window_s)
        self._relaunch_at_checkpoint: set[str] = set()
        #: nodes (id, incarnation) that joined and have not been lost or exited
        self._alive: set[tuple[str, int]] = set()
        self._status_at = 0.0
        self.clock = StepClock(floor_s=s.hang_floor_s, factor=s.hang_factor, first_step_s=s.first_step_s,
                               phase_s=s.phase_s)
        self._watch: asyncio.Task[None] | None = None
        #: the round whose hang is being (or was) handled: one diagnosis per round
        self._hung_round = 0
        self._stacks: dict[str, StacksDumped] = {}
        self._stacks_in = asyncio.Event()
        #: a round's decision waiting for the cause behind a collective error (root_cause_wait_s)
        self._root_cause: _RootCause | None = None
        self._inherited: tuple[int | None, list[float]] = (None, [])
        #: the status published for `stead status`: its stragglers grow with the job (chunked past one store write)
        self._status: ChunkedValue | None = None

    async def start(self, *, ctx: Ctx) -> None:
        # what the previous master published, read before this one's watch overwrites it
        self._inherited = await self._published_status(ctx)
        await self._catch_up(ctx)
        if self.settings.hang_detection or self.settings.stragglers:
            self._watch = ctx.tasks.start(self._watch_job, ctx, name="watch")

    async def _catch_up(self, ctx: Ctx) -> None:
        """Take up the job where the log left it: plugins start before the master replays its log, so this runs
        again on PluginsStarted (after the replay) for a master that took over a running job."""
        state = ctx.current_state()
        self._alive = {(n, node.incarnation) for n, node in state.nodes.items() if node.phase.alive}
        if state.rdzv.active and state.rdzv.round and self.clock.round != state.rdzv.round:
            self.clock.start_round(state.rdzv.round, time.time())  # the round runs: its clock starts now
            await self._resume_clock(ctx, state.step)

    def _status_value(self, ctx: Ctx) -> ChunkedValue:
        self._status = self._status or ChunkedValue(ctx.store, ctx.key("status"))
        return self._status

    async def _published_status(self, ctx: Ctx) -> tuple[int | None, list[float]]:
        """The round and recent step gaps of the last status published (by a previous master)."""
        try:
            raw = await self._status_value(ctx).get()
            before = json.loads(raw) if raw is not None else {}
            return before.get("round"), [float(g) for g in before.get("hang", {}).get("gaps_s", [])]
        except (CodecError, ValueError, TypeError, AttributeError):
            return None, []

    async def _resume_clock(self, ctx: Ctx, step: int | None) -> None:
        """Take over the step times the previous master saw (its last status), so that a round that hangs
        right after a master restart is caught after the usual threshold, not after first_step_s."""
        round_, gaps = self._inherited
        if gaps:  # the pace holds across rounds; the step only if it was this round's
            self.clock.resume(step if round_ == self.clock.round else None, gaps)

    async def stop(self, *, ctx: Ctx) -> None:
        # (under a master its tasks have ended already; a context of a test's own ends them here)
        await ctx.tasks.end(self._root_cause.task if self._root_cause is not None else None, self._watch)
        if self._watch is not None:
            await self._write_status(ctx, force=True)  # what it saw last, for `stead status` after the job

    async def _watch_job(self, ctx: Ctx) -> None:
        while True:
            await ctx.clock.sleep(self.settings.hang_check_s)
            try:  # one look's failure is logged; the watch goes on
                if self.settings.hang_detection:
                    await self._check_hang(ctx)
                if self.settings.stragglers:
                    await self._check_stragglers(ctx)
                await self._write_status(ctx)
            except RetryableError as exc:  # the store is away: said once a look, without a traceback
                ctx.log.warning("diagnosis_watch_failed", error=str(exc))
            except Exception as exc:
                ctx.log.exception("diagnosis_watch_failed", error=repr(exc))

    async def _check_hang(self, ctx: Ctx) -> None:
        state = ctx.current_state()
        if (state.phase is not JobPhase.RUNNING or not state.rdzv.active or state.awaiting_decision
                or state.rdzv.round != self.clock.round or self._hung_round == self.clock.round):
            return
        now = time.time()
        stall = self.clock.stalled(now)
        if stall is None:
            return
        live = self._live_step(ctx, state)
        if live is not None and (self.clock.step is None or live > self.clock.step):
            # the heartbeats show steps the log does not (the state store was away and progress went unrecorded):
            # training goes on, no hang
            ctx.log.info("hang_not_confirmed", round=stall.round, recorded_step=stall.step, live_step=live,
                         reason="the nodes' heartbeats show newer steps than the recorded progress")
            self.clock.advance(stall.round, live, now)
            return
        self._hung_round = stall.round
        await self._diagnose(ctx, stall)

    @staticmethod
    def _live_step(ctx: Ctx, state: JobState) -> int | None:
        """The running round's step as the members' last heartbeats say (the slowest member's); None when one has
        not said."""
        telemetry = ctx.node_telemetry()
        steps = []
        for member in state.rdzv.members:
            seen = telemetry.get(member)
            if seen is None or seen.round != state.rdzv.round or seen.step is None:
                return None
            steps.append(seen.step)
        return min(steps) if steps else None

    async def _check_stragglers(self, ctx: Ctx) -> None:
        state = ctx.current_state()
        if state.phase is not JobPhase.RUNNING or not state.rdzv.active:
            return  # between rounds or after the job: what was flagged stays shown until a round says otherwise
        members = set(state.rdzv.members)
        figures = {n: t.step_compute_s for n, t in ctx.node_telemetry().items()
                   if n in members and t.round == state.rdzv.round and t.step_compute_s is not None}
        flagged, cleared = self.stragglers.observe(figures, members=members, now=time.monotonic())
        for node in cleared:
            self._relaunch_at_checkpoint.discard(node)
            ctx.log.info("straggler_cleared", node=node)
            await ctx.emit(StragglerCleared(node_id=node, round=state.rdzv.round, compute_s=figures.get(node),
                                            median_s=None))
        for found in flagged:
            action = "relaunch" if self.settings.straggler_relaunch else "report"
            ctx.log.warning("straggler", node=found.node_id, compute_s=round(found.compute_s, 4),
                            median_s=round(found.median_s, 4), ratio=round(found.ratio, 2), action=action)
            await ctx.emit(StragglerDetected(
                node_id=found.node_id, round=state.rdzv.round, compute_s=round(found.compute_s, 6),
                median_s=round(found.median_s, 6), ratio=round(found.ratio, 3),
                window_s=self.settings.straggler_window_s, action=action))
            if action == "relaunch":
                self._relaunch_at_checkpoint.add(found.node_id)

    async def _write_status(self, ctx: Ctx, *, force: bool = False) -> None:
        """What the detectors see now, for ``stead status`` (a separate process reading the store)."""
        now = time.monotonic()
        if not force and now - self._status_at < _STATUS_EVERY_S:
            return
        self._status_at = now
        threshold, why = self.clock.threshold()
        flagged = self.stragglers.flagged
        summary = [f"hang threshold {threshold:.1f} s without a step ({why})" if self.settings.hang_detection
                   else "hang detection off (diagnosis.hang_detection)"]
        summary += [f"straggler {n}: {f.compute_s:.3f} s of its own per step, {f.ratio:.1f}x the other nodes' "
                    f"median {f.median_s:.3f} s" for n, f in sorted(flagged.items())]
        if self.settings.stragglers and not flagged:
            summary.append(f"no straggler (factor {self.settings.straggler_factor:g})")
        # until this master's clock has a pace of its own, pass on the one it inherited: a master killed before
        # it caught up must not leave its successor without one (it would wait first_step_s for a hang)
        round_, gaps = (self.clock.round, list(self.clock.gaps)) if self.clock.gaps else self._inherited
        status = {
            "at": time.time(), "round": round_ or self.clock.round, "summary": summary,
            "hang": {"threshold_s": round(threshold, 3), "why": why, "enabled": self.settings.hang_detection,
                     "gaps_s": [round(g, 4) for g in gaps]},
            "stragglers": {n: {"compute_s": round(f.compute_s, 6), "median_s": round(f.median_s, 6),
                               "ratio": round(f.ratio, 3)} for n, f in flagged.items()},
        }
        await self._status_value(ctx).put(json.dumps(status).encode())

    async def _diagnose(self, ctx: Ctx, stall: Stall) -> None:
        ctx.log.warning("hang_suspected", round=stall.round, step=stall.step, stalled_s=round(stall.stalled_s, 1),
                        threshold_s=round(stall.threshold_s, 1))
        self._stacks.clear()
        self._stacks_in.clear()
        members = set(ctx.current_state().rdzv.members)
        await ctx.request_stacks(round=stall.round, reason=(
            f"no step for {stall.stalled_s:.1f} s (threshold {stall.threshold_s:.1f} s: {stall.why})"))
        with contextlib.suppress(TimeoutError):  # a node that does not answer in time is named as such
            async with ctx.clock.fail_after(self.settings.stacks_wait_s):
                while not members <= set(self._stacks):
                    await self._stacks_in.wait()
                    self._stacks_in.clear()
        samples = [w for dump in self._stacks.values() for w in dump.workers]
        culprit = name_culprit(samples)
        missing = sorted(members - set(self._stacks))
        notes = [f"{d.node_id}: {d.error}" for d in self._stacks.values() if d.error]
        if missing:
            notes.append(f"no stacks from {', '.join(missing)} within {self.settings.stacks_wait_s:g} s")
        evidence = "\n\n".join(f"rank {w.rank} (step {w.step}):\n{w.stack}"
                                for w in sorted(samples, key=lambda w: w.rank))
        action = "restart" if self.settings.hang_restarts else "notify"
        hung = f"rank {culprit.rank} hangs" if culprit.rank is not None else "no rank stands out"
        await ctx.emit(HangDetected(
            round=stall.round, step=stall.step, stalled_s=round(stall.stalled_s, 3),
            threshold_s=round(stall.threshold_s, 3), why=stall.why, rank=culprit.rank,
            summary=culprit.summary + (f" ({'; '.join(notes)})" if notes else ""), action=action,
            evidence=evidence[:64 * 1024]))
        if action == "restart":
            await ctx.request_restart(round=stall.round, reason=(
                f"hang: no step for {stall.stalled_s:.0f} s; {hung}: {culprit.summary}"))

    async def _history(self, ctx: Ctx) -> Seen:
        if self._seen is None:
            kv = await ctx.store.get(ctx.key("signatures"))
            self._seen = Seen.from_json(kv.value) if kv else Seen()
        return self._seen

    async def _repeated(self, failure: WorkerFailed, found: Classification, ctx: Ctx) -> Classification | None:
        """Records ``failure`` (classified ``found``); a classification as a repeat when it is its
        ``repeats.after``-th occurrence."""
        signature = failure_signature(failure)
        if signature is None or self.repeats.after == 0 or found.failure_class not in self.repeats.of:
            return None
        history = await self._history(ctx)
        again = history.same_as_last(failure)  # no step known: the last failure's traceback again is that failure
        occurrences = history.record(again or signature, failure, in_a_row=failure.step is None and not again)
        await ctx.store.put(ctx.key("signatures"), history.to_json())
        if len(occurrences) < self.repeats.after:
            return None
        named = ", ".join(f"round {r} (rank {k}{'' if s is None else f', step {s}'})" for r, k, s in occurrences)
        times = "twice" if len(occurrences) == 2 else f"{len(occurrences)} times"
        where = (f"at the same step {times}" if failure.step is not None or again
                 else f"{times} in a row (no step known)")
        action = self.rules.actions.get(self.repeats.failure_class, DEFAULT_ACTIONS[self.repeats.failure_class])
        return Classification(self.repeats.failure_class, action, self.repeats.rule,
                              f"the same error {where}: {(again or signature).split(' @ ')[0]} in {named}")

    async def _follows_host(self, failure: WorkerFailed, found: Classification,
                            ctx: Ctx) -> Classification | None:
        """A non-finite gradient on a host that produced one before at another step (other data): the host's
        node is relaunched elsewhere and the host kept out."""
        host = _NAN_HOST.search(found.evidence) if found.rule == "non-finite-gradient" else None
        if host is None:
            return None
        history = await self._history(ctx)
        earlier = history.nan_on(host[1], failure.step)
        await ctx.store.put(ctx.key("signatures"), history.to_json())
        if not earlier:
            return None
        steps = ", ".join("?" if s is None else str(s) for s in earlier)
        return Classification(FailureClass.NUMERICAL, Action.RELAUNCH, "non-finite-follows-host",
                              f"a non-finite gradient on host {host[1]} again, at step {failure.step} after step(s) "
                              f"{steps} with other data: the host, not the data ({found.evidence})")

    async def handle(self, *, record: Record, ctx: Ctx) -> None:
        event = record.event
        match event:
            case PluginsStarted():
                await self._catch_up(ctx)
            case RoundCompleted():
                self.clock.start_round(event.round, record.at)
            case StepProgress():
                self.clock.observe(event.round, event.step, record.at, event.phase)
            case StacksDumped() if event.round == self._hung_round:
                self._stacks[event.node_id] = event
                self._stacks_in.set()
            case WorkerFailed():
                await self._failed(event, ctx)
            case NodeJoined():
                self._alive.add((event.node_id, event.incarnation))
            case NodeLost() | NodeExited():
                if self._root_cause is not None:
                    self._root_cause.node_ended(event)
                await self._node_failed(event, ctx)
            case CheckpointCommitted() if self._relaunch_at_checkpoint:
                await self._relaunch_stragglers(ctx)

    async def _node_failed(self, event: NodeLost | NodeExited, ctx: Ctx) -> None:
        key = (event.node_id, event.incarnation)
        if key not in self._alive:
            return  # not a joined node, or already classified (its exit after its loss)
        self._alive.discard(key)
        if ctx.state.phase.terminal or (isinstance(event, NodeLost) and event.reason.startswith(_OWN_LOSSES)):
            return
        found = self.rules.classify(Facts.of_node(event))
        ctx.log.warning("node_failure_classified", node=event.node_id, failure_class=found.failure_class.value,
                        rule=found.rule, evidence=found.evidence)
        await ctx.emit(FailureClassified(node_id=event.node_id, incarnation=event.incarnation,
                                         failure_class=found.failure_class.value, action=found.action.value,
                                         rule=found.rule, evidence=found.evidence))

    async def _relaunch_stragglers(self, ctx: Ctx) -> None:
        state = ctx.state
        for node_id in sorted(self._relaunch_at_checkpoint):
            node = state.nodes.get(node_id)
            if node is not None and node.phase.alive:
                figure = self.stragglers.flagged.get(node_id)
                ratio = f"{figure.ratio:.1f}x the other nodes' time per step" if figure else "a straggler"
                await ctx.request_relaunch(node_id=node_id, incarnation=node.incarnation,
                                           reason=f"straggler ({ratio}); replaced at checkpoint step "
                                                  f"{state.checkpoint_step}")
        self._relaunch_at_checkpoint.clear()

    async def _failed(self, failure: WorkerFailed, ctx: Ctx) -> None:
        if self._root_cause is not None and failure.round == self._root_cause.round:
            self._root_cause.add(failure, self.rules.classify(Facts.of_worker(failure)))
            return  # another failure of the round whose decision waits: a candidate for its cause
        state = ctx.state
        if not state.awaiting_decision or state.last_failure != failure:
            return  # a follow-on failure of a round that is already being handled
        found = self.rules.classify(Facts.of_worker(failure))
        if found.failure_class not in _SYMPTOMS or self.settings.root_cause_wait_s <= 0:
            await self._decide(failure, found, ctx)
            return
        # a collective error is most often another rank's failure seen from here: wait a moment for the cause
        finished = [n for n in state.rdzv.members if n in state.rdzv.succeeded and n != failure.node_id]
        self._root_cause = _RootCause(failure, found, finished=finished,
                                      nproc=state.spec.nproc_per_node if state.spec else 1,
                                      members=state.rdzv.members, started_at=ctx.clock.now())
        self._root_cause.task = ctx.tasks.start(self._decide_root_cause, ctx, self._root_cause,
                                                name=f"root-cause-{failure.round}")

    async def _decide_root_cause(self, ctx: Ctx, pending: _RootCause) -> None:
        try:
            with contextlib.suppress(TimeoutError):
                async with ctx.clock.fail_after(self.settings.root_cause_wait_s):
                    await pending.cause_in.wait()
            if not pending.cause_in.is_set():
                await self._wait_for_silent(ctx, pending)
            failure, found = pending.best()
            if found.failure_class in _SYMPTOMS:  # nothing failed on its own: did a rank leave the round early?
                failure, found = pending.early_exit(self.rules.actions) or (failure, found)
            state = ctx.current_state()
            waiting = state.last_failure.round if state.awaiting_decision and state.last_failure else None
            if waiting == pending.round:  # (the decision timer may have decided already)
                await self._decide(failure, found, ctx, among=len(pending.candidates), ended=pending.ended)
        except Exception as exc:  # the default policy decides when the decision timer fires
            ctx.log.exception("root_cause_decision_failed", error=repr(exc))
        finally:
            if self._root_cause is pending:
                self._root_cause = None

    async def _wait_for_silent(self, ctx: Ctx, pending: _RootCause) -> None:
        """Members not heard from since the failure may be gone with their host: no failure of theirs comes then,
        only their loss once heartbeat_timeout_s passes. Wait for their next heartbeat or their loss (a cause),
        at most that long."""
        limit = ctx.stead_settings.heartbeat_timeout_s + ctx.stead_settings.heartbeat_interval_s
        said = False
        with contextlib.suppress(TimeoutError):
            async with ctx.clock.fail_after(limit):
                while not pending.cause_in.is_set():
                    telemetry = ctx.node_telemetry()
                    heard = {c[0].node_id for c in pending.candidates}
                    silent = [m for m in pending.members if m not in heard and (seen := telemetry.get(m)) is not None
                              and seen.seen < pending.started_at]
                    if not silent:
                        return
                    if not said:
                        said = True
                        ctx.log.info("root_cause_waits_for_silent_nodes", round=pending.round, nodes=silent,
                                     up_to_s=limit)
                    with contextlib.suppress(TimeoutError):  # (a cause ends the wait at once)
                        async with ctx.clock.fail_after(_SILENT_LOOK_S):
                            await pending.cause_in.wait()

    async def _decide(self, failure: WorkerFailed, found: Classification, ctx: Ctx, *, among: int = 1,
                      ended: NodeLost | NodeExited | None = None) -> None:
        action = found.action.recovery
        reason = f"{found.failure_class.value} in rank {failure.rank} ({found.rule}): {found.evidence}"
        if among > 1:
            reason += f" (the likeliest cause among {among} failures of the round)"
        if ended is not None and found.failure_class in _SYMPTOMS:
            reason += (f"; node {ended.node_id} {'was lost' if isinstance(ended, NodeLost) else 'exited'} meanwhile "
                       f"({self.rules.classify(Facts.of_node(ended)).evidence}): its relaunch pays "
                       "for the round, no restart is spent")
        if found.action is Action.MORE_MEMORY:
            reason += "; more memory wanted for the node: the workers restart meanwhile"
        skip: tuple[int, ...] = ()
        bound = restore_bound(found)  # (a replica mismatch's, kept unless the decision fails the job)
        if action is not RecoveryAction.FAIL:
            verdict = await self._numerical(failure, found, ctx)
            skip = verdict.skip_steps
            repeat = verdict.found
            if repeat is None:
                repeat = await self._repeated(failure, found, ctx) or await self._follows_host(failure, found, ctx)
            if repeat is not None:
                found, action = repeat, repeat.action.recovery
                reason = f"{found.failure_class.value} in rank {failure.rank} ({found.rule}): {found.evidence}"
        if bound is not None and action is not RecoveryAction.FAIL:
            reason += f"; {bound_reason(bound)}"
        else:
            bound = None
        ctx.log.info("recovery_decided", round=failure.round, action=action.value, reason=reason, rank=failure.rank,
                     failure_class=found.failure_class.value, rule=found.rule)
        await ctx.emit(RecoveryDecided(
            round=failure.round, action=action, reason=reason, message=failure.error_tail,
            node_id=failure.node_id, rank=failure.rank, decided_by=self.name,
            failure_class=found.failure_class.value, rule=found.rule, evidence=found.evidence[:4096],
            skip_steps=skip if action is RecoveryAction.RESTART else (), restore_at_most=bound,
        ))

    async def _numerical(self, failure: WorkerFailed, found: Classification, ctx: Ctx) -> NumericalVerdict:
        """A NaN gradient or a loss spike: counted against numerics.nan_budget, and decided as numerics.on_nan
        says (:mod:`.numerical`); a NaN whose step would be skipped is tried against its host first."""
        if found.rule not in SKIPPING_RULES:
            return NumericalVerdict()
        history = await self._history(ctx)
        history.numerical_faults += 1
        await ctx.store.put(ctx.key("signatures"), history.to_json())
        numerics = load_settings(NumericsSettings, "numerics", ctx.stead_settings)
        verdict = decide_numerical(found, settings=numerics, faults=history.numerical_faults,
                                   skipped=ctx.state.skip_steps)
        if verdict.skip_steps and found.rule == "non-finite-gradient":
            follows = await self._follows_host(failure, found, ctx)
            if follows is not None:  # the host's fault, not the batch's: nothing to skip
                return NumericalVerdict(follows)
        return verdict


#: how often a root-cause wait looks whether the silent members were heard from again
_SILENT_LOOK_S = 0.1
#: classes that are usually the symptom of another rank's failure (its peers' collectives break), not a cause
_SYMPTOMS = frozenset({FailureClass.COLLECTIVE})
#: the host a stead.numerics error names
_NAN_HOST = re.compile(r"on rank \d+ \(host ([^)]+)\)")
#: which class is the likelier cause when several failures of one round compete (lower first)
_CAUSE_ORDER = {FailureClass.HARDWARE: 0, FailureClass.OOM: 1, FailureClass.USER_ERROR: 2,
                FailureClass.NUMERICAL: 3, FailureClass.NODE_LOST: 4, FailureClass.TRANSIENT: 5,
                FailureClass.COLLECTIVE: 6}


class _RootCause:
    """The failures of one round while its decision waits for a cause behind a collective error."""

    def __init__(self, first: WorkerFailed, found: Classification, *, finished: Sequence[str] = (), nproc: int = 1,
                 members: Sequence[str] = (), started_at: float = 0.0) -> None:
        self.round = first.round
        #: when the wait began (the master's clock): a member whose last heartbeat is older is silent since
        self.started_at = started_at
        self.candidates = [(first, found)]
        #: nodes whose workers had all exited 0 when the first failure came, and the ranks they held
        self.finished = {n: [members.index(n) * nproc + i for i in range(nproc)] for n in finished if n in members}
        self.members = tuple(members)
        #: a member's end (exit or loss) while the decision waited: the likeliest cause, which the job handles
        self.ended: NodeLost | NodeExited | None = None
        self.cause_in = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def node_ended(self, event: NodeLost | NodeExited) -> None:
        if event.node_id in self.members and self.ended is None:
            self.ended = event
            self.cause_in.set()

    def add(self, failure: WorkerFailed, found: Classification) -> None:
        self.candidates.append((failure, found))
        if found.failure_class not in _SYMPTOMS:
            self.cause_in.set()

    def early_exit(self, actions: Mapping[FailureClass, Action]) -> tuple[WorkerFailed, Classification] | None:
        """Blame for a rank that exited 0 while its peers were still in a collective, if one did."""
        for failure, _ in sorted(self.candidates, key=lambda c: c[0].exited_at or math.inf):
            if failure.exited_ok_ranks:
                node, ranks = failure.node_id, list(failure.exited_ok_ranks)
                break
        else:
            if not self.finished:
                return None
            node, ranks = next(iter(self.finished.items()))
        symptom = self.candidates[0][0]
        evidence = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (on {node}) exited 0 while "
                    f"rank {symptom.rank} was still in a collective: a rank that ends early (sys.exit(0), a "
                    "shorter loop, an uneven last batch) breaks its peers' collectives; every rank must run the "
                    "same collectives to the end")
        blamed = dataclasses.replace(symptom, node_id=node, rank=ranks[0])
        return blamed, Classification(FailureClass.USER_ERROR, actions.get(FailureClass.USER_ERROR, Action.FAIL),
                                      "early-exit", evidence)

    def best(self) -> tuple[WorkerFailed, Classification]:
        """The likeliest cause: the strongest class, then the failure that happened first."""
        return min(self.candidates, key=lambda c: (_CAUSE_ORDER[c[1].failure_class],
                                                   c[0].exited_at if c[0].exited_at is not None else math.inf))
