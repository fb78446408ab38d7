"""The effect journal: which of a job's effects were made, so that each is made once across masters.

The reactor hands it the effects of each record it folds (all but StartTimer, which the
reactor arms from the state). Every effect has a deterministic id and a key of its own,
``/stead/jobs/<job>/effects/<id>``::

    Emit            the emitted event appended together with its key, in one write:
                    the key exists exactly when the event was recorded
    any other       key created ``running`` (the claim), the executor runs it, key
                    marked ``done`` or ``failed``; a declined one's claim is deleted,
                    so that a master that can run it does

Effects run at most once across master restarts and are never lost to one. A resumed
master re-derives the effects of the records after its snapshot; it skips those marked
done or failed and runs again those left ``running`` by a master that died (effects
are idempotent by their ids). The many effects of one record (a round's start on every
member) are claimed with one store write per 64 and marked done the same way: 32 writes
(fsyncs on sqlite) for a 1,000-node round, not 2,000. An effect that raises or outlasts
``effect_timeout_s`` (on the reactor's clock) becomes an ``EffectFailed`` event, returned
for the reactor to record and the machine to decide on, never a log line only. A second
master writing the same log is fenced: its emission's key, or its event's seq, exists
already, and the append raises ``LogConflict``.

Every store call here is one the loop cannot skip: retried while the store is away,
fatal (it stops the reactor) past ``retry_deadline_s``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import structlog

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings
from stead.core.errors import EffectDeclined, PlatformRejected
from stead.core.events import EffectFailed, Record
from stead.core.events.log import EventLog, job_prefix
from stead.core.retry import retrying
from stead.core.statemachine import Effect, Emit

__all__ = ["CLAIMS_PER_WRITE", "EffectJournal", "EffectRunner"]

log = structlog.get_logger("stead.journal")

_RUNNING, _DONE, _FAILED = b"running", b"done", b"failed"
#: most effects claimed (and marked) in one store write: half of what one etcd transaction takes
CLAIMS_PER_WRITE = 64


class EffectRunner(Protocol):
    """Carries out effects other than Emit and StartTimer; raises when it cannot."""

    async def run(self, effect: Effect) -> None: ...


class EffectJournal:
    """``await journal.emit(effect, resuming=...)`` for an Emit; ``await journal.run(effects, resuming=...)`` for
    the others of one record. ``resuming``: the effects were re-derived from the log by a new master, so an
    emission already recorded is skipped and a claim left ``running`` is run again."""

    def __init__(self, event_log: EventLog, executor: EffectRunner, *, settings: Settings,
                 clock: Clock = WALL_CLOCK) -> None:
        self.log = event_log
        self.executor = executor
        self.settings = settings
        self._clock = clock
        #: effect keys of the emissions this journal made or found made
        self._emitted: set[str] = set()

    def key(self, effect: Effect) -> str:
        """Where ``effect``'s claim (or an emission's mark) is kept."""
        return f"{job_prefix(self.log.job)}effects/{effect.id}"

    async def emit(self, effect: Emit, *, resuming: bool) -> list[Record]:
        """Append the emitted event together with its effect key (unless this master or a previous one did); its
        records, none when it was made already.

        The machine may ask twice for the same emission: records persisted together are folded in order, so a
        second record can ask again before the first one's emitted event is folded (two agents' NodeJoined for
        the last place of a round, a retried registration). Same key, same emission: done once.
        """
        key = self.key(effect)
        if key in self._emitted:
            log.debug("emit_repeated", job=self.log.job, effect=effect.id)
            return []
        if resuming and await self._write(lambda: self.log.store.get(key)) is not None:
            self._emitted.add(key)
            return []
        records: list[Record] = await self._write(lambda: self.log.append_many([effect.event], extra=[(key, b"")]))
        self._emitted.add(key)
        return records

    async def run(self, effects: Sequence[Effect], *, resuming: bool) -> list[EffectFailed]:
        """Claim, run (concurrently) and mark ``effects``; the ``EffectFailed`` events of those that failed."""
        failures: list[EffectFailed] = []
        if resuming or len(effects) == 1:
            async with anyio.create_task_group() as tg:
                for effect in effects:
                    tg.start_soon(self._run_one, effect, resuming, failures)
        else:
            await self._run_batch(effects, failures)
        return failures

    async def _run_batch(self, effects: Sequence[Effect], failures: list[EffectFailed]) -> None:
        """Many effects of one record (a round's StartWorkers to every member): claimed together and marked done
        together, a store write per ``CLAIMS_PER_WRITE`` effects instead of two per effect (each an fsync on
        sqlite)."""
        chunks = [effects[i:i + CLAIMS_PER_WRITE] for i in range(0, len(effects), CLAIMS_PER_WRITE)]
        outcomes: dict[str, bytes] = {}
        async with anyio.create_task_group() as tg:
            for chunk in chunks:  # each chunk runs once claimed: the first nodes hear at once, not after every write
                claims = [(self.key(e), _RUNNING) for e in chunk]
                claimed = await self._write(functools.partial(self.log.store.create_all, claims))
                for effect in chunk:
                    if claimed:
                        tg.start_soon(self._carry_out, effect, failures, outcomes)
                    else:  # one of them was claimed already (it should not be): each on its own, as ever
                        tg.start_soon(self._run_one, effect, False, failures)
        done = list(outcomes.items())
        for i in range(0, len(done), CLAIMS_PER_WRITE):
            await self._write(functools.partial(self.log.store.put_all, done[i:i + CLAIMS_PER_WRITE]))

    async def _run_one(self, effect: Effect, resuming: bool, failures: list[EffectFailed]) -> None:
        key = self.key(effect)
        if not await self._write(lambda: self.log.store.compare_and_put(key, _RUNNING, expected_mod_revision=0)):
            claim = await self._write(lambda: self.log.store.get(key))
            if claim is None or claim.value != _RUNNING or not resuming:
                if not resuming:
                    log.warning("effect_already_ran", job=self.log.job, effect=effect.id)
                return
            log.info("effect_rerun", job=self.log.job, effect=effect.id,
                     reason="a previous master died while it ran")
        outcomes: dict[str, bytes] = {}
        await self._carry_out(effect, failures, outcomes)
        if key in outcomes:
            await self._write(lambda: self.log.store.put(key, outcomes[key]))

    async def _carry_out(self, effect: Effect, failures: list[EffectFailed], outcomes: dict[str, bytes]) -> None:
        """Run a claimed effect; its key's outcome goes to ``outcomes`` (none when declined: its claim is gone)."""
        key = self.key(effect)
        try:
            async with self._clock.fail_after(self.settings.effect_timeout_s):
                await self.executor.run(effect)
        except EffectDeclined:  # not this master's to run: left unclaimed for one that can
            await self._write(lambda: self.log.store.delete(key))
            return
        except Exception as exc:
            error = (f"did not finish within effect_timeout_s={self.settings.effect_timeout_s:g} s"
                     if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}")
            log.error("effect_failed", job=self.log.job, effect=effect.id, error=error)
            failures.append(EffectFailed(effect_id=effect.ref, kind=effect.kind, error=error,
                                         permanent=isinstance(exc, PlatformRejected),
                                         node_id=getattr(effect, "node_id", None),
                                         incarnation=getattr(effect, "incarnation", None),
                                         round=getattr(effect, "round", None)))
            outcomes[key] = _FAILED
        else:
            outcomes[key] = _DONE

    async def _write(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """A store call the loop cannot skip: retried while the store is away, fatal past the deadline."""
        return await retrying(call, self.settings, what=f"event log of job {self.log.job}")
