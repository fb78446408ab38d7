"""Simulated agents: many nodes that speak the real agent protocol to a real master, with no workers.

``Swarm`` runs one asyncio task per simulated node in this process. Each node
registers (retrying with jittered backoff while the master is away or sheds
load), follows its command stream, answers ``StartWorkers`` by reporting its
workers started, and sends heartbeats at the interval the master asked for,
timing each round trip; each heartbeat acknowledges the commands taken since
the last one the master answered, as an agent's does. A test or benchmark then asks the nodes to fail, to go
silent or to report progress, and reads what each node was told::

    async with Swarm(master.address, master.token) as swarm:
        swarm.start(node_ids(200))
        await swarm.wait(lambda s: len(s.assigned(1)) == 200)
        ranks = swarm.assigned(1)                     # node -> its node rank in round 1
        await swarm.fail(["node-3", "node-4"], round=1)
        swarm.silence("node-7")                      # its heartbeats stop; the master declares it lost

Nodes share ``connections`` gRPC connections (default: one each, as real agents
have). Heartbeats go one per call (``batch=0``), or, as a per-rack aggregator
would send them, ``batch`` nodes' heartbeats per ``Heartbeats`` call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from types import TracebackType
from typing import Any, Self

from stead.core.config import Settings
from stead.core.errors import InvalidRequest, RetryableError, SteadError
from stead.core.events import WorkerFailed, WorkersStarted
from stead.core.platform import NodeSpec
from stead.core.retry import Backoff
from stead.core.rpc import (
    AgentReport,
    HeartbeatInfo,
    HeartbeatStream,
    MasterClient,
    RegisterInfo,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
)
from stead.core.rpc.backend import MAX_ACKS_PER_BEAT
from stead.testing.platforms import RecordingPlatform

__all__ = ["SimNode", "Swarm", "SwarmPlatform"]

#: the first wait between a node's attempts to register, and the longest
_BACKOFF_FIRST_S = 0.1
_BACKOFF = Settings(retry_initial_s=_BACKOFF_FIRST_S, retry_max_s=5.0)


@dataclasses.dataclass
class SimNode:
    """One simulated node and what the master told it."""

    node_id: str
    incarnation: int
    #: the training step its heartbeats report (None: none yet)
    step: int | None = None
    #: round -> node rank, for every StartWorkers received
    ranks: dict[int, int] = dataclasses.field(default_factory=dict)
    #: when (time.monotonic) each round's StartWorkers arrived
    assigned_at: dict[int, float] = dataclasses.field(default_factory=dict)
    #: round -> when its StopWorkers arrived
    stopped_at: dict[int, float] = dataclasses.field(default_factory=dict)
    registered_at: float | None = None
    #: how many times it registered (again after a master restart, or after the master forgot it)
    registrations: int = 0
    #: register attempts the master refused for now (load shed, starting): retried after a backoff
    refusals: int = 0
    #: the master told it to stop (StopNode), or refused it as stale: its task ended
    ended: str = ""
    silent: bool = False
    last_beat: float | None = None
    round: int = 0
    #: until when (time.monotonic) a refused registration is tried again
    patience_until: float = 0.0
    #: what its heartbeats say its workers use (memory bytes, CPU percent of one core); None: not reported
    rss_bytes: int | None = None
    cpu_percent: float | None = None
    #: the ids of the commands it took that no heartbeat the master answered has acknowledged yet
    acks: list[str] = dataclasses.field(default_factory=list)


class Swarm:
    """``async with Swarm(address, token) as swarm``: simulated nodes; see the module docstring."""

    def __init__(self, address: str, token: str, *, interval_s: float | None = None, connections: int = 0,
                 batch: int = 0, call_timeout_s: float = 10.0, nproc: int = 1, seed: int = 0) -> None:
        self.address = address
        self._token = token
        #: heartbeat interval; None: the one the master gives at registration
        self.interval_s = interval_s
        self._connections = connections
        self.batch = batch
        self._call_timeout_s = call_timeout_s
        self._nproc = nproc
        self._rng = random.Random(seed)
        self.nodes: dict[str, SimNode] = {}
        self._clients: list[MasterClient] = []
        self._index: dict[str, int] = {}
        self._side: set[asyncio.Task[None]] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._batcher: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        #: heartbeat round trips (seconds), as the nodes timed them; ``record_latencies`` turns it on and off
        self.latencies: list[float] = []
        self.record_latencies = True
        #: heartbeat calls that failed (timeout, unavailable, shed)
        self.heartbeat_errors = 0

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def stop(self) -> None:
        """End every node's task and close the connections."""
        tasks = [*self._tasks.values(), *self._side, *([self._batcher] if self._batcher else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._batcher = None
        for client in self._clients:
            await client.__aexit__(None, None, None)
        self._clients.clear()

    # -- driving the nodes ----------------------------------------------------------------

    def start(self, node_ids: Iterable[str], *, incarnation: int = 1, patience_s: float = 0.0) -> None:
        """Start a node task for each id (a node already running is replaced by this incarnation).

        ``patience_s``: how long a node keeps trying when the master refuses it as unknown (a relaunched node's
        agent started before the master recorded the relaunch); 0: it gives up at once, as a stale agent does.
        """
        for node_id in node_ids:
            old = self._tasks.pop(node_id, None)
            if old is not None:
                old.cancel()
            node = self.nodes[node_id] = SimNode(node_id=node_id, incarnation=incarnation,
                                                 patience_until=time.monotonic() + patience_s)
            self._tasks[node_id] = asyncio.create_task(self._run(node), name=f"sim:{node_id}")
        if self.batch and self._batcher is None:
            self._batcher = asyncio.create_task(self._beat_batches(), name="sim:batches")

    def kill(self, node_id: str, incarnation: int) -> None:
        """The node's agent dies (a platform killed it): its task ends, its connection stays for the others."""
        node = self.nodes.get(node_id)
        if node is not None and node.incarnation == incarnation:
            task = self._tasks.pop(node_id, None)
            if task is not None:
                task.cancel()
            node.ended = "killed"

    def silence(self, node_id: str) -> None:
        """Stop the node's heartbeats (its connection stays open): the master should declare it lost."""
        self.nodes[node_id].silent = True

    async def fail(self, node_ids: Sequence[str], *, round: int, at_once: bool = True) -> None:
        """Each node reports a worker failure of ``round`` (all together, or one after the other)."""
        async def one(node: SimNode) -> None:
            rank = node.ranks.get(round, 0)
            failure = WorkerFailed(node_id=node.node_id, round=round, local_rank=0, rank=rank * self._nproc,
                                   exit_code=1, signal=None, step=node.step, error_tail="simulated failure",
                                   exited_at=time.time())
            await (await self._client(node)).report_failure(AgentReport(incarnation=node.incarnation, event=failure))

        chosen = [self.nodes[n] for n in node_ids]
        if at_once:
            await asyncio.gather(*(one(node) for node in chosen))
        else:
            for node in chosen:
                await one(node)

    def set_usage(self, node_id: str, *, rss_bytes: int | None, cpu_percent: float | None) -> None:
        """What the node's heartbeats report its workers use, from its next heartbeat on."""
        node = self.nodes[node_id]
        node.rss_bytes, node.cpu_percent = rss_bytes, cpu_percent

    def set_step(self, step: int) -> None:
        """Every node reports ``step`` from its next heartbeat on."""
        for node in self.nodes.values():
            node.step = step

    async def wait(self, predicate: Callable[[Swarm], bool], *, timeout_s: float = 120.0) -> None:
        """Until ``predicate(self)`` holds (checked whenever a node hears from the master); TimeoutError after."""
        async with asyncio.timeout(timeout_s):
            while not predicate(self):
                self._changed.clear()
                await self._changed.wait()

    def assigned(self, round: int) -> dict[str, int]:
        """node -> node rank, for the nodes told to start ``round``."""
        return {n.node_id: n.ranks[round] for n in self.nodes.values() if round in n.ranks}

    def stopped(self, round: int) -> dict[str, float]:
        """node -> when it was told to stop its workers of ``round``."""
        return {n.node_id: n.stopped_at[round] for n in self.nodes.values() if round in n.stopped_at}

    # -- one node ----------------------------------------------------------------------------

    async def _client(self, node: SimNode) -> MasterClient:
        """The node's connection: its own, or one of ``connections`` shared ones (by node)."""
        index = self._index.setdefault(node.node_id, len(self._index) % self._connections
                                       if self._connections else len(self._index))
        while len(self._clients) <= index:
            client = MasterClient(self.address, self._token, call_timeout_s=self._call_timeout_s)
            self._clients.append(await client.__aenter__())  # closed by stop()
        return self._clients[index]

    async def _run(self, node: SimNode) -> None:
        client = await self._client(node)
        try:
            interval = await self._register(node, client)
            beats = None if self.batch else asyncio.create_task(self._beat(node, client, interval))
            try:
                await self._follow(node, client)
            finally:
                if beats is not None:
                    beats.cancel()
        except InvalidRequest as exc:
            node.ended = f"refused: {exc}"
        finally:
            self._notify()

    async def _register(self, node: SimNode, client: MasterClient) -> float:
        info = RegisterInfo(node_id=node.node_id, incarnation=node.incarnation, host="simulated", pid=1,
                            nproc=self._nproc)
        backoff = Backoff(_BACKOFF, rng=self._rng)  # as an agent backs off (jittered, at least the retry-after)
        while True:
            try:
                reply = await client.register(info)
                break
            except InvalidRequest:
                if time.monotonic() >= node.patience_until:
                    raise
                await asyncio.sleep(_BACKOFF_FIRST_S)
            except RetryableError as exc:  # the master is away, starting, or shedding load: jittered backoff
                node.refusals += 1
                await backoff.wait(at_least=exc.retry_after_s)
        node.registered_at = time.monotonic()
        node.registrations += 1
        self._notify()
        return self.interval_s or reply.heartbeat_interval_s

    async def _follow(self, node: SimNode, client: MasterClient) -> None:
        while True:
            try:
                async for command in client.commands(node.node_id, node.incarnation):
                    now = time.monotonic()
                    match command:
                        case StartWorkersCmd():
                            node.round = command.round
                            node.ranks[command.round] = command.node_rank
                            node.assigned_at[command.round] = now
                            node.step = None
                            self._notify()
                            await client.report_workers(AgentReport(
                                incarnation=node.incarnation,
                                event=WorkersStarted(node_id=node.node_id, round=command.round)))
                        case StopWorkersCmd():
                            node.stopped_at.setdefault(command.round, now)
                            self._notify()
                        case StopNodeCmd():
                            node.ended = f"stopped: {command.reason}"
                            return
                        case _:
                            pass
                    if command.id not in node.acks:
                        node.acks.append(command.id)
                return
            except RetryableError:  # the master went away: register again with the next one
                await asyncio.sleep(self._rng.uniform(0, _BACKOFF_FIRST_S))
                await self._register(node, client)

    async def _beat(self, node: SimNode, client: MasterClient, interval: float) -> None:
        await asyncio.sleep(self._rng.uniform(0, interval))  # agents started together do not beat in step
        next_at = time.monotonic()
        beats = client.beats()  # each node its own heartbeat stream, as an agent has (connections may be shared)
        try:
            await self._beat_on(node, beats, client, interval, next_at)
        finally:
            await beats.close()

    async def _beat_on(self, node: SimNode, beats: HeartbeatStream, client: MasterClient, interval: float,
                       next_at: float) -> None:
        while True:
            next_at += interval
            if not node.silent:
                started = time.monotonic()
                beat = self._beat_info(node)
                try:
                    known = await beats.send(beat)
                except SteadError:
                    self.heartbeat_errors += 1
                else:
                    _acknowledged(node, beat)
                    node.last_beat = time.monotonic()
                    if self.record_latencies:
                        self.latencies.append(node.last_beat - started)
                    if not known:
                        await self._register(node, client)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def _beat_info(self, node: SimNode) -> HeartbeatInfo:
        # a node that steps reports its own time per step, as an agent does (the master's straggler watch reads it)
        return HeartbeatInfo(node_id=node.node_id, incarnation=node.incarnation, round=node.round, step=node.step,
                             workers_alive=self._nproc, step_compute_s=None if node.step is None else 0.1,
                             rss_bytes=node.rss_bytes, cpu_percent=node.cpu_percent,
                             acked=tuple(node.acks[:MAX_ACKS_PER_BEAT]))

    async def _beat_batches(self) -> None:
        """As a per-rack aggregator: every interval, the nodes' heartbeats ``batch`` per call, spread out."""
        interval = self.interval_s or 1.0
        next_at = time.monotonic()
        while True:
            next_at += interval
            live = [n for n in self.nodes.values() if n.registered_at is not None and not n.silent and not n.ended]
            groups = [live[i:i + self.batch] for i in range(0, len(live), self.batch)]
            gap = interval / max(1, len(groups))
            for index, group in enumerate(groups):
                self._aside(self._send_batch(group, at=next_at - interval + index * gap))
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def _send_batch(self, group: list[SimNode], *, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        client = await self._client(group[0])
        started = time.monotonic()
        beats = [self._beat_info(node) for node in group]
        try:
            unknown = await client.heartbeats(beats)
        except SteadError:
            self.heartbeat_errors += 1
            return
        done = time.monotonic()
        if self.record_latencies:
            self.latencies.append(done - started)
        for node, beat in zip(group, beats, strict=True):
            _acknowledged(node, beat)
            node.last_beat = done
        for node_id in unknown:
            node = self.nodes[node_id]
            self._aside(self._reregister(node))

    def _aside(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    async def _reregister(self, node: SimNode) -> None:
        await self._register(node, await self._client(node))

    def _notify(self) -> None:
        self._changed.set()


def _acknowledged(node: SimNode, beat: HeartbeatInfo) -> None:
    """The master answered ``beat``: the commands it acknowledged are taken in."""
    if beat.acked:
        node.acks = [a for a in node.acks if a not in beat.acked]


class SwarmPlatform(RecordingPlatform):
    """A RecordingPlatform whose launches and kills start and stop simulated nodes of a :class:`Swarm`.

    The master needs its platform before the swarm can know the master's address: :meth:`attach` the swarm
    once both run; the nodes launched before that are started then. Incarnation 1 of every node is left to
    :meth:`Swarm.start` (so that a benchmark times the start itself); later incarnations, the relaunches, start
    here as a real platform would start them.
    """

    def __init__(self) -> None:
        super().__init__()
        self._swarm: Swarm | None = None

    def attach(self, swarm: Swarm) -> None:
        self._swarm = swarm
        for node_id, incarnation in self.specs:
            if incarnation > 1:
                swarm.start([node_id], incarnation=incarnation)

    async def launch(self, spec: NodeSpec) -> None:
        await super().launch(spec)
        if self._swarm is not None and spec.incarnation > 1:
            self._swarm.start([spec.node_id], incarnation=spec.incarnation)

    async def kill(self, node_id: str, incarnation: int) -> None:
        if self._swarm is not None:
            self._swarm.kill(node_id, incarnation)
        await super().kill(node_id, incarnation)
