"""What every state machine returns."""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

from stead.core.statemachine.effects import Effect

__all__ = ["Transition"]

S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class Transition(Generic[S]):
    """The new state, the effects to run, and why the event was refused (if it was).

    A rejected transition always carries the *unchanged* state and no effects.
    """

    state: S
    effects: tuple[Effect, ...] = ()
    rejected: str | None = None


def reject(state: S, reason: str) -> Transition[S]:
    return Transition(state, (), reason)
