"""The master side of flash checkpoints: commits, persisted steps and restores, served as CheckpointService.

Agents report after each save what their ranks hold; the plugin folds the reports
into its :class:`~stead.plugins.ckpt._book.Book` and records ``CheckpointCommitted``
(durably, before answering) when every rank of the round holds a step. Agents that
wait for a commit long-poll ``GetCommitted``. The newest commit and persisted step
are kept under the plugin's own store key, so a restarted master still tells a
restarting round which step to restore.

"Commit means replicated" (:mod:`._replicated`): from what the holders of replicas report, the plugin moves the
newest step every rank's copy of is in another host's memory (R, recorded as ``ckpt.replicated`` and kept under
the same key) and picks the committed step the agents copy next (X); both go out with every commit, and the agents
keep their slots.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time

import structlog

from stead.plugin import (
    MAX_NODE_ID_CHARS,
    CheckpointCommitted,
    NodeExited,
    NodeLost,
    Plugin,
    PluginContext,
    Record,
    at_least,
    backend_errors,
    check_name,
    finite_figure,
    invalid,
)
from stead.plugins.ckpt import _placement, _replicated
from stead.plugins.ckpt._book import Book, Holding, disk_report, memory_report, released, save_seconds
from stead.plugins.ckpt._proto.stead import v1 as proto
from stead.plugins.ckpt.events import CheckpointCorrupt, CheckpointPersisted, CheckpointReplicated, CheckpointRestored
from stead.plugins.ckpt.settings import CheckpointSettings

__all__ = ["CheckpointPlugin", "CheckpointServicer", "corrupt_from_proto"]

log = structlog.get_logger("stead.plugins.ckpt")

TIERS = ("memory", "disk")
#: where a rank's restore came from ("peer": a replica fetched from another host's memory)
RESTORE_TIERS = ("memory", "peer", "disk", "reshard", "none")
#: ranks beyond this are refused as bad input (a typo, not a world)
_MAX_WORLD = 1 << 20
#: the commits the master remembers (step, round), so that a replica of a step the job never committed is never
#: handed out for a restore (R, X and the newest commit are kept apart from these, and across a master restart)
_COMMITS_KEPT = 16
#: the replicas one node may say it holds of one rank: the newest and R's, kept while the newest arrived
_MAX_HELD_PER_RANK = 2
#: how long the step the first warned node of a round persists is the one every warned node persists: Slurm signals
#: every step of the job at once, and a warning that comes later is another (a preemption after a time limit's)
WARNING_WINDOW_S = 60.0


class CheckpointPlugin(Plugin[CheckpointSettings]):
    """Master-side flash checkpoint coordination (entry point ``stead.plugins: ckpt``)."""

    name = "ckpt"
    settings_class = CheckpointSettings
    #: a node that ended took the replicas it held with it
    subscriptions = (NodeLost, NodeExited)

    def __init__(self, *, settings: CheckpointSettings) -> None:
        super().__init__(settings=settings)
        self.book = Book()
        self._ctx: PluginContext[CheckpointSettings] | None = None
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        #: round -> rank -> (step, tier) of the restores reported so far
        self._restored: dict[int, dict[int, tuple[int, str]]] = {}
        #: round -> rank -> (own, peer, other nodes): the old ranks' slots a rank resharded from memory read, by kind
        self._reshard_parts: dict[int, dict[int, tuple[int, int, int]]] = {}
        #: the nodes that take replicas (the newest incarnation's report of each), and what each holds
        self._peers: dict[str, _Peer] = {}
        #: holder node -> rank -> (step, round, world) of each replica it holds of it
        self._held: dict[str, dict[int, tuple[tuple[int, int, int], ...]]] = {}
        #: R and X (:mod:`._replicated`), and the commits seen lately: (step, round)
        self.replication = _replicated.Replication()
        self._commits: collections.deque[tuple[int, int]] = collections.deque(maxlen=_COMMITS_KEPT)
        self._placement: tuple[tuple[_placement.Member, ...], dict[str, tuple[str, ...]]] = ((), {})
        self._single_host_said = False
        #: what ``stead status`` was last told of the replicas
        self._status: list[str] = []
        #: (round, step, step's round, when) of the step warned nodes persist (:meth:`warning_step`)
        self._warning: tuple[int, int, int, float] | None = None

    async def start(self, *, ctx: PluginContext[CheckpointSettings]) -> None:
        self._ctx = ctx
        raw = await ctx.store.get(ctx.key("book"))
        if raw is not None:
            try:
                saved = json.loads(raw.value)
                self.book = Book(step=int(saved["step"]), step_round=int(saved["step_round"]),
                                 persisted=int(saved["persisted"]))
                replicated, replicating = saved.get("replicated", [-1, -1]), saved.get("replicating", [-1, -1])
                self.replication = _replicated.Replication(
                    replicated=(int(replicated[0]), int(replicated[1])),
                    replicating=(int(replicating[0]), int(replicating[1])), world=int(saved.get("world", 0)),
                    since=time.monotonic(), late=bool(saved.get("late", False)))
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                log.warning("ckpt_book_unreadable", error=repr(exc), action="starting with no committed step")
        ctx.add_rpc_handler(CheckpointServicer(self))

    # -- called by the servicer -----------------------------------------------------------------

    @property
    def ctx(self) -> PluginContext[CheckpointSettings]:
        if self._ctx is None:
            raise RuntimeError("the ckpt plugin was not started")
        return self._ctx

    async def memory_report(self, *, round_: int, world_size: int,
                            ranks: dict[int, Holding]) -> tuple[int, dict[int, int]]:
        async with self._lock:
            book, step = memory_report(self.book, round_=round_, world_size=world_size, ranks=ranks)
            if step is not None:
                await self.ctx.emit(CheckpointCommitted(step=step, tier="memory", save_s=save_seconds(book, step)))
                self._commits.append((step, round_))
                log.debug("ckpt_committed", step=step, round=round_)
            self.book = book
            if step is not None and not await self._advance(time.monotonic()):
                await self._save(book)
            answer = (book.round_step if book.round == round_ else -1), released(book, ranks)
        await self._notify()
        return answer

    def replica_report(self, *, node_id: str, incarnation: int, round_: int, host: str, address: str,
                       ranks: list[int], held: dict[int, tuple[tuple[int, int, int], ...]],
                       held_bytes: int = 0) -> tuple[tuple[str, str], ...]:
        """Note where a node takes replicas and which it holds; the (node_id, address) its replicas go to."""
        peer = self._peers.get(node_id)
        if peer is not None and peer.incarnation > incarnation:
            return ()  # a report of an incarnation that was replaced
        self._peers[node_id] = _Peer(incarnation=incarnation, host=host, address=address, round=round_,
                                     first_rank=min(ranks, default=-1), held_bytes=held_bytes)
        self._held[node_id] = held
        if self.settings.replicas <= 0 or not address:
            return ()
        newest = max(p.round for p in self._peers.values())
        members = tuple(sorted((_placement.Member(node_id=n, host=p.host, first_rank=p.first_rank)
                                for n, p in self._peers.items() if p.round == newest and p.address and p.host
                                and p.first_rank >= 0), key=lambda m: (m.first_rank, m.node_id)))
        if members != self._placement[0]:
            self._placement = members, _placement.targets(members, self.settings.replicas)
            hosts = {m.host for m in members}
            if len(members) > 1 and len(hosts) == 1 and not self._single_host_said:
                self._single_host_said = True
                log.info("ckpt_replicas_single_host", host=next(iter(hosts)), nodes=len(members),
                         effect="no replica is placed: a copy on the same host would not survive its loss")
            elif len(hosts) > 1:
                log.info("ckpt_replicas_placed", placement={k: list(v) for k, v in self._placement[1].items()})
        return tuple((t, self._peers[t].address) for t in self._placement[1].get(node_id, ()))

    async def advance_replication(self) -> None:
        """Fold the holders' reports into R and X (after a replica report)."""
        async with self._lock:
            changed = await self._advance(time.monotonic())
        if changed:
            await self._notify()

    async def _advance(self, now: float) -> bool:
        """(under the lock) R and X after a commit or a report; whether anything changed (then the book was saved)."""
        before = self.replication
        holders: dict[int, set[tuple[int, int, int]]] = {}
        for node, held in self._held.items():
            if node in self._peers:
                for rank, copies in held.items():
                    holders.setdefault(rank, set()).update(copies)
        after = _replicated.advance(before, committed=(self.book.step, self.book.step_round),
                                    world=self.book.world_size, round_=self.book.round, placed=self._placed(),
                                    holders=holders, now=now,
                                    wait_s=self.settings.replica_wait_s)
        if after == before:
            return False
        self.replication = after
        if after.replicated != before.replicated:
            step, round_ = after.replicated
            await self.ctx.emit(CheckpointReplicated(step=step, round=round_, lag_s=round(now - before.since, 4)))
            log.debug("ckpt_replicated_everywhere", step=step, round=round_)
        if after.late and not before.late:
            log.warning("ckpt_replicas_late", step=before.replicating[0], waited_s=self.settings.replica_wait_s,
                        effect="the workers save on without waiting for replicas; a host lost before the next step "
                               "is replicated everywhere may cost a disk read",
                        hint="check the replica holders' logs (ckpt_replica_not_sent), or raise ckpt.replica_wait_s "
                             "when a state takes longer to copy between hosts")
        await self._save(self.book)
        return True

    def _placed(self) -> bool:
        """Whether every node of the newest round has replicas placed on another host (then commits wait for them)."""
        members, targets = self._placement
        return bool(members) and self.settings.replicas > 0 and all(targets.get(m.node_id) for m in members)

    def _known_committed(self, step: int, round_: int) -> bool:
        rep = self.replication
        return (step, round_) in (rep.replicated, rep.replicating, (self.book.step, self.book.step_round)) \
            or (step, round_) in self._commits

    async def publish_replicas(self, now: float) -> None:
        """Tell ``stead status`` the newest replicated step (R) and which node holds whose replica and the memory
        they take, when that changed (it names no newest commit: that changes with every commit, and the job's own
        line shows it)."""
        holders = sorted((n, p) for n, p in self._peers.items() if self._held.get(n))
        if not holders:
            return
        rep = self.replication
        replicated = (f"replicated: step {rep.replicated[0]} (every rank's copy in another host's memory: a lost "
                      "host restores it or a newer step from memory)" if rep.replicated[0] >= 0
                      else "replicated: no step yet in every rank's replica")
        if rep.waiting and not rep.keep and rep.replicated[0] >= 0:
            replicated += (f"; copies of step {rep.replicating[0]} are late and not waited for (more than "
                           f"ckpt.replica_wait_s={self.settings.replica_wait_s:g} s)")
        total = sum(p.held_bytes for _, p in holders)
        parts = [f"{n} (host {p.host}) holds rank{'s' if len(self._held[n]) > 1 else ''} "
                 f"{', '.join(str(r) for r in sorted(self._held[n]))} ({_mib(p.held_bytes)})" for n, p in holders[:8]]
        summary = [replicated, f"replicas: {_mib(total)} of other nodes' steps in memory: {'; '.join(parts)}"
                   + ("; ..." if len(holders) > 8 else "")]
        if summary == self._status:
            return
        self._status = summary
        await self.ctx.store.put(self.ctx.key("status"), json.dumps({"summary": summary, "at": now}).encode())

    def replica_sources(self, node_id: str, ranks: list[int]) -> list[tuple[str, str, int, int, int, int]]:
        """(holder, address, rank, step, round, world) of the replicas of ``ranks`` that other nodes than the caller
        hold, of a step the job committed (the newest, R, X or one of the last few: a replica of any other step is
        never handed out), newest first."""
        if self.book.step < 0:
            return []
        found = [(holder, self._peers[holder].address, rank, *copy) for rank in ranks
                 for holder, held in self._held.items() if holder != node_id and holder in self._peers
                 for copy in held.get(rank, ())]
        refused = [f for f in found if not self._known_committed(f[3], f[4])]
        if refused:
            log.warning("ckpt_replica_of_no_commit", holder=refused[0][0], rank=refused[0][2], step=refused[0][3],
                        round=refused[0][4], count=len(refused),
                        effect="never handed out for a restore: the job did not commit that step")
        found = [f for f in found if f not in refused]
        return sorted(found, key=lambda f: (f[2], -f[4], -f[3]))

    async def handle(self, *, record: Record, ctx: PluginContext[CheckpointSettings]) -> None:
        """A node that was lost or exited holds no replica any more: no replacement is sent to it for one."""
        event = record.event
        if isinstance(event, NodeLost | NodeExited):
            peer = self._peers.get(event.node_id)
            if peer is not None and peer.incarnation <= event.incarnation:
                del self._peers[event.node_id]
                self._held.pop(event.node_id, None)

    async def disk_report(self, *, step: int, world_size: int, ranks: list[int], path: str,
                          seconds: float | None = None) -> None:
        async with self._lock:
            book, complete = disk_report(self.book, step=step, world_size=world_size, ranks=ranks, seconds=seconds)
            if complete:
                await self.ctx.emit(CheckpointPersisted(step=step, path=path, world_size=world_size,
                                                        persist_s=book.disk_s.get(step)))
                await self._save(book)
                log.info("ckpt_persisted", step=step, path=path)
            self.book = book
        await self._notify()

    async def committed(self, *, round_: int, after_step: int, wait_s: float, ranks: list[int],
                        replicated: tuple[tuple[int, int], bool] | None = None) -> tuple[Book, dict[int, int]]:
        """The book and the releases of ``ranks``; waits up to ``wait_s`` for a commit after ``after_step``, a release,
        or (``replicated``: the caller's R and whether it keeps slots) another replicated step or keeping."""
        def ready() -> bool:
            book = self.book
            moved = replicated is not None and replicated != (self.replication.replicated, self.replication.keep)
            return (book.round == round_ and book.round_step > after_step) or bool(released(book, ranks)) or moved

        wait = min(max(wait_s, 0.0), self.settings.commit_poll_s)
        if wait > 0 and not ready():
            async with self._changed:
                try:
                    async with asyncio.timeout(wait):
                        await self._changed.wait_for(ready)
                except TimeoutError:
                    pass
        return self.book, released(self.book, ranks)

    def warning_step(self, round_: int) -> tuple[int, int]:
        """The step (and its round) a node of ``round_`` warned of the job's stop persists: the newest committed step
        when the round's first warned node asked, for every node that asks within :data:`WARNING_WINDOW_S`. Each node
        persisting the newest commit it knows of would write different steps when a commit lands between their
        asks (seen on the Slurm test cluster: steps 16, 16 and 17, none of them whole on disk); this one is in
        every rank's memory (committed) and the nodes ask within moments of each other, before it is overwritten."""
        now = time.monotonic()
        if self._warning is None or self._warning[0] != round_ or now - self._warning[3] > WARNING_WINDOW_S:
            self._warning = (round_, self.book.step, self.book.step_round, now)
            log.info("ckpt_warning_step", round=round_, step=self.book.step, step_round=self.book.step_round)
        return self._warning[1], self._warning[2]

    async def restored(self, *, round_: int, world_size: int, rank: int, step: int, tier: str,
                       parts: tuple[int, int, int] = (0, 0, 0)) -> None:
        reports = self._restored.setdefault(round_, {})
        reports[rank] = (step, tier)
        if tier == "reshard":
            self._reshard_parts.setdefault(round_, {})[rank] = parts
        for old in [r for r in self._restored if r < round_ - 1]:
            del self._restored[old]
            self._reshard_parts.pop(old, None)
        if len(reports) == world_size and all(r in reports for r in range(world_size)):
            del self._restored[round_]
            slots = self._reshard_parts.pop(round_, {})
            steps = {s for s, _ in reports.values()}
            await self.ctx.emit(CheckpointRestored(
                round=round_, step=min(steps), memory_ranks=sum(t == "memory" for _, t in reports.values()),
                disk_ranks=sum(t == "disk" for _, t in reports.values()),
                peer_ranks=sum(t == "peer" for _, t in reports.values()),
                resharded_ranks=sum(t == "reshard" for _, t in reports.values()),
                reshard_own_parts=sum(p[0] for p in slots.values()),
                reshard_peer_parts=sum(p[1] for p in slots.values()),
                reshard_remote_parts=sum(p[2] for p in slots.values()),
                replicated_step=self.replication.replicated[0], committed_step=self.book.step))
            if len(steps) > 1:
                log.error("ckpt_ranks_restored_different_steps", round=round_, steps=sorted(steps))

    async def corrupt(self, report: CheckpointCorrupt) -> None:
        """Record an agent's report of a corrupt copy (it arrives as the event it reports)."""
        log.warning("ckpt_corrupt", node=report.node_id, rank=report.rank, step=report.step, tier=report.tier,
                    detail=report.detail)
        await self.ctx.emit(report)

    async def _save(self, book: Book) -> None:
        rep = self.replication
        value = json.dumps({"step": book.step, "step_round": book.step_round, "persisted": book.persisted,
                            "replicated": list(rep.replicated), "replicating": list(rep.replicating),
                            "world": rep.world, "late": rep.late})
        await self.ctx.store.put(self.ctx.key("book"), value.encode())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


