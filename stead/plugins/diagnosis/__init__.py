"""Diagnosis: decide what a worker failure leads to.

Basic rules (a later issue deepens them with hang and straggler detection):

* a failure whose traceback ends in an error that a restart cannot fix (the
  code does not even compile or import, a name is undefined) fails fast;
* the same error at the same step twice fails fast instead of looping;
* anything else (a signal, a collective's connection reset, an OOM kill, an
  unknown exit) is treated as transient and restarts the workers in a new round;
  the job machine turns a restart beyond ``--max-restarts`` into a failure.

The signatures already seen are kept under the plugin's own store key, so a
restarted master still recognises a repeated error.
"""

from __future__ import annotations

import json
import re
import signal

import structlog

from stead.core.config import Settings
from stead.core.events import Record, RecoveryAction, RecoveryDecided, WorkerFailed
from stead.core.plugins import PluginContext

__all__ = ["DiagnosisPlugin", "classify"]

log = structlog.get_logger("stead.plugins.diagnosis")

#: errors that a restart reproduces: the program is wrong, not the world
DETERMINISTIC = frozenset({"SyntaxError", "IndentationError", "TabError", "NameError", "ImportError",
                           "ModuleNotFoundError", "UnboundLocalError"})
#: torch prefixes a worker's stderr lines with its rank ("[rank3]: NameError: ...")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d*\]:\s*")
_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::\s*(?P<msg>.*))?$")


def last_exception(error_tail: str) -> tuple[str, str] | None:
    """(exception type, message) of the last traceback in a stderr tail, if any."""
    for line in reversed(error_tail.strip().splitlines()):
        match = _EXC_LINE.match(_RANK_PREFIX.sub("", line.strip()))
        if match:
            return match["type"].rsplit(".", 1)[-1], (match["msg"] or "").strip()
    return None


def classify(failure: WorkerFailed) -> tuple[RecoveryAction, str]:
    """A first decision from one failure alone (without history)."""
    exc = last_exception(failure.error_tail)
    if exc is not None and exc[0] in DETERMINISTIC:
        return RecoveryAction.FAIL, f"{exc[0]} in rank {failure.rank}: a restart would hit it again"
    if failure.signal is not None:
        try:
            name = signal.Signals(failure.signal).name
        except ValueError:
            name = f"signal {failure.signal}"
        return RecoveryAction.RESTART, f"rank {failure.rank} killed by {name}"
    if exc is not None:
        return RecoveryAction.RESTART, f"rank {failure.rank} raised {exc[0]}"
    return RecoveryAction.RESTART, f"rank {failure.rank} exited with code {failure.exit_code}"


class DiagnosisPlugin:
    name = "diagnosis"
    subscriptions = (WorkerFailed,)

    def __init__(self, *, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self._seen: set[str] | None = None

    async def _signatures(self, ctx: PluginContext) -> set[str]:
        if self._seen is None:
            kv = await ctx.store.get(ctx.key(self.name, "signatures"))
            self._seen = set(json.loads(kv.value)) if kv else set()
        return self._seen

    async def handle(self, *, record: Record, ctx: PluginContext) -> None:
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
                await ctx.store.put(ctx.key(self.name, "signatures"), json.dumps(sorted(seen)).encode())
        log.info("recovery_decided", round=failure.round, action=action.value, reason=reason, rank=failure.rank)
        await ctx.emit(RecoveryDecided(
            round=failure.round, action=action, reason=reason, message=failure.error_tail,
            node_id=failure.node_id, rank=failure.rank,
        ))
