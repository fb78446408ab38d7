"""The commands to agents that wait for an acknowledgement: part of the job state, so that a new master resends them.

Three commands tell a node's agent what to run: start the workers of a round
(``StartWorkers``), stop them (``StopWorkers``), stop the node (``StopNode``).
Each one supersedes the node's previous one (a round's start stops the workers
of the round before, a stop makes a start of its round moot, a stopped node runs
nothing), so a node has at most one command in force: its latest. The fold keeps
it in :attr:`JobState.commands` from the record that asked for it until the
agent acknowledges its id (``CommandsAcked``). A master that takes over folds
the same log: it finds the command there and resends it when the agent connects,
whichever record asked for it (no special case for a round's start).

A command is no longer in force, and is not resent, once its node incarnation
ended (the node is lost, exited or relaunched), or, for a start, once its round
is not the running round any more (a later round started, or the round broke).
An acknowledgement that matches no command in force (repeated, late, of an
older incarnation) changes nothing.

One-offs (``DumpStacks``, ``CheckHealth``) are not kept here: they ask for a
report that something else waits on with its own limit (the hang detector, the
health check's timer), and a master that dies before delivering one loses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from stead.core.events import CommandAck, CommandsAcked, Event
from stead.core.statemachine.effects import AgentOrder, Effect, StartWorkers, StopNode, StopWorkers
from stead.core.statemachine.state import JobState

__all__ = ["in_force", "track"]


def track(state: JobState, event: Event, effects: Iterable[Effect]) -> JobState:
    """``state`` with the commands ``effects`` ask for in force and the ones ``event`` acknowledges dropped."""
    journal = state.commands
    if isinstance(event, CommandsAcked):
        journal = _acknowledged(journal, event.acks)
    orders = [e for e in effects if isinstance(e, StartWorkers | StopWorkers | StopNode)]
    if orders:
        journal = {**journal, **{order.node_id: order for order in orders}}  # the latest order supersedes
    return state if journal is state.commands else dataclasses.replace(state, commands=journal)


def _acknowledged(journal: Mapping[str, AgentOrder], acks: Iterable[CommandAck]) -> Mapping[str, AgentOrder]:
    left: dict[str, AgentOrder] | None = None
    for ack in acks:
        order = journal.get(ack.node_id)
        if order is not None and order.id == ack.command_id and order.incarnation == ack.incarnation:
            left = dict(journal) if left is None else left
            left.pop(ack.node_id, None)
    return journal if left is None else left


def in_force(state: JobState, node_id: str) -> AgentOrder | None:
    """The command ``node_id``'s current incarnation must still be given (None when nothing waits for its ack)."""
    order = state.commands.get(node_id)
    node = state.nodes.get(node_id)
    if order is None or node is None or node.incarnation != order.incarnation or not node.phase.alive:
        return None
    if isinstance(order, StartWorkers) and (order.round != state.rdzv.round or not state.rdzv.active):
        return None
    return order
