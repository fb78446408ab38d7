"""Masters hand a job over to each other: what a new master adopts, and what a master that fails leaves running.

A master that takes a job over (``stead run``'s supervisor started it after the
last one died, or ``stead master`` again) replays the log, then has the platform
adopt the nodes the log says still run (:func:`nodes_to_adopt`): their agents
reconnect with their current incarnation and the commands they did not
acknowledge are resent to them.

A master that stops on a failure its successor can take over from (the store
away past ``retry_deadline_s``, a task that kept failing, another master writing
the log) leaves the nodes and their rendezvous stores running when
``leave_nodes_on_failure`` is set (``stead run``'s and ``stead master``'s masters),
so the workers keep stepping; any other end (the job ended, a stop, a bug)
stops them. :func:`leaves_nodes` is that judgement, a pure function;
:class:`Takeover` applies it to the platform and the rendezvous stores as the
master's exit callbacks.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from stead.core.errors import LogConflict, RetryableError
from stead.core.master.rdzv_stores import RoundStores
from stead.core.platform import NodeSpec, Platform
from stead.core.statemachine import JobState, NodePhase, NodeState

__all__ = ["Takeover", "leaf_errors", "leaves_nodes", "nodes_to_adopt"]

log = structlog.get_logger("stead.master")  # the master's own events, wherever its code lives

#: the phases of a node whose agent (and workers) an earlier master launched and that may still run
_RUNNING = (NodePhase.STARTED, NodePhase.JOINED)


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The errors in ``exc``: itself, or every one in an exception group, nested groups flattened."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    return [leaf for inner in exc.exceptions for leaf in leaf_errors(inner)]


def nodes_to_adopt(state: JobState) -> list[NodeState]:
    """The nodes a master taking the job over has the platform adopt: those an earlier master launched that the
    log says still run; none once the job ended."""
    if state.phase.terminal:
        return []
    return [node for node in state.nodes.values() if node.phase in _RUNNING]


def leaves_nodes(exc: BaseException | None, *, reactor_failure: BaseException | None, job_ended: bool,
                 leave_nodes_on_failure: bool) -> bool:
    """Whether a master stopping with ``exc`` (its reactor stopped by ``reactor_failure``) leaves the job's nodes
    running for its successor: only when it is set to (``leave_nodes_on_failure``), the job still runs, and what
    stopped it is a failure a successor takes over from (a retryable error, or another master writing the log)."""
    if not leave_nodes_on_failure or job_ended:
        return False
    causes = [*(leaf_errors(exc) if exc is not None else []), reactor_failure]
    return any(isinstance(cause, RetryableError | LogConflict) for cause in causes)


class Takeover:
    """One master's side of the hand-over: it adopts the nodes of the master before it and, on a failure, leaves
    them (and the rendezvous stores) to the master after it.

    ``spec_for`` says how the platform starts a node incarnation (None: no node spec factory); ``state`` and
    ``reactor_failure`` are read when the master stops.
    """

    def __init__(self, *, job: str, platform: Platform | None, rounds: RoundStores, leave_nodes_on_failure: bool,
                 spec_for: Callable[[str, int], NodeSpec | None], state: Callable[[], JobState],
                 reactor_failure: Callable[[], BaseException | None]) -> None:
        self.job = job
        self.platform = platform
        self.rounds = rounds
        self.leave_nodes_on_failure = leave_nodes_on_failure
        self._spec_for = spec_for
        self._state = state
        self._reactor_failure = reactor_failure

    def failed(self, exc: BaseException | None) -> bool:
        """Whether the master stopping with ``exc`` leaves the nodes running (see :func:`leaves_nodes`)."""
        return leaves_nodes(exc, reactor_failure=self._reactor_failure(), job_ended=self._state().phase.terminal,
                            leave_nodes_on_failure=self.leave_nodes_on_failure)

    async def adopt_nodes(self, state: JobState) -> None:
        """Have the platform take over the nodes an earlier master launched that the log says still run (the
        commands their agents did not acknowledge are in the state: the gateway gives them when the agents connect)."""
        if self.platform is None:
            return
        for node in nodes_to_adopt(state):
            spec = self._spec_for(node.node_id, node.incarnation) or NodeSpec(
                job=self.job, node_id=node.node_id, incarnation=node.incarnation, command=())
            await self.platform.adopt(spec, pid=node.pid)

    def leave_nodes_if_failed(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                              tb: object) -> bool:
        """Before the platform closes: on a failure the next master takes over from, leave the nodes running."""
        if self.failed(exc):
            detach = getattr(self.platform, "detach", None)
            if callable(detach):
                detach()
            log.warning("master_leaving_nodes", job=self.job, error=repr(exc or self._reactor_failure()),
                        hint="the workers keep training; the next master adopts them (`stead run` starts one)")
        return False

    async def close_rounds(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                           tb: object) -> bool:
        """End the workers' rendezvous stores with the job; leave them to the next master after a failure."""
        if self.failed(exc):
            self.rounds.leave()
        else:
            await self.rounds.close()
        return False
