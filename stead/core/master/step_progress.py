"""The round's step progress, folded from the nodes' heartbeats into ``step.progress`` records.

Every heartbeat says the node's slowest worker's step and the long phase one of its
workers declared (a checkpoint save, say); heartbeats are never recorded. What is
recorded is the round's progress, the slowest member's step (``StepProgress``): at
most once per ``progress_interval_s`` (:meth:`ProgressRecorder.watch`), and at once
when it ends a recovery (the round's first step, once every member reported one) or
a phase starts or ends (:meth:`ProgressRecorder.heard` says when).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings
from stead.core.events import Event, Record, StepProgress
from stead.core.rpc.backend import HeartbeatInfo
from stead.core.statemachine import JobState

__all__ = ["ProgressRecorder"]

#: progress is recorded at most once per progress_interval_s, give or take the jitter of the timer that looks
_PROGRESS_SLACK = 0.9


@dataclasses.dataclass
class _NodeProgress:
    incarnation: int
    round: int = 0
    #: its slowest worker's last step; None before the round's first
    step: int | None = None
    #: a long phase one of its workers declared; "" when none
    phase: str = ""


class ProgressRecorder:
    """What each node's last heartbeat said of its steps, and what of the round's progress is on record."""

    def __init__(self, *, settings: Settings, submit: Callable[[Event], Awaitable[Record]],
                 get_state: Callable[[], JobState], clock: Clock = WALL_CLOCK) -> None:
        self.settings = settings
        self._submit = submit
        self._state = get_state
        self._clock = clock
        self._nodes: dict[str, _NodeProgress] = {}
        #: the progress last recorded: its round, step, phase and time
        self._round = 0
        self._step: int | None = None
        self._phase = ""
        self._at = 0.0
        #: the members of round ``_unstepped_round`` that have not reported a step yet
        self._unstepped: set[str] = set()
        self._unstepped_round = 0

    def _node(self, node_id: str, incarnation: int) -> _NodeProgress:
        node = self._nodes.get(node_id)
        if node is None or node.incarnation != incarnation:  # a new incarnation has no step yet
            node = self._nodes[node_id] = _NodeProgress(incarnation)
        return node

    def heard(self, beat: HeartbeatInfo) -> bool:
        """Take in what a live node's heartbeat says of its steps; True when it may complete a record of progress
        that should not wait for the next tick of :meth:`watch` (then :meth:`record`): the round's first step (its
        time ends a recovery) or a phase's start or end.

        Cheap for every heartbeat: the members still to report a first step are kept as a set.
        """
        node = self._node(beat.node_id, beat.incarnation)
        changed = beat.phase != node.phase
        node.round, node.step, node.phase = beat.round, beat.step, beat.phase
        if changed:
            return True
        rdzv = self._state().rdzv
        if not rdzv.active or self._round == rdzv.round or beat.step is None or beat.round != rdzv.round:
            return False
        if self._unstepped_round != rdzv.round:
            self._unstepped_round = rdzv.round
            self._unstepped = {m for m in rdzv.members if not self._stepped(m, rdzv.round)}
        self._unstepped.discard(beat.node_id)
        return not self._unstepped

    def workers_started(self, node_id: str, incarnation: int, round_: int) -> None:
        """The node's workers of round ``round_`` started: it has no step in that round yet."""
        node = self._node(node_id, incarnation)
        node.round, node.step = round_, None

    def _stepped(self, node_id: str, round_: int) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.round == round_ and node.step is not None

    async def watch(self) -> None:
        """Record the round's step progress every ``progress_interval_s`` (once per interval, not per heartbeat)."""
        while True:
            await self._clock.sleep(self.settings.progress_interval_s)
            await self.record()

    async def record(self, *, final: bool = False) -> None:
        """Record the round's progress (``StepProgress``) if every member has a step in it and it is news: the
        round's first, a phase's start or end, or a later step ``progress_interval_s`` after the last record
        (``final``: at once, the workers are done)."""
        rdzv = self._state().rdzv
        if not rdzv.active or not rdzv.members:
            return
        steps = []
        for member in rdzv.members:
            node = self._nodes.get(member)
            if node is None or node.round != rdzv.round or node.step is None:
                return
            steps.append(node.step)
        step = min(steps)
        phase = next((p for m in rdzv.members if (p := self._nodes[m].phase)), "")
        first = self._round != rdzv.round
        now = self._clock.now()
        if not first and phase == self._phase:  # a phase's start and end are recorded at once
            if self._step is not None and step <= self._step:
                return
            if not final and now - self._at < _PROGRESS_SLACK * self.settings.progress_interval_s:
                return
        self._round, self._step, self._at, self._phase = rdzv.round, step, now, phase
        await self._submit(StepProgress(round=rdzv.round, step=step, phase=phase))
