"""Which agents the master counts as alive: the one check every agent call passes, heartbeat deadlines, shedding.

An agent speaks for one node incarnation; every call it makes is checked once, here
(:meth:`Liveness.is_live`, :meth:`Liveness.require_live`): the incarnation must be
the job's current one for its node, and alive. A stale agent is refused in one set
of words, which tell it to exit.

The watcher (:meth:`Liveness.watch`) declares a joined node lost (``NodeLost``) when
it has been silent for ``heartbeat_timeout_s``. It waits on the master's clock
(``MasterConfig.clock``), so a test moves time with :class:`stead.testing.FakeClock`.
It also measures how late the master's own loop runs: that lateness is added to
every node's allowance (a busy master does not blame its nodes), and while it is over
``shed_lag_s`` new nodes' registrations are refused with a retry-after
(:meth:`Liveness.shed_if_late`). The real clock is the system's time (as the
reactor's timers are): a jump forward reads as the master's own lateness, so no node
is declared lost for it (registrations are shed for ``_SHED_WINDOW_S``); a jump back
delays the detection of a silent node by as much.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Awaitable, Callable

import structlog

from stead.core.clock import WALL_CLOCK, Clock
from stead.core.config import Settings
from stead.core.errors import InvalidRequest, Overloaded, RpcUnavailable
from stead.core.events import Event, NodeLost, Record
from stead.core.statemachine import JobState, NodePhase

__all__ = ["Liveness"]

log = structlog.get_logger("stead.liveness")

#: the longest the heartbeat watcher sleeps between two looks at the nodes
_WATCH_MAX_S = 0.5
#: registrations are shed while the loop ran late within this many seconds
_SHED_WINDOW_S = 2.0
#: a shedding master logs it at most this often (a storm of refusals is one line a second, with the count)
_SHED_LOG_EVERY_S = 1.0
#: the longest wait a shedding master asks for
_RETRY_AFTER_MAX_S = 30.0


class Liveness:
    """The live node incarnations of one job, and when the master last heard from each."""

    def __init__(self, *, job: str, settings: Settings, submit: Callable[[Event], Awaitable[Record]],
                 get_state: Callable[[], JobState], clock: Clock = WALL_CLOCK) -> None:
        self.job = job
        self.settings = settings
        self._submit = submit
        self._state = get_state
        self._clock = clock
        #: node id -> (its incarnation heard from, when it was last heard from)
        self._heard: dict[str, tuple[int, float]] = {}
        #: False while the master replays its log: agents are told to retry, not that their node is unknown
        self.serving = True
        #: how late the master's loop ran recently (the watcher measures it); registrations are shed (refused with a
        #: retry-after) while it is over shed_lag_s
        self.lag_s = 0.0
        #: registrations refused so far, shedding load
        self.shed = 0
        self._shed_logged = -math.inf

    def is_live(self, node_id: str, incarnation: int) -> bool:
        """Whether the node incarnation is live; RpcUnavailable (the agent retries) until the master serves."""
        if not self.serving:
            raise RpcUnavailable(f"the master of job {self.job!r} is starting (replaying the job's log); "
                                 "try again in a moment")
        node = self._state().nodes.get(node_id)
        return node is not None and node.incarnation == incarnation and node.phase.alive

    def require_live(self, node_id: str, incarnation: int) -> None:
        """Refuse (InvalidRequest) a call of an agent whose node incarnation is not live: it is stale."""
        if self.is_live(node_id, incarnation):
            return
        known = self._state().nodes.get(node_id)
        current = f"current incarnation {known.incarnation} is {known.phase.value}" if known else "unknown node"
        raise InvalidRequest(f"node {node_id} incarnation {incarnation} is not a live node of job {self.job!r}; "
                             f"this agent is stale and should exit ({current})")

    def heard(self, node_id: str, incarnation: int) -> float:
        """Note that the node incarnation spoke now (a heartbeat, a registration); returns the time now."""
        now = self._clock.now()
        self._heard[node_id] = (incarnation, now)
        return now

    def shed_if_late(self) -> None:
        """Refuse (Overloaded, with a retry-after) while the master's loop runs more than shed_lag_s late."""
        if self.lag_s <= self.settings.shed_lag_s:
            return
        self.shed += 1
        now = self._clock.now()
        if now - self._shed_logged >= _SHED_LOG_EVERY_S:
            self._shed_logged = now
            log.warning("master_shedding_load", lag_s=round(self.lag_s, 2), refused=self.shed,
                        action="new nodes' registrations are refused with a retry-after until the master catches up")
        raise Overloaded(f"the master of job {self.job!r} is overloaded (its loop runs {self.lag_s:.1f} s late); "
                         "register again after the time it says", retry_after_s=min(_RETRY_AFTER_MAX_S, 2 * self.lag_s))

    async def watch(self) -> None:
        """Declare a joined node lost when it has been silent for ``heartbeat_timeout_s``.

        It looks every heartbeat interval, and at least every ``_WATCH_MAX_S``: a node is declared lost within
        that much of its timeout, whatever the interval (a scan of 10,000 nodes takes a few milliseconds).
        """
        for node_id, state in self._state().nodes.items():  # after a master restart: everyone gets a full timeout
            self.heard(node_id, state.incarnation)
        period = min(self.settings.heartbeat_interval_s, _WATCH_MAX_S)
        timeout = self.settings.heartbeat_timeout_s
        lags: collections.deque[tuple[float, float]] = collections.deque()
        while True:
            before = self._clock.now()
            await self._clock.sleep(period)
            now = self._clock.now()
            # a master too busy to read its heartbeats (a round of thousands of nodes starting) must not blame the
            # nodes: its own lateness over the last timeout is added to every node's allowance
            lags.append((now, max(0.0, now - before - period)))
            while lags[0][0] < now - timeout:
                lags.popleft()
            self.lag_s = max(lag for at, lag in lags if at >= now - _SHED_WINDOW_S)
            allowance = timeout + max(lag for _, lag in lags)
            if self._state().phase.terminal:
                continue  # the job ended: its nodes stop (and go quiet) within shutdown_grace_s, not lost
            # one cheap pass over what was heard; the job state is looked at for the few that are late
            late = [node_id for node_id, (_, at) in self._heard.items() if now - at > allowance]
            nodes = self._state().nodes
            for node_id in late:
                known = nodes.get(node_id)
                if known is None or known.phase is not NodePhase.JOINED:
                    continue
                incarnation, at = self._heard[node_id]
                if incarnation != known.incarnation:  # a newer incarnation starts with a full timeout
                    self.heard(node_id, known.incarnation)
                    continue
                silent = now - at
                if silent <= allowance:  # it spoke while an earlier node's loss was recorded
                    continue
                self._heard[node_id] = (incarnation, now)  # report once per timeout
                log.warning("node_silent", node=node_id, incarnation=incarnation, silent_s=round(silent, 1))
                await self._submit(NodeLost(node_id=node_id, incarnation=incarnation,
                                            reason=f"no heartbeat for {timeout:g} s"))
