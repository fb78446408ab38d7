"""The agents' command streams: one ordered queue per node incarnation, given until acknowledged.

The executor queues the command an effect stands for (:meth:`CommandStreams.send`);
the node's agent reads its stream (:meth:`CommandStreams.stream`). A command is done
when its agent acknowledged it, not when it is queued here: the job state keeps each
node's command in force until then (see :mod:`stead.core.statemachine.commands`), and
every stream an agent opens, to this master or to one that took over, starts with
that command, made again from the job state when it is not queued here. Agents
acknowledge on their heartbeats (:meth:`CommandStreams.take_acks`); the
acknowledgements of many nodes go in one ``CommandsAcked`` event
(:meth:`CommandStreams.record_acks`), not one store write each.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

import structlog

from stead.core.errors import RpcUnavailable, StoreError
from stead.core.events import CommandAck, CommandsAcked, Event, Record
from stead.core.rpc.backend import (
    AgentCommand,
    CheckHealthCmd,
    DumpStacksCmd,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
)
from stead.core.statemachine import (
    AgentOrder,
    CheckHealth,
    DumpStacks,
    JobState,
    StartWorkers,
    StopNode,
    StopWorkers,
    in_force,
)

__all__ = ["CommandStreams", "agent_command"]

log = structlog.get_logger("stead.command_streams")

#: the most bytes of ids one CommandsAcked record carries (each ack counts its node's and its command's id and
#: _ACK_OVERHEAD_BYTES): half the smallest write a store may take (64 KiB), so a record always fits one; 300 or so
#: acks of a 10,000-node round's start
_ACK_RECORD_BYTES = 32 << 10
#: what one acknowledgement adds to a record besides its ids: its JSON keys and incarnation
_ACK_OVERHEAD_BYTES = 64


@dataclasses.dataclass
class _Outbox:
    """One node incarnation's commands not given yet, and those its agent acknowledged that are not on record."""

    incarnation: int
    queue: asyncio.Queue[AgentCommand] = dataclasses.field(default_factory=asyncio.Queue)
    acked: set[str] = dataclasses.field(default_factory=set)


class CommandStreams:
    """The command streams of one job's nodes, and the acknowledgements they sent back."""

    def __init__(self, *, job: str, submit: Callable[[Event], Awaitable[Record]], get_state: Callable[[], JobState],
                 store_addr: Callable[[], tuple[str, int]],
                 round_store: Callable[[int], Awaitable[tuple[str, int]]] | None = None) -> None:
        """``store_addr``: the newest round's rendezvous store; ``round_store(r)``: round ``r``'s, for a start
        command resent from the job state (default: the newest)."""
        self.job = job
        self._submit = submit
        self._state = get_state
        self._store_addr = store_addr
        self._round_store = round_store
        self._outboxes: dict[str, _Outbox] = {}
        #: acknowledgements taken in and not on record yet (at most one per node: one command is in force), and
        #: set while there are some
        self._acks: list[CommandAck] = []
        self._acks_waiting = asyncio.Event()

    def _outbox(self, node_id: str, incarnation: int) -> _Outbox:
        outbox = self._outboxes.get(node_id)
        if outbox is None or outbox.incarnation != incarnation:  # a new incarnation hears nothing of an old one's
            outbox = self._outboxes[node_id] = _Outbox(incarnation)
        return outbox

    def send(self, effect: StartWorkers | StopWorkers | StopNode | DumpStacks | CheckHealth, *,
             store_addr: tuple[str, int] | None = None) -> None:
        """Queue the command an effect stands for on its node's stream.

        ``store_addr`` is the TCPStore the round's workers (or a health check's nodes) rendezvous in (default:
        the latest).
        """
        outbox = self._outbox(effect.node_id, effect.incarnation)
        outbox.queue.put_nowait(agent_command(effect, store_addr or self._store_addr(), self._state()))

    async def stream(self, node_id: str, incarnation: int) -> AsyncGenerator[AgentCommand, None]:
        """The node's commands, starting with the one in force that its agent has not acknowledged (it may never
        have reached the agent: this stream replaces a broken one, or this master took over from one that died).

        The caller checked that the node incarnation is live."""
        outbox = self._outbox(node_id, incarnation)
        waiting: list[AgentCommand] = []
        while not outbox.queue.empty():
            waiting.append(outbox.queue.get_nowait())
        order = self._in_force(node_id, outbox)
        given = ""
        if order is not None:
            queued = next((c for c in waiting if c.id == order.id), None)
            if queued is None:
                log.info("command_resent", node=node_id, command=order.id, reason="not acknowledged")
            yield queued or await self._resent(order)
            if isinstance(order, StopNode):
                return
            given = order.id
        for command in waiting:  # the one-offs: the durable ones queued were the one in force, or superseded
            if _one_off(command):
                yield command
        while True:
            command = await outbox.queue.get()
            if not _one_off(command):
                order = self._in_force(node_id, outbox)
                if order is None or order.id != command.id or command.id == given:
                    log.debug("command_not_sent", node=node_id, command=command.id,
                              reason="superseded, acknowledged, or given on this stream already")
                    continue
                given = command.id
            yield command
            if isinstance(command, StopNodeCmd):
                return

    def _in_force(self, node_id: str, outbox: _Outbox) -> AgentOrder | None:
        """The node's command in force (:func:`~stead.core.statemachine.in_force`) unless its agent acknowledged it."""
        order = in_force(self._state(), node_id)
        if order is None or order.incarnation != outbox.incarnation or order.id in outbox.acked:
            return None
        return order

    async def _resent(self, order: AgentOrder) -> AgentCommand:
        """The command ``order`` stands for, made again from the job state (a round's start with its round's
        rendezvous store)."""
        if not isinstance(order, StartWorkers):
            return agent_command(order, self._store_addr(), self._state())
        try:
            address = await self._round_store(order.round) if self._round_store else self._store_addr()
        except StoreError as exc:
            raise RpcUnavailable(f"the rendezvous store of round {order.round} of job {self.job!r} is not available "
                                 f"({exc}); try again in a moment") from exc
        return agent_command(order, address, self._state())

    def take_acks(self, node_id: str, incarnation: int, ids: Sequence[str]) -> None:
        """Take a heartbeat's acknowledgements in, to be recorded by :meth:`record_acks`; one of a command not in
        force (a one-off, superseded, acknowledged already, or unknown) is harmless and only logged."""
        outbox = self._outbox(node_id, incarnation)
        order = self._in_force(node_id, outbox)
        for command_id in ids:
            if order is None or command_id != order.id:
                log.debug("command_ack_ignored", node=node_id, command=command_id,
                          reason="no such command awaits an acknowledgement")
                continue
            outbox.acked.add(command_id)
            self._acks.append(CommandAck(node_id=node_id, incarnation=incarnation, command_id=command_id))
            order = None
        if self._acks:
            self._acks_waiting.set()

    async def record_acks(self) -> None:
        """Record the acknowledgements taken in, as they come: all those that wait go in ``CommandsAcked`` records
        of many nodes each (a 10,000-node round's acks are a handful of store writes, not 10,000)."""
        while True:
            await self._acks_waiting.wait()
            self._acks_waiting.clear()
            while self._acks:
                batch = _first_record(self._acks)
                del self._acks[:len(batch)]
                try:
                    await self._submit(CommandsAcked(acks=tuple(batch)))
                except BaseException:  # recorded when this task runs again (the store back, say)
                    self._acks[:0] = batch
                    self._acks_waiting.set()
                    raise
                for ack in batch:
                    outbox = self._outboxes.get(ack.node_id)
                    if outbox is not None:
                        outbox.acked.discard(ack.command_id)


