"""Fold events through the job machine the way the reactor does, without any IO.

Tests (and tools that inspect recorded logs) need the reactor's folding rules
without a store, a clock or a platform: this module applies the same
:func:`stead.core.statemachine.fold` the reactor does. Two modes, as in the reactor:

* live (``follow_emits=True``, like ``Reactor.submit``): every event gets the
  next ``seq`` and is folded;
  the events of its ``Emit`` effects, and a ``TransitionRejected`` for an event
  that was refused, are queued behind it and folded before the next input.
  The reactor appends an emitted event together with its effect id, so the same
  ``Emit`` id twice would stop it with ``LogConflict``: here it raises
  :class:`DuplicateEmit`.
* replay (``follow_emits=False``, like ``Reactor.resume``): the log already
  holds the follow-up events; nothing is added.

A refused event leaves the state as it was except for ``seq``. Effects other
than ``Emit`` are only collected; timers never fire by themselves: pass
``TimerFired`` events explicitly (the armed ones are in ``state.timers``).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable

from stead.core.events import Event, NodeJoined, NodeStarted, Record, TransitionRejected
from stead.core.statemachine import Effect, Emit, JobState, Transition
from stead.core.statemachine import fold as fold_record

__all__ = ["DuplicateEmit", "Folder", "Replay", "Step", "fold", "folded", "node_up", "replay"]

#: follow-up events one input may cause before the fold is declared a loop
MAX_FOLLOW_UPS = 10_000


class DuplicateEmit(AssertionError):
    """The job machine emitted an ``Emit`` id it had emitted before (the reactor would stop on it)."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One event folded into the state, with what it did."""

    seq: int
    event: Event
    #: ``seq`` of the event that caused this one (by ``Emit`` or by being refused); ``None`` for an input
    cause: int | None
    before: JobState
    result: Transition[JobState]

    @property
    def rejected(self) -> str | None:
        return self.result.rejected


@dataclasses.dataclass(frozen=True)
class Replay:
    """The outcome of a fold: final state and every step taken."""

    state: JobState
    steps: tuple[Step, ...]

    @property
    def effects(self) -> tuple[Effect, ...]:
        """Every effect asked for, in order (``Emit`` included)."""
        return tuple(effect for step in self.steps for effect in step.result.effects)

    @property
    def rejections(self) -> tuple[str, ...]:
        return tuple(step.rejected for step in self.steps if step.rejected is not None)

    @property
    def log(self) -> tuple[Event, ...]:
        """The events in the order the reactor would have appended them (inputs and follow-ups)."""
        return tuple(step.event for step in self.steps)


class Folder:
    """Folds events one at a time; remembers the ``Emit`` ids it has followed."""

    def __init__(self, start: JobState | None = None, *, follow_emits: bool = True) -> None:
        self.state = start if start is not None else JobState()
        self.follow_emits = follow_emits
        self.steps: list[Step] = []
        self.emitted: dict[str, int] = {}  # Emit id -> seq of the event that emitted it
        self._last_seq = self.state.seq

    def feed(self, item: Event | Record, *, now: float = 0.0) -> tuple[Step, ...]:
        """Fold one input (and, when live, what it causes); return the steps taken.

        An input ``Record`` keeps its own ``seq`` and uses its ``at`` as the time;
        a bare ``Event`` gets the next ``seq`` and ``now``.
        """
        if isinstance(item, Record):
            first, seq, at = item.event, item.seq, item.at
        else:
            first, seq, at = item, self._last_seq + 1, now
        taken: list[Step] = []
        pending: deque[tuple[Event, int | None]] = deque([(first, None)])
        while pending:
            event, cause = pending.popleft()
            before = self.state
            result = fold_record(before, Record(seq=seq, at=at, event=event))
            taken.append(Step(seq=seq, event=event, cause=cause, before=before, result=result))
            self.state = result.state
            self._last_seq = max(self._last_seq, seq)
            if self.follow_emits:
                pending.extend(self._follow_ups(event, seq, result))
                if len(taken) > MAX_FOLLOW_UPS:
                    raise RuntimeError(f"{type(first).__name__} caused more than {MAX_FOLLOW_UPS} follow-up "
                                       "events; the state machine emits in a loop")
            seq = self._last_seq + 1
        self.steps += taken
        return tuple(taken)

    def _follow_ups(self, event: Event, seq: int, result: Transition[JobState]) -> list[tuple[Event, int]]:
        if result.rejected is not None:
            if isinstance(event, TransitionRejected):
                return []
            return [(TransitionRejected(event_type=event.type_name, seq=seq, reason=result.rejected), seq)]
        out = []
        for effect in result.effects:
            if isinstance(effect, Emit):
                if effect.id in self.emitted:
                    raise DuplicateEmit(f"{effect.id} emitted again by seq {seq} ({event.type_name}); first "
                                        f"emitted by seq {self.emitted[effect.id]}")
                self.emitted[effect.id] = seq
                out.append((effect.event, seq))
        return out

    def result(self) -> Replay:
        return Replay(state=self.state, steps=tuple(self.steps))


def replay(
    events: Iterable[Event | Record],
    *,
    now: float = 0.0,
    start: JobState | None = None,
    follow_emits: bool = True,
) -> Replay:
    """Fold ``events`` into ``start`` (a fresh job by default); see :meth:`Folder.feed`.

    Pass ``follow_emits=False`` to fold a log that already holds the follow-up
    events (a recorded log, or :attr:`Replay.log`).
    """
    folder = Folder(start, follow_emits=follow_emits)
    for item in events:
        folder.feed(item, now=now)
    return folder.result()


def fold(
    events: Iterable[Event | Record],
    *,
    now: float = 0.0,
    start: JobState | None = None,
    follow_emits: bool = True,
) -> tuple[JobState, list[Effect], list[str]]:
    """Fold ``events`` like :func:`replay`; return the final state, every effect and every rejection reason."""
    result = replay(events, now=now, start=start, follow_emits=follow_emits)
    return result.state, list(result.effects), list(result.rejections)


def folded(*events: Event, now: float = 0.0, start: JobState | None = None, follow_emits: bool = True) -> JobState:
    """The state after ``events``, which must all be accepted (a test's history; AssertionError names a refusal)."""
    state, _, rejections = fold(events, now=now, start=start, follow_emits=follow_emits)
    assert rejections == [], f"the history of a test state was rejected: {rejections}"
    return state


def node_up(node_id: str, incarnation: int = 1) -> tuple[NodeStarted, NodeJoined]:
    """A node's agent started (on host ``host-<node_id>``) and joined."""
    return (NodeStarted(node_id=node_id, incarnation=incarnation, host=f"host-{node_id}"),
            NodeJoined(node_id=node_id, incarnation=incarnation))
