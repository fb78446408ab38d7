"""Diagnosis: decide what a worker failure leads to.

It starts from stead's default policy (:func:`stead.plugin.classify`: an error
that a restart reproduces fails fast, anything else restarts) and adds history:
the same error at the same step twice fails fast instead of looping. The job
machine gives it ``decision_timeout_s`` per failure; when it is disabled, slow
or absent, the default policy decides alone.

The signatures already seen are kept under the plugin's own store key, so a
restarted master still recognises a repeated error.
"""

from __future__ import annotations

import json

from stead.plugin import (
    NoSettings,
    Plugin,
    PluginContext,
    Record,
    RecoveryAction,
    RecoveryDecided,
    WorkerFailed,
    classify,
    last_exception,
)

__all__ = ["DiagnosisPlugin", "classify"]


class DiagnosisPlugin(Plugin[NoSettings]):
    name = "diagnosis"
    subscriptions = (WorkerFailed,)
    decides_recovery = True

    def __init__(self, *, settings: NoSettings | None = None) -> None:
        super().__init__(settings=settings or NoSettings())
        self._seen: set[str] | None = None

    async def _signatures(self, ctx: PluginContext[NoSettings]) -> set[str]:
        if self._seen is None:
            kv = await ctx.store.get(ctx.key("signatures"))
            self._seen = set(json.loads(kv.value)) if kv else set()
        return self._seen

    async def handle(self, *, record: Record, ctx: PluginContext[NoSettings]) -> None:
        failure = record.event
        assert isinstance(failure, WorkerFailed)
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
