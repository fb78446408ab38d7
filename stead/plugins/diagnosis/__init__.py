"""Diagnosis: decide what a worker failure leads to.

It starts from stead's default policy (:func:`stead.plugin.classify`: an error
that a restart reproduces fails fast, anything else restarts) and adds history:
the same error at the same step twice fails fast instead of looping. The job
machine gives it ``decision_timeout_s`` per failure; when it is disabled, slow
or absent, the default policy decides alone.

The signatures already seen are kept under the plugin's own store key, so a
restarted master still recognises a repeated error.

It also watches for hangs (:mod:`stead.plugins.diagnosis.hang`): when the running
round has gone without a completed step for longer than its own pace allows, it
asks every node for its workers' stacks, names the rank that is not where the
others are, records ``diagnosis.hang`` and restarts the round (``hang_restarts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from stead.plugin import (
    JobPhase,
    Plugin,
    PluginContext,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RoundCompleted,
    StacksDumped,
    StepProgress,
    WorkerFailed,
    classify,
    last_exception,
)
from stead.plugins.diagnosis.events import HangDetected
from stead.plugins.diagnosis.hang import Stall, StepClock, name_culprit
from stead.plugins.diagnosis.settings import DiagnosisSettings

__all__ = ["DiagnosisPlugin", "DiagnosisSettings", "HangDetected", "classify"]

Ctx = PluginContext[DiagnosisSettings]


class DiagnosisPlugin(Plugin[DiagnosisSettings]):
    name = "diagnosis"
    settings_class = DiagnosisSettings
    subscriptions = (WorkerFailed, RoundCompleted, StepProgress, StacksDumped)
    decides_recovery = True

    def __init__(self, *, settings: DiagnosisSettings | None = None) -> None:
        super().__init__(settings=settings or DiagnosisSettings())
        self._seen: set[str] | None = None
        s = self.settings
        self.clock = StepClock(floor_s=s.hang_floor_s, factor=s.hang_factor, first_step_s=s.first_step_s,
                               phase_s=s.phase_s)
        self._watch: asyncio.Task[None] | None = None
        #: the round whose hang is being (or was) handled: one diagnosis per round
        self._hung_round = 0
        self._stacks: dict[str, StacksDumped] = {}
        self._stacks_in = asyncio.Event()

    async def start(self, *, ctx: Ctx) -> None:
        state = ctx.current_state()
        if state.rdzv.active and state.rdzv.round:  # a restarted master: the round runs, its clock starts now
            self.clock.start_round(state.rdzv.round, time.time())
        if self.settings.hang_detection:
            self._watch = asyncio.create_task(self._watch_hangs(ctx), name="diagnosis-hang-watch")

    async def stop(self, *, ctx: Ctx) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    async def _watch_hangs(self, ctx: Ctx) -> None:
        while True:
            await asyncio.sleep(self.settings.hang_check_s)
            state = ctx.current_state()
            if (state.phase is not JobPhase.RUNNING or not state.rdzv.active or state.awaiting_decision
                    or state.rdzv.round != self.clock.round or self._hung_round == self.clock.round):
                continue
            stall = self.clock.stalled(time.time())
            if stall is not None:
                self._hung_round = stall.round
                try:
                    await self._diagnose(ctx, stall)
                except Exception as exc:  # the watch goes on for the next round
                    ctx.log.exception("hang_diagnosis_failed", error=repr(exc))

    async def _diagnose(self, ctx: Ctx, stall: Stall) -> None:
        ctx.log.warning("hang_suspected", round=stall.round, step=stall.step, stalled_s=round(stall.stalled_s, 1),
                        threshold_s=round(stall.threshold_s, 1))
        self._stacks.clear()
        self._stacks_in.clear()
        members = set(ctx.current_state().rdzv.members)
        await ctx.request_stacks(round=stall.round, reason=(
            f"no step for {stall.stalled_s:.1f} s (threshold {stall.threshold_s:.1f} s: {stall.why})"))
        with contextlib.suppress(TimeoutError):  # a node that does not answer in time is named as such
            async with asyncio.timeout(self.settings.stacks_wait_s):
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

    async def _signatures(self, ctx: Ctx) -> set[str]:
        if self._seen is None:
            kv = await ctx.store.get(ctx.key("signatures"))
            self._seen = set(json.loads(kv.value)) if kv else set()
        return self._seen

    async def handle(self, *, record: Record, ctx: Ctx) -> None:
        event = record.event
        match event:
            case RoundCompleted():
                self.clock.start_round(event.round, record.at)
            case StepProgress():
                self.clock.observe(event.round, event.step, record.at, event.phase)
            case StacksDumped() if event.round == self._hung_round:
                self._stacks[event.node_id] = event
                self._stacks_in.set()
            case WorkerFailed():
                await self._decide(event, ctx)

    async def _decide(self, failure: WorkerFailed, ctx: Ctx) -> None:
        state = ctx.state
        if not state.awaiting_decision or state.last_failure != failure:
            return  # a follow-on failure of a round that is already being handled
        action, reason = classify(failure)
        exc = last_exception(failure.error_tail)
        seen = await self._signatures(ctx)
        signature = f"{exc[0]}: {exc[1]} @ step {failure.step}" if exc and failure.step is not None else None
        if action is RecoveryAction.RESTART and signature is not None:
            if signature in seen:
                action, reason = RecoveryAction.FAIL, f"the same error at the same step twice ({signature})"
            else:
                seen.add(signature)
                await ctx.store.put(ctx.key("signatures"), json.dumps(sorted(seen)).encode())
        ctx.log.info("recovery_decided", round=failure.round, action=action.value, reason=reason, rank=failure.rank)
        await ctx.emit(RecoveryDecided(
            round=failure.round, action=action, reason=reason, message=failure.error_tail,
            node_id=failure.node_id, rank=failure.rank, decided_by=self.name,
        ))
