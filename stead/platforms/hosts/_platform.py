"""The master's side of a job over several machines: nodes placed on the hosts that offered themselves.

Every host of the job runs `stead run` with the same torchrun multi-node flags. The one that serves the job's
master runs :class:`HostsPlatform`: its own node goes to a local platform (an agent process on this machine, as
on one machine), and every other host offers itself over :class:`HostServicer` (``HostService.Offer``). A node the
job needs is launched on the host that holds its node rank (a static rendezvous: ``--node-rank``) or on any host
without a node (c10d); a node no host can take yet waits until one offers. The host's `stead run` starts and kills
the node's agent as the stream tells it and reports what the agent did (``HostService.ReportNode``); the agents
themselves register and heartbeat with the master as they do on one machine.

A host whose `stead run` disagrees with the job (another script, node count, job id) or claims a node rank that a
connected host holds is refused with a message saying so, on that host.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import Self

import grpclib
import grpclib.const
import structlog

from stead.core.events import NodeExited, NodePending, NodeStarted, RoomFound
from stead.core.platform import NodeSpec, Platform, PlatformEvent
from stead.core.runspec import RunConfig
from stead.platforms.hosts._proto.stead.hosts import v1 as proto

__all__ = ["HostServicer", "HostsPlatform", "job_shape", "shape_mismatch"]

log = structlog.get_logger("stead.hosts")

_Key = tuple[str, int]
#: where a node runs: the serving host itself, or a host's launcher id
LOCAL = ""
#: how long the master, as it ends, waits for each host's stream to carry the job's end to the host
ENDED_WAIT_S = 5.0
#: how often waiting nodes are placed again and hosts' silence looked at
PLACE_LOOK_S = 0.25
#: a host not heard from for this many keepalive periods is not given a node (it may be gone)
SILENT_PERIODS = 3
#: a host that hung up on its stream (its side closed it, the master's did not) after being heard from within the
#: last two keepalive periods, and did not offer itself again within this, is gone with its node: its `stead run` was
#: killed (with the host, most often). Its node is reported exited then, not after the heartbeat timeout. A host
#: heard from longer ago (cut off, its hang-up arriving only as the link heals) is left to the heartbeat timeout.
HUNG_UP_GRACE_S = 1.0
#: the grace's timer fires this much after it, so that the look it makes finds the grace over
_GRACE_LOOK_LATE_S = 0.01
#: an elected master's own host gets a node only once the node waited this long for another host: the other hosts
#: offer themselves within it as the job starts (their `stead run` started at about the same time, on a loaded
#: machine too: 1 s was too short in a fresh-clone run), and the master's host stays a spare when there is one, so
#: that losing it (with its master) costs the training nothing
HOME_LAST_S = 3.0


def job_shape(config: RunConfig) -> proto.JobShape:
    """What this host's command line says of the job; every host of one job must say the same."""
    return proto.JobShape(job=config.job_name, rdzv_id=config.rdzv_id, min_nodes=config.min_nodes,
                          max_nodes=config.max_nodes, nproc_per_node=config.nproc_per_node,
                          entrypoint=list(_script(config)), rdzv_backend=config.rdzv_backend)


def _script(config: RunConfig) -> tuple[str, ...]:
    """The script and its arguments, without the interpreter (which may live at another path on each host)."""
    if config.no_python:
        return (config.training_script, *config.training_script_args)
    return ("-m" if config.module else "", config.training_script, *config.training_script_args)


def shape_mismatch(mine: proto.JobShape, theirs: proto.JobShape) -> str:
    """What differs between two hosts' command lines ("" when they mean the same job)."""
    differ = []
    for field, flag in (("job", "the job name (--job-name or --rdzv-id)"), ("rdzv_id", "--rdzv-id"),
                        ("rdzv_backend", "--rdzv-backend"), ("nproc_per_node", "--nproc-per-node")):
        if getattr(mine, field) != getattr(theirs, field):
            differ.append(f"{flag}: {getattr(theirs, field)!r} here, {getattr(mine, field)!r} on the master's host")
    if (mine.min_nodes, mine.max_nodes) != (theirs.min_nodes, theirs.max_nodes):
        differ.append(f"--nnodes: {_nnodes(theirs)} here, {_nnodes(mine)} on the master's host")
    if list(mine.entrypoint) != list(theirs.entrypoint):
        differ.append(f"the script and its arguments: {' '.join(theirs.entrypoint).strip()!r} here, "
                      f"{' '.join(mine.entrypoint).strip()!r} on the master's host")
    return "; ".join(differ)