def _first_record(acks: Sequence[CommandAck]) -> list[CommandAck]:
    """As many of ``acks``, from the first, as one CommandsAcked record carries (at least one)."""
    size = 0
    for count, ack in enumerate(acks):
        size += len(ack.node_id) + len(ack.command_id) + _ACK_OVERHEAD_BYTES
        if size > _ACK_RECORD_BYTES and count:
            return list(acks[:count])
    return list(acks)


def _one_off(command: AgentCommand) -> bool:
    """Whether ``command`` is given once, on the stream open then, and never kept in force."""
    return isinstance(command, DumpStacksCmd | CheckHealthCmd)


def agent_command(effect: StartWorkers | StopWorkers | StopNode | DumpStacks | CheckHealth,
             store_addr: tuple[str, int], state: JobState | None = None) -> AgentCommand:
    """The command an effect stands for; ``store_addr``: the rendezvous store of a start's round or a check;
    ``state``: the job state when the command is given, whose steps to skip and restore bounds a start carries
    (decisions only add to them)."""
    host, port = store_addr
    match effect:
        case StartWorkers():
            return StartWorkersCmd(
                id=effect.id, round=effect.round, node_rank=effect.node_rank, nnodes=effect.nnodes,
                nproc_per_node=effect.nproc_per_node, world_size=effect.world_size,
                restart_count=effect.restart_count, master_addr=host, master_port=port,
                skip_steps=tuple(sorted(state.skip_steps)) if state else (),
                restore_bounds=state.restore_bounds if state else (),
            )
        case StopWorkers():
            return StopWorkersCmd(id=effect.id, round=effect.round, reason=effect.reason)
        case StopNode():
            return StopNodeCmd(id=effect.id, reason=effect.reason)
        case DumpStacks():  # a one-off: not kept in force (see stead.core.statemachine.commands)
            return DumpStacksCmd(id=effect.id, round=effect.round, reason=effect.reason)
        case CheckHealth():  # a one-off too: its report reaches whichever master runs by then
            return CheckHealthCmd(id=effect.id, check=effect.check, nodes=effect.nodes, store_host=host,
                                  store_port=port, timeout_s=effect.timeout_s)
