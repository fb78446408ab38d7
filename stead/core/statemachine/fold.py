"""The one fold of the event log: the reactor, replay and the CLI all apply records through it.

:func:`fold` applies one stored record to the job state with the job machine,
at the record's time. A record the machine refuses still counts as read: the
state keeps its ``seq``, nothing else changes, and the refusal is returned so
the caller can record it (the reactor appends a ``TransitionRejected``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from stead.core.events import Record
from stead.core.statemachine.base import Transition
from stead.core.statemachine.job import JobState, transition

__all__ = ["fold", "fold_all"]


def fold(state: JobState, record: Record) -> Transition[JobState]:
    """``record`` applied to ``state``: the new state, the effects it asks for, or why it was refused."""
    result = transition(state, record.event, now=record.at, seq=record.seq)
    if result.rejected is not None:
        return Transition(dataclasses.replace(state, seq=max(record.seq, state.seq)), (), result.rejected)
    return result


def fold_all(records: Iterable[Record], state: JobState | None = None) -> JobState:
    """The state after ``records`` (a log replayed from ``state``, a fresh job by default)."""
    current = state if state is not None else JobState()
    for record in records:
        current = fold(current, record).state
    return current