def _nnodes(shape: proto.JobShape) -> str:
    return str(shape.max_nodes) if shape.min_nodes == shape.max_nodes else f"{shape.min_nodes}:{shape.max_nodes}"


def static_rank(node_id: str) -> int | None:
    """The node rank a static rendezvous gives ``node-R`` (the master names its nodes so); None for other ids."""
    prefix, _, number = node_id.rpartition("-")
    return int(number) if prefix == "node" and number.isdigit() else None


@dataclasses.dataclass(eq=False)
class _Host:
    """A host that offered itself: its stream of commands, and the node it runs."""

    launcher_id: str
    name: str
    address: str
    #: a static rendezvous's --node-rank; None: any
    node_rank: int | None
    commands: asyncio.Queue[proto.HostCommand | None] = dataclasses.field(default_factory=asyncio.Queue)
    node: _Key | None = None
    connected: bool = True
    #: when the host was last heard from (time.monotonic): its offer, a report, or its keepalive
    seen: float = dataclasses.field(default_factory=time.monotonic)
    #: set when its stream ended (the last command written, or the host gone)
    closed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: when it hung up on its stream, having been heard from lately (see HUNG_UP_GRACE_S); None: it did not
    hung_up: float | None = None


class HostsPlatform:
    """Nodes on this host (through ``local``, a platform for this machine) and on the hosts that offer themselves.

    ``local_rank``: the node rank this host takes in a static rendezvous (its --node-rank); None: c10d, where this
    host takes the first node the job asks for and other hosts the rest. ``home``: the master was elected (etcd)
    and runs no node itself: every node goes to a host that offered itself, the one at the address ``home`` (the
    master's own host, whose `stead run` offers itself like the others) last (:data:`HOME_LAST_S`). A host runs
    one node at a time: one that has none is a spare, which a node whose host was lost goes to at once. Hosts
    report at least every ``keepalive_s``; one silent for :data:`SILENT_PERIODS` of them gets no node. A host that
    hangs up while it was heard from lately and does not come back within ``hung_up_grace_s`` has its node
    reported exited at once (:data:`HUNG_UP_GRACE_S`). A node that no host can take for ``pending_after_s`` is
    reported pending (NodePending: the scaler goes on without it while MIN hold). ``nodes_here``: False when this
    host runs no node of its own and names no host last (the Slurm platform, which starts a host on every node of
    its allocation, this one's included). A host named in a node's ``avoid_hosts`` (excluded as faulty) or barred
    (:meth:`bar`) gets no node. Closing tells every connected host that the job ended (its `stead run` stops its node
    and exits, reporting nothing more): each node still on one is reported exited then, and the events end.
    """

    name = "hosts"

    def __init__(self, *, local: Platform, shape: proto.JobShape, local_rank: int | None, static: bool,
                 host_name: str, keepalive_s: float, pending_after_s: float,
                 ended_wait_s: float = ENDED_WAIT_S, hung_up_grace_s: float = HUNG_UP_GRACE_S,
                 home: str | None = None, nodes_here: bool = True) -> None:
        self.local = local
        self.home = home
        self.nodes_here = nodes_here
        #: host names given no node any more (why, by name): gone, or excluded by the platform (:meth:`bar`)
        self.barred: dict[str, str] = {}
        self.ended_wait_s = ended_wait_s
        self.hung_up_grace_s = hung_up_grace_s
        #: set once the master leaves (it ends, or leaves its nodes to the next one): hang-ups are its own doing
        self._leaving = False
        self.keepalive_s = keepalive_s
        self.pending_after_s = pending_after_s
        #: when each waiting node began to wait, and whether its wait was reported
        self._since: dict[_Key, float] = {}
        self._reported: set[_Key] = set()
        self.shape = shape
        self.static = static
        self.local_rank = local_rank
        self.host_name = host_name
        self._hosts: dict[str, _Host] = {}
        #: where each launched node runs (LOCAL or a launcher id); nodes waiting for a host are in _waiting
        self._placed: dict[_Key, str] = {}
        self._waiting: dict[_Key, NodeSpec] = {}
        #: nodes killed (lost, stopped): a host that offers itself again still running one is told to kill it
        self._killed: set[_Key] = set()
        self._local_busy: _Key | None = None
        #: None, last: the platform closed (the stream ends)
        self._events: asyncio.Queue[PlatformEvent | None] = asyncio.Queue()
        #: the nodes on other hosts reported exited (by their host, or as lost)
        self._exited: set[_Key] = set()
        self._detached = False
        self._ended: proto.Ended | None = None
        self._forward: asyncio.Task[None] | None = None
        self._look: asyncio.Task[None] | None = None

    # -- Platform -------------------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.local.__aenter__()  # type: ignore[attr-defined]
        self._forward = asyncio.create_task(self._forward_local(), name="hosts-local-events")
        self._look = asyncio.create_task(self._look_again(), name="hosts-place")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._leaving = True
        ended = self._ended or proto.Ended(exit_code=1, summary="the job's master stopped")
        told = [host for host in self._hosts.values() if host.connected]
        for host in told:
            host.commands.put_nowait(proto.HostCommand(ended=ended))
            host.commands.put_nowait(None)
        # each stream writes its last command before the master's RPC server closes (a bounded wait: a host cut
        # off finds out by itself, after master_gone_timeout_s)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ended_wait_s):
                for host in told:
                    await host.closed.wait()
        for task in (self._forward, self._look):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.local.__aexit__(exc_type, exc, tb)  # type: ignore[attr-defined]
        if not self._detached:  # the hosts told stop their nodes as their `stead run` ends (it reports no more)
            for key, where in self._placed.items():
                holder = self._hosts.get(where)
                if where != LOCAL and key not in self._exited and holder is not None and holder in told:
                    self._events.put_nowait(NodeExited(node_id=key[0], incarnation=key[1], reason=(
                        f"the job's master stopped: host {holder.name} was told to stop its node")))
        self._events.put_nowait(None)

    def end(self, *, exit_code: int, summary: str) -> None:
        """What the other hosts' `stead run` print and exit with when the job ends (told as the platform closes)."""
        self._ended = proto.Ended(exit_code=exit_code, summary=summary)

    def detach(self) -> None:
        """The master leaves its nodes to the next one (it failed, or was told to go): nothing is killed here."""
        self._leaving = True
        self._detached = True
        detach = getattr(self.local, "detach", None)
        if callable(detach):
            detach()

    async def launch(self, spec: NodeSpec) -> None:
        key = (spec.node_id, spec.incarnation)
        if key in self._placed or key in self._waiting:
            return
        self._waiting[key] = spec
        self._since[key] = time.monotonic()
        await self._place()

    async def kill(self, node_id: str, incarnation: int) -> None:
        key = (node_id, incarnation)
        self._waiting.pop(key, None)
        self._killed.add(key)
        where = self._placed.get(key)
        if where is None:
            return
        if where == LOCAL:
            await self.local.kill(node_id, incarnation)
            return
        host = self._hosts.get(where)
        if host is not None and host.connected:
            host.commands.put_nowait(proto.HostCommand(kill=proto.Kill(node_id=node_id, incarnation=incarnation)))

    async def adopt(self, spec: NodeSpec, *, pid: int | None) -> bool:
        """A node an earlier master launched: this host's by pid; another host's once it offers itself again
        (its `stead run` does, to whichever master serves), so it is taken as running meanwhile."""
        key = (spec.node_id, spec.incarnation)
        if self.home is not None or not self.nodes_here:  # every node runs on a host that offers itself again
            return True
        if await self.local.adopt(spec, pid=pid):  # (the local platform checks the pid runs this node's agent)
            self._placed[key] = LOCAL
            self._local_busy = key
            return True
        return not (self.static and static_rank(spec.node_id) == self.local_rank)

    async def events(self) -> AsyncIterator[PlatformEvent]:
        """The nodes' events until the platform closed (its last ones: the nodes on hosts it told to stop)."""
        while (event := await self._events.get()) is not None:
            yield event
        self._events.put_nowait(None)  # (for another reader)

    # -- hosts ----------------------------------------------------------------------------------------------

    def offer(self, offer: proto.HostOffer) -> tuple[_Host | None, str]:
        """Take a host's offer; (None, why) when it is refused."""
        differ = shape_mismatch(self.shape, offer.shape or proto.JobShape())
        if differ:
            return None, (f"this host's `stead run` does not mean the same job as the master's host "
                          f"({self.host_name}): {differ}. Run the same command on every host, only --node-rank "
                          "differing")
        rank = offer.node_rank if offer.node_rank >= 0 else None
        if self.static and rank is None:
            return None, "a static rendezvous needs --node-rank on every host"
        if self.static and rank is not None:
            if rank == self.local_rank:
                return None, (f"--node-rank {rank} is the master's host's ({self.host_name}); give each host its "
                              f"own rank, 0 to {self.shape.max_nodes - 1}")
            holder = next((h for h in self._hosts.values() if h.connected and h.node_rank == rank
                           and h.launcher_id != offer.launcher_id), None)
            if holder is not None:
                return None, (f"--node-rank {rank} is held by host {holder.name} ({holder.address}); give each "
                              f"host its own rank, 0 to {self.shape.max_nodes - 1}")
        old = self._hosts.get(offer.launcher_id)
        if old is not None:  # the same `stead run` again (a broken stream, a new master): its node goes on
            old.commands.put_nowait(None)
        host = _Host(offer.launcher_id, offer.host, offer.address, rank)
        for running in offer.running:
            key = (running.node_id, running.incarnation)
            self._placed[key] = offer.launcher_id
            self._waiting.pop(key, None)
            host.node = key  # (free again once the host reports it exited)
            if key in self._killed:  # lost while the host was cut off: its agent goes (its RPCs are fenced anyway)
                host.commands.put_nowait(proto.HostCommand(kill=proto.Kill(node_id=key[0], incarnation=key[1])))
        self._hosts[offer.launcher_id] = host
        log.info("host_joined", host=host.name, address=host.address, node_rank=rank,
                 running=[f"{n}/{i}" for n, i in ([host.node] if host.node else [])])
        return host, ""

    def gone(self, host: _Host, *, hung_up: bool = False) -> None:
        """The host's stream ended (``hung_up``: the host's side closed it): nothing more is placed on it. Its node,
        if any, lives on until the host offers itself again, the master declares it lost (its heartbeats stop), or,
        for a host that hung up while heard from lately, ``hung_up_grace_s`` pass (see :meth:`_hung_up_nodes`)."""
        host.closed.set()
        if self._hosts.get(host.launcher_id) is host:
            host.connected = False
            if hung_up and time.monotonic() - host.seen <= 2 * self.keepalive_s:  # (it reports every keepalive_s)
                host.hung_up = time.monotonic()
                # looked at again as the grace ends, not at the next placing look (up to PLACE_LOOK_S later)
                asyncio.get_running_loop().call_later(self.hung_up_grace_s + _GRACE_LOOK_LATE_S, self._hung_up_nodes)
            log.warning("host_disconnected", host=host.name, address=host.address, hung_up=hung_up,
                        node=f"{host.node[0]}/{host.node[1]}" if host.node else None)

    def bar(self, name: str, reason: str, *, lost: bool) -> None:
        """Host ``name`` gets no node any more (``reason``: why, as its platform says); ``lost``: it is gone, so
        that the node it ran is reported exited now (NodeLost), not after the heartbeat timeout."""
        self.barred[name] = reason
        for host in self._hosts.values():
            key = host.node
            if host.name != name or key is None or not lost or key in self._killed:
                continue
            if self._placed.get(key) != host.launcher_id or self._leaving:
                continue
            host.node = None
            self._killed.add(key)  # (a host that comes back still running it is told to kill it)
            if host.connected:  # (drained, not dead: its agent goes)
                host.commands.put_nowait(proto.HostCommand(kill=proto.Kill(node_id=key[0], incarnation=key[1])))
            log.warning("host_lost", host=host.name, address=host.address, node=key[0], incarnation=key[1],
                        reason=reason)
            self._exited.add(key)
            self._events.put_nowait(NodeExited(node_id=key[0], incarnation=key[1], reason=f"NodeLost: {reason}"))

    def connected(self, name: str) -> bool:
        """Whether a host named ``name`` holds a stream to this master now."""
        return any(host.connected and host.name == name for host in self._hosts.values())

    def _hung_up_nodes(self) -> None:
        """Report the node of each host that hung up and did not come back within ``hung_up_grace_s`` exited."""
        now = time.monotonic()
        for host in self._hosts.values():
            if host.hung_up is None or now - host.hung_up < self.hung_up_grace_s or self._leaving:
                continue
            host.hung_up = None
            key = host.node
            if key is None or key in self._killed or self._placed.get(key) != host.launcher_id:
                continue
            host.node = None
            reason = (f"host {host.name} ({host.address}) hung up and did not offer itself again within "
                      f"{self.hung_up_grace_s:g} s: its `stead run` is gone, most likely with the host")
            log.warning("host_lost", host=host.name, address=host.address, node=key[0], incarnation=key[1],
                        reason=reason)
            self._exited.add(key)
            self._events.put_nowait(NodeExited(node_id=key[0], incarnation=key[1], reason=f"NodeLost: {reason}"))

    async def placed(self, host: _Host | None = None) -> None:
        """Place the waiting nodes (a host offered itself); ``host`` still without a node after that is room for
        one more (RoomFound: a scaler that gave up on a node for want of a host asks for it again at once)."""
        await self._place()
        if host is not None and host.node is None and host.connected:
            self._events.put_nowait(RoomFound(reason=f"host {host.name} ({host.address}) offered itself and runs no "
                                                     "node"))

    def report(self, report: proto.NodeReport) -> None:
        """What a host's agent did; reports of nodes the host does not hold are dropped."""
        host = self._hosts.get(report.launcher_id)
        if host is None:
            return  # a host that has not offered itself to this master (it does when its stream opens again)
        host.seen = time.monotonic()
        if not report.node_id:
            return  # its keepalive
        key = (report.node_id, report.incarnation)
        if self._placed.get(key) != report.launcher_id:
            log.info("host_report_dropped", node=report.node_id, incarnation=report.incarnation,
                     why="not a node placed on that host")
            return
        if report.started:
            self._events.put_nowait(NodeStarted(node_id=report.node_id, incarnation=report.incarnation,
                                                host=host.name, pid=report.pid or None))
        if report.exited:
            self._exited.add(key)
            self._events.put_nowait(NodeExited(node_id=report.node_id, incarnation=report.incarnation,
                                               exit_code=report.exit_code, signal=report.signal,
                                               reason=report.reason))
            if host.node == key:
                host.node = None
                if host.connected and not self._leaving and self._ended is None:  # free again (a host back from a
                    # partition, its old node killed): room for a node the job gave up on
                    self._events.put_nowait(RoomFound(
                        reason=f"host {host.name} ({host.address}) runs no node now ({key[0]}/{key[1]} exited)"))

    async def _place(self) -> None:
        for key, spec in sorted(self._waiting.items()):
            if self._local_takes(key):
                del self._waiting[key]
                self._since.pop(key, None)
                self._placed[key] = LOCAL
                self._local_busy = key
                await self.local.launch(spec)
                continue
            host = self._free_host(key)
            if host is None:
                self._report_wait(key)
                continue
            del self._waiting[key]
            self._since.pop(key, None)
            self._placed[key] = host.launcher_id
            host.node = key
            host.commands.put_nowait(proto.HostCommand(launch=proto.Launch(
                node_id=spec.node_id, incarnation=spec.incarnation, resources=dict(spec.resources))))
            log.info("node_placed", node=spec.node_id, incarnation=spec.incarnation, host=host.name)

    def _local_takes(self, key: _Key) -> bool:
        """Whether this host runs the node: the node of its rank (static); c10d: when this host runs no node, or
        ran an older incarnation of this one; never when the master was elected (``home``)."""
        if self.home is not None or not self.nodes_here:
            return False
        if self.static:
            return static_rank(key[0]) == self.local_rank
        return self._local_busy is None or self._local_busy[0] == key[0]

    def _free_host(self, key: _Key) -> _Host | None:
        """A host that can take the node now: connected, heard from lately, running no node (an earlier
        incarnation's included: its exit is reported first), and holding the node's rank in a static rendezvous;
        the master's own host (``home``) last, and once the node waited :data:`HOME_LAST_S`."""
        rank = static_rank(key[0]) if self.static else None
        spec = self._waiting.get(key)
        avoid = set(spec.avoid_hosts) if spec is not None else set()
        now = time.monotonic()
        silent_after = now - SILENT_PERIODS * self.keepalive_s
        home_ok = now - self._since.get(key, now) >= HOME_LAST_S
        for host in sorted(self._hosts.values(), key=lambda h: (h.address == self.home, h.name)):
            if not host.connected or host.seen < silent_after or host.node is not None:
                continue
            if host.name in avoid or host.name in self.barred:
                continue
            if self.static and host.node_rank != rank:
                continue
            if host.address == self.home and not home_ok:
                continue
            return host
        return None

    def _report_wait(self, key: _Key) -> None:
        waited = time.monotonic() - self._since.get(key, time.monotonic())
        if key in self._reported or waited < self.pending_after_s:
            return
        self._reported.add(key)
        if self.static:
            reason = (f"no host with --node-rank {static_rank(key[0])} is connected: start `stead run` with the job's "
                      "command and that rank on a host")
        else:
            reason = ("every host that offered itself runs a node or was lost: start `stead run` with the job's "
                      "command on another host to add one")
        log.warning("node_pending", node=key[0], incarnation=key[1], waited_s=round(waited, 1), reason=reason)
        self._events.put_nowait(NodePending(node_id=key[0], incarnation=key[1], pending_s=round(waited, 3),
                                            reason=reason))

    async def _look_again(self) -> None:
        """Place waiting nodes as hosts come and go quiet, and report the ones that wait too long."""
        while True:
            await asyncio.sleep(PLACE_LOOK_S)
            self._hung_up_nodes()
            if self._waiting:
                await self._place()

    async def _forward_local(self) -> None:
        async for event in self.local.events():
            if isinstance(event, NodeExited) and self._local_busy == (event.node_id, event.incarnation):
                self._local_busy = None
            if isinstance(event, NodeStarted):  # named as the other hosts name it, not "localhost"
                event = dataclasses.replace(event, host=self.host_name)
            await self._events.put(event)