@dataclasses.dataclass(frozen=True)
class _Peer:
    incarnation: int
    host: str
    address: str
    round: int
    first_rank: int
    #: the memory the replicas it holds take
    held_bytes: int = 0


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _check_node(where: str, node_id: str) -> None:
    check_name(f"{where}.node_id", node_id, max_chars=MAX_NODE_ID_CHARS, what="the node's id (STEAD_NODE_ID)")


def _check_world(world_size: int, ranks: list[int]) -> None:
    if not 1 <= world_size <= _MAX_WORLD:
        invalid(f"world_size={world_size} must be between 1 and {_MAX_WORLD}")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        invalid(f"ranks {bad} are outside the world of {world_size}; report ranks 0..{world_size - 1}")


class CheckpointServicer(proto.CheckpointServiceBase):
    """CheckpointService backed by the plugin (every call authenticated by the RpcServer)."""

    def __init__(self, plugin: CheckpointPlugin) -> None:
        self._plugin = plugin

    async def report_saved(self, message: proto.ReportSavedRequest) -> proto.ReportSavedReply:
        where = "ReportSavedRequest"
        _check_node(where, message.node_id)
        ranks = [r.rank for r in message.ranks]
        _check_world(message.world_size, ranks)
        if message.tier not in TIERS:
            invalid(f"tier={message.tier!r} must be one of {TIERS}")
        if message.round < 0:
            invalid(f"round={message.round} must not be negative")
        # memory: the newest step a rank passed, -1 before its first save(); disk: the step it wrote
        first = -1 if message.tier == "memory" else 0
        for i, r in enumerate(message.ranks):
            at_least(f"{where}.ranks[{i}].step", r.step, first, f"a training step of the {message.tier} tier")
            for j, held in enumerate(r.held_steps):
                at_least(f"{where}.ranks[{i}].held_steps[{j}]", held, 0, "a training step")
            for step, seconds in r.seconds.items():
                finite_figure(f"{where}.ranks[{i}].seconds[{step}]", seconds, "duration in seconds")
        with backend_errors("CheckpointService.ReportSaved"):
            if message.tier == "disk":
                steps = {r.step for r in message.ranks}
                for step in steps:
                    wrote = [r for r in message.ranks if r.step == step]
                    await self._plugin.disk_report(
                        step=step, world_size=message.world_size, path=message.path, ranks=[r.rank for r in wrote],
                        seconds=max((r.seconds[step] for r in wrote if step in r.seconds), default=None))
                return proto.ReportSavedReply(committed_step=-1)
            holdings = {r.rank: Holding(passed=r.step, steps=frozenset(r.held_steps), seconds=dict(r.seconds))
                        for r in message.ranks}
            step, freed = await self._plugin.memory_report(round_=message.round, world_size=message.world_size,
                                                           ranks=holdings)
        targets = self._plugin.replica_report(
            node_id=message.node_id, incarnation=message.incarnation, round_=message.round, host=message.host,
            address=_replica_address(message.replica_address), ranks=ranks, held=_held(message),
            held_bytes=sum(max(0, r.bytes) for r in message.replicas))
        with backend_errors("CheckpointService.ReportSaved"):
            await self._plugin.advance_replication()
            await self._plugin.publish_replicas(time.time())
        released = [proto.RankStep(rank=r, step=s) for r, s in freed.items()]
        return proto.ReportSavedReply(committed_step=step, released=released,
                                      replica_targets=[proto.ReplicaPeer(node_id=n, address=a) for n, a in targets],
                                      replication=_replication(self._plugin.replication))

    async def get_committed(self, message: proto.GetCommittedRequest) -> proto.GetCommittedReply:
        where = "GetCommittedRequest"
        _check_node(where, message.node_id)
        finite_figure(f"{where}.wait_s", message.wait_s, "number of seconds")
        at_least(f"{where}.round", message.round, 0, "rendezvous rounds count from 0")
        at_least(f"{where}.after_step", message.after_step, -1, "a training step, or -1 for none")
        for i, rank in enumerate(message.ranks):
            at_least(f"{where}.ranks[{i}]", rank, 0, "ranks count from 0")
        for i, rank in enumerate(message.replica_ranks):
            at_least(f"{where}.replica_ranks[{i}]", rank, 0, "ranks count from 0")
        with backend_errors("CheckpointService.GetCommitted"):
            known = None
            if message.replicated_step is not None and message.replicated_round is not None:
                known = ((message.replicated_step, message.replicated_round), message.keep)
            book, freed = await self._plugin.committed(round_=message.round, after_step=message.after_step,
                                                       wait_s=message.wait_s, ranks=list(message.ranks),
                                                       replicated=known)
        sources = [proto.ReplicaPeer(node_id=n, address=a, rank=r, step=s, round=o, world=w)
                   for n, a, r, s, o, w in self._plugin.replica_sources(message.node_id, list(message.replica_ranks))]
        warning = self._plugin.warning_step(message.round) if message.warning else (-1, -1)
        return proto.GetCommittedReply(step=book.step, round=book.step_round,
                                       round_step=book.round_step if book.round == message.round else -1,
                                       persisted_step=book.persisted,
                                       released=[proto.RankStep(rank=r, step=s) for r, s in freed.items()],
                                       replica_sources=sources, replication=_replication(self._plugin.replication),
                                       warning_step=warning[0], warning_round=warning[1])

    async def report_restored(self, message: proto.ReportRestoredRequest) -> proto.Ack:
        where = "ReportRestoredRequest"
        _check_node(where, message.node_id)
        _check_world(message.world_size, [message.rank])
        if message.tier not in RESTORE_TIERS:
            invalid(f"tier={message.tier!r} must be one of {RESTORE_TIERS}")
        at_least(f"{where}.round", message.round, 0, "rendezvous rounds count from 0")
        at_least(f"{where}.step", message.step, -1, "a training step, or -1 when nothing was restored")
        for name in ("reshard_own", "reshard_peer", "reshard_remote"):
            count = getattr(message, name)
            if not 0 <= count <= _MAX_WORLD:
                invalid(f"{where}.{name}={count} must be between 0 and {_MAX_WORLD} (a count of old ranks' slots)")
        with backend_errors("CheckpointService.ReportRestored"):
            await self._plugin.restored(round_=message.round, world_size=message.world_size, rank=message.rank,
                                        step=message.step, tier=message.tier,
                                        parts=(message.reshard_own, message.reshard_peer, message.reshard_remote))
        return proto.Ack()

    async def report_corrupt(self, message: proto.ReportCorruptRequest) -> proto.Ack:
        where = "ReportCorruptRequest"
        _check_node(where, message.node_id)
        if message.tier not in (*TIERS, "peer"):
            invalid(f"tier={message.tier!r} must be one of {(*TIERS, 'peer')}")
        at_least(f"{where}.rank", message.rank, 0, "ranks count from 0")
        at_least(f"{where}.step", message.step, 0, "a training step")
        with backend_errors("CheckpointService.ReportCorrupt"):
            await self._plugin.corrupt(corrupt_from_proto(message))
        return proto.Ack()