class HostServicer(proto.HostServiceBase):
    """HostService on the master's RPC server (every call authenticated with the job token by the server)."""

    def __init__(self, platform: HostsPlatform, *, keepalive_s: float) -> None:
        self._platform = platform
        self._keepalive_s = keepalive_s

    async def offer(self, message: proto.HostOffer) -> AsyncIterator[proto.HostCommand]:
        host, why = self._platform.offer(message)
        if host is None:
            log.warning("host_refused", host=message.host, address=message.address, why=why)
            raise grpclib.GRPCError(grpclib.const.Status.FAILED_PRECONDITION, why)
        closed_here = False
        try:
            yield proto.HostCommand(accepted=proto.Accepted(host=host.name))
            await self._platform.placed(host)
            async for command in _drain(host.commands, self._keepalive_s):
                if command is None:  # the last one went: the host hangs up once it read it (a close from here
                    closed_here = True  # could reset the connection before it did)
                    await asyncio.sleep(ENDED_WAIT_S)
                    return
                yield command
        finally:
            self._platform.gone(host, hung_up=not closed_here)

    async def report_node(self, message: proto.NodeReport) -> proto.ReportAck:
        self._platform.report(message)
        return proto.ReportAck()


async def _drain(commands: asyncio.Queue[proto.HostCommand | None],
                 keepalive_s: float) -> AsyncGenerator[proto.HostCommand | None, None]:
    """The host's commands as they come, and an empty one every ``keepalive_s`` while there is none: the host
    learns that its master is there from the stream itself, not only from a stream that stays quiet."""
    while True:
        try:
            async with asyncio.timeout(keepalive_s):
                command = await commands.get()
        except TimeoutError:
            yield proto.HostCommand()
            continue
        yield command