def _replica_address(address: str) -> str:
    """A node's replica port as ``host:port``; refused as bad input when it is not one."""
    if not address:
        return ""
    host, colon, port = address.rpartition(":")
    if not colon or not host or len(address) > 300 or not port.isdigit() or not 0 < int(port) < 65536:
        invalid(f"replica_address={address[:80]!r} is not host:port; run every node with the same stead")
    return address


def _replication(rep: _replicated.Replication) -> proto.Replication:
    return proto.Replication(replicated_step=rep.replicated[0], replicated_round=rep.replicated[1],
                             replicating_step=rep.replicating[0], replicating_round=rep.replicating[1], keep=rep.keep)


def _held(message: proto.ReportSavedRequest) -> dict[int, tuple[tuple[int, int, int], ...]]:
    """The replicas a report says its node holds: rank -> (step, round, world) of each."""
    where = "ReportSavedRequest"
    if len(message.host) > 255:
        invalid(f"{where}.host is {len(message.host)} characters long, longer than any host name; run every node "
                "with the same stead")
    for i, r in enumerate(message.replicas):
        at_least(f"{where}.replicas[{i}].rank", r.rank, 0, "ranks count from 0")
        at_least(f"{where}.replicas[{i}].step", r.step, 0, "a training step")
        at_least(f"{where}.replicas[{i}].round", r.round, 0, "rendezvous rounds count from 0")
        at_least(f"{where}.replicas[{i}].world", r.world, r.rank + 1, "the world the rank saved it in")
    held: dict[int, tuple[tuple[int, int, int], ...]] = {}
    for r in message.replicas:
        held[r.rank] = (*held.get(r.rank, ()), (r.step, r.round, r.world))
        if len(held[r.rank]) > _MAX_HELD_PER_RANK:
            invalid(f"{where}.replicas names {len(held[r.rank])} replicas of rank {r.rank}; a node holds "
                    f"{_MAX_HELD_PER_RANK} at most (the newest, and the replicated step's): run every node with the "
                    "same stead")
    return held


def corrupt_from_proto(message: proto.ReportCorruptRequest) -> CheckpointCorrupt:
    """The event a ReportCorrupt call reports (the message and the event spell their fields the same way)."""
    return CheckpointCorrupt(node_id=message.node_id, rank=message.rank, step=message.step, tier=message.tier,
                             detail=message.detail)
