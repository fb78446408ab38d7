"""One node's flash checkpoints, run by the agent on an event loop thread of its own.

It owns the node's shared memory (control blocks and slot segments, per local
rank), serves the workers' checkpoint socket, reports saves to the master and
writes commits, releases and pins into the control blocks, checksums each saved
slot in the background, verifies the slot a restarting worker will restore, and
persists steps to disk (asked by a worker, or after a failure) without blocking
anything else: blocking work runs in worker threads.
"""

from __future__ import annotations

import functools
import json
import struct
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from stead.plugin import (
    Backoff,
    PermanentError,
    RetryableError,
    RoundInfo,
    RpcConnection,
    Settings,
    SteadError,
    client_tls,
    retrying,
)
from stead.plugins.ckpt import _disk
from stead.plugins.ckpt._client import CheckpointClient, Committed, Replicated, Saved
from stead.plugins.ckpt._diskwait import until_on_disk
from stead.plugins.ckpt._link import SOCKET_ENV
from stead.plugins.ckpt._memparts import node_parts
from stead.plugins.ckpt._peers import PeerReplicas
from stead.plugins.ckpt._rankmem import PersistJob, RankMemory
from stead.plugins.ckpt._replicas import OwnSlot, ReplicaMeta
from stead.plugins.ckpt._shm import (
    Control,
    SegmentNames,
    SlotInfo,
    VerifyState,
    create_segment,
    round_capacity,
)
from stead.plugins.ckpt.errors import CheckpointError, SharedMemoryTooSmall
from stead.plugins.ckpt.events import CheckpointCorrupt
from stead.plugins.ckpt.settings import CheckpointSettings

__all__ = ["NodeCheckpoints"]

log = structlog.get_logger("stead.plugins.ckpt")

_MAX_LINE = 1 << 20
_U64 = struct.Struct("<Q")


def _create(name: str, capacity: int, total: int) -> None:
    create_segment(name, capacity, reserve=total)


def _finish(root: Path, step: int, world: int, keep_last: int) -> bool:
    return _disk.finish_step(root, step, world, keep_last=keep_last)


async def _import_torch() -> None:
    """Import torch (seconds) in a thread now, not when the first persist after a failure needs it."""

    await anyio.to_thread.run_sync(_disk.load_dcp)


class NodeCheckpoints:
    """The agent side of flash checkpoints for one node (lives on the extension's own event loop)."""

    def __init__(self, *, settings: Settings, ckpt: CheckpointSettings, names: SegmentNames, node_id: str,
                 incarnation: int, master_address: str, token: str, root: Path, socket_path: Path,
                 job: str = "") -> None:
        self.settings = settings
        self.ckpt = ckpt
        self.names = names
        self.node_id = node_id
        self.incarnation = incarnation
        self.root = root
        self.socket_path = socket_path
        self._conn = RpcConnection(master_address, token, settings.rpc_timeout_s, tls=client_tls(settings))
        self._client = CheckpointClient(self._conn, node_id=node_id, incarnation=incarnation)
        self._ranks: dict[int, RankMemory] = {}
        self._round = 0
        #: (step, round) of the newest commit the master told us of, and of the one restarting workers restore
        self._committed: tuple[int, int] = (-1, -1)
        self.hint: tuple[int, int] = (-1, 0)
        self._gen = 0
        self._dirty = anyio.Event()
        self._pending_changed = anyio.Event()
        self._stopping = anyio.Event()
        self._persists: list[RankMemory] = []
        self._persist_wakeup = anyio.Event()
        self._persisting = False
        self._idle = anyio.Event()
        self._checksummer = anyio.Lock()
        self._master_refused = False
        self._tg: anyio.abc.TaskGroup | None = None
        self.peers = PeerReplicas(ckpt=ckpt, settings=settings, names=names, token=token, job=job or names.prefix,
                                  master_address=master_address, new_gen=self._new_gen)

    # -- lifecycle (on the node's loop) ---------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._conn.open()
        try:
            # (a replica taken is reported with the next report)
            await self.peers.start(lambda: self._dirty.set(), own=self._own_slot)
            async with await anyio.create_unix_listener(self.socket_path) as listener, \
                    anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(listener.serve, self._serve_worker, tg)
                tg.start_soon(self._report_loop)
                tg.start_soon(self._poll_loop)
                tg.start_soon(self._persist_loop)
                tg.start_soon(self.peers.send_loop, self._current, lambda: self._committed)
                task_status.started()
                await self._stopping.wait()
                with anyio.move_on_after(self.ckpt.persist_grace_s):
                    while self._persists or self._persisting:
                        self._idle = anyio.Event()
                        await self._idle.wait()
                if self._persists or self._persisting:
                    log.warning("ckpt_persist_abandoned", grace_s=self.ckpt.persist_grace_s)
                tg.cancel_scope.cancel()
        finally:
            self._tg = None
            self.peers.close()
            self._conn.close()
            for state in self._ranks.values():
                state.close()
            self._ranks.clear()  # the extension unlinks the segments

    async def shutdown(self) -> None:
        """Stop (the workers have stopped): persist the newest committed step first when ckpt.persist_on_stop."""
        if self.ckpt.persist_on_stop and not self._stopping.is_set():
            with anyio.move_on_after(self.settings.rpc_timeout_s):
                await self._report_now()  # what the workers saved last may commit a newer step
            self._persist_committed("stop", enabled=True)
        self._stopping.set()

    def env(self, local_rank: int) -> dict[str, str]:
        return {SOCKET_ENV: str(self.socket_path), "STEAD_CKPT_STEP": str(self.hint[0]),
                "STEAD_CKPT_ROUND": str(self.hint[1]), "STEAD_CKPT_PATH": str(self.root)}

    # -- agent hooks ---------------------------------------------------------------------------------

    async def before_round(self, info: RoundInfo) -> None:
        """Learn the committed step to restore; verify it in the background; persist it after a failure."""
        await self._report_now()  # what the stopped workers saved last, read from the control blocks
        try:
            reply = await retrying(lambda: self._client.get_committed(round_=info.round), self.settings,
                                   what="ckpt committed step")
        except SteadError as exc:
            log.warning("ckpt_committed_unknown", error=str(exc), effect="workers restore from disk")
            reply = Committed(step=-1)
        self._round = info.round
        self.hint = (reply.step, reply.round)
        if reply.step > self._committed[0] or reply.round > self._committed[1]:
            self._committed = (reply.step, reply.round)
        self._drop_pending_persists(info.round)
        from_peers = self.peers.enabled and self.hint[0] >= 0 and await self._from_peers(info)
        for state in self._ranks.values():
            state.passed = -1
            slot = state.slot_holding(*self.hint) if self.hint[0] >= 0 else None
            if slot is not None:
                state.control.set_verify(slot.index, slot.seq, VerifyState.RUNNING)
                self._spawn(self._verify, state, slot)
        if info.restart_count > 0 or info.round > 1:
            self._persist_committed("restart")
        if (self.hint[0] >= 0 and self.ckpt.persist_on_failure and not self._restorable_from_memory(info)
                and not from_peers and not self._reshardable_here(info)):
            await self._until_on_disk(self.hint[0])
        log.debug("ckpt_round", round=info.round, restore_step=self.hint[0], restore_round=self.hint[1])

    async def _from_peers(self, info: RoundInfo) -> bool:
        """Fetch from peers' replicas the step to restore of each local rank whose memory lacks it (a node new to
        the job, or one whose host was replaced): its workers then restore it from memory, reading no file. When
        the newest committed step's replica was not in place yet, the newest replica there is (the ranks restore
        the newest step every one of them has: the survivors keep it in their other slot). Whether every such rank
        got one (then nothing is waited for on disk)."""
        missing = {}
        for local_rank in range(info.nproc_per_node):
            state = self._ranks.get(local_rank)
            if state is None or state.slot_holding(*self.hint) is None:  # (held as another rank: a resize)
                missing[info.node_rank * info.nproc_per_node + local_rank] = local_rank
        if not missing:
            return False
        try:
            reply = await self._client.get_committed(round_=info.round, replica_ranks=sorted(missing))
        except SteadError as exc:
            log.warning("ckpt_replicas_unknown", error=str(exc), effect="the workers restore from disk")
            return False
        every = True
        for rank, local_rank in sorted(missing.items()):
            sources = [s for s in reply.sources if s.rank == rank]
            if not sources:
                log.info("ckpt_no_replica", rank=rank, step=self.hint[0],
                         effect="no peer holds one: the workers restore from disk")
                every = False
                continue
            if all(s.world != info.world_size for s in sources):
                log.info("ckpt_replica_of_another_world", rank=rank, step=self.hint[0], saved_world=sources[0].world,
                         world=info.world_size,
                         effect="the step is resharded: from memory where every old rank's slot is on a node of the "
                                "round (read over its replica port when not on this one), else from disk")
                every = False
                continue
            state = self._state(local_rank)

            async def unusable(step: int, detail: str, state: RankMemory = state, rank: int = rank) -> None:
                await self._report_corrupt(state, step, "peer", detail, rank=rank)

            usable = [s for s in sources if s.world == info.world_size]
            got = await self.peers.take(state, rank, info.world_size, usable, unusable)
            replicated = reply.replication.replicated if reply.replication is not None else (-1, -1)
            if got is not None and got != replicated and replicated[0] >= 0:
                # the replicated step too, into the other slot: when another rank's newest copy did not arrive,
                # the ranks restore that one, and every rank has it (the survivors keep its slot)
                await self.peers.take(state, rank, info.world_size,
                                      [s for s in usable if (s.step, s.round) == replicated], unusable)
            if got is None:
                log.info("ckpt_replicas_failed", rank=rank, step=self.hint[0], effect="restoring from disk")
                every = False
            elif got != self.hint:
                log.info("ckpt_replica_behind", rank=rank, step=got[0], committed=self.hint[0],
                         effect="the ranks restore the newest step every one of them holds")
        return every

    def _new_gen(self) -> int:
        self._gen += 1
        return self._gen

    def _drop_pending_persists(self, round_: int) -> None:
        """Give up the persists of an earlier round whose step was not committed when this round began. Their
        round's workers are gone, so the commit is unlikely to come (if a late report brings it, the new round
        restores that step from memory, not from this write). Kept, a pinned slot would stay pinned in every
        later round: the workers would find both slots taken (the restored step and the pinned one) and skip
        every save."""
        for state in self._ranks.values():
            job = state.persist
            if job is not None and not state.queued and not state.writing and self._stale(job, round_):
                self._dropped(state, job)

    def _stale(self, job: PersistJob, round_: int) -> bool:
        """Whether ``job`` waits for a commit that cannot come (its round ended with its step uncommitted)."""
        committed, committed_round = self._committed
        return job.round < round_ and not (committed_round == job.round and committed >= job.step)

    def _dropped(self, state: RankMemory, job: PersistJob) -> None:
        log.info("ckpt_persist_dropped", step=job.step, round=job.round, local_rank=state.local_rank,
                 reason="its round ended before every rank held the step")
        self._give_up(state, job)

    def _restorable_from_memory(self, info: RoundInfo) -> bool:
        """Whether every local rank of the new round holds the step to restore, saved as that same rank.

        Not after a resize (the ranks and the world size changed) nor on a node new to the job: its workers
        read the step from disk, so they must not start before the nodes that hold it have written it.
        """
        for local_rank in range(info.nproc_per_node):
            state = self._ranks.get(local_rank)
            slot = state.slot_holding(*self.hint) if state is not None else None
            if slot is None or (slot.rank, slot.world) != (info.node_rank * info.nproc_per_node + local_rank,
                                                          info.world_size):
                return False
        return True

    def _reshardable_here(self, info: RoundInfo) -> bool:
        """Whether this node holds a copy of every old rank's slot of the step to restore, saved by another world
        size: its workers reshard it from memory (:meth:`._recover.Restore.reshard_from_memory`) and read no file,
        so they need not wait for it on disk (when another node's workers cannot, they read it from disk, and that
        node waits for it)."""
        parts = self._parts(*self.hint)
        worlds = {int(p["meta"]["world"]) for p in parts}
        return len(worlds) == 1 and len(parts) == min(worlds) != info.world_size and all(p["sharded"] for p in parts)

    def _own_slot(self, rank: int, step: int, round_: int) -> OwnSlot | None:
        """The slot of a local rank holding old rank ``rank``'s ``step`` (of ``round_``), its checksums computed and
        not found corrupt: what the replica port serves to a reshard on another node (called in its threads)."""
        for state in list(self._ranks.values()):
            slot = state.slot_holding(step, round_)
            if slot is None or slot.rank != rank or slot.checks_seq != slot.seq or (
                    slot.verify_seq == slot.seq and slot.verify_state is VerifyState.CORRUPT):
                continue
            try:
                view = state.mapping(slot, self.names)
            except (CheckpointError, OSError):
                return None  # (its segment was replaced meanwhile: the slot no longer holds the step)
            return OwnSlot(meta=ReplicaMeta.of_slot(slot), view=view,
                           unchanged=functools.partial(_unchanged, state.control, slot.index, slot.seq))
        return None

    def _parts(self, step: int, round_: int) -> list[dict[str, Any]]:
        return node_parts(self._ranks.values(), self.names, self.peers.copies(step, round_), self.peers.fetched,
                          step=step, round_=round_)

    async def _until_on_disk(self, step: int) -> None:
        """:func:`._diskwait.until_on_disk` for this node (its own persists, the master's count of the parts)."""
        def mine_done() -> bool:
            return not self._persisting and all(s.persist is None for s in self._ranks.values())

        await until_on_disk(self.root, step, grace_s=self.ckpt.persist_grace_s, mine_done=mine_done,
                            persisted_elsewhere=self._persisted_elsewhere)

    async def _persisted_elsewhere(self, step: int) -> bool:
        """Whether the master counts every rank's part of ``step`` (or a newer step) as written."""
        try:
            reply = await self._client.get_committed(round_=self._round)
        except SteadError:
            return False  # not known: the wait goes on as it would without the master
        return reply.persisted_step >= step

    async def after_failure(self) -> None:
        """A worker failed: persist the newest committed step, if it is not on disk yet."""
        self._persist_committed("worker failure")

    async def warned(self, reason: str) -> int | None:
        """The node will be stopped soon: persist now, whatever ckpt.persist_on_failure says, the step the master
        names for the warning (the newest committed when the round's first warned node asked: the same on every
        node, so that one step ends up whole on disk), else the newest committed step this node knows of; the
        workers go on saving."""
        step: tuple[int, int] | None = None
        with anyio.move_on_after(self.settings.rpc_timeout_s):
            await self._report_now()  # what the workers saved last may commit a newer step
            try:
                reply = await self._client.get_committed(round_=self._round, warning=True)
            except SteadError as exc:
                log.warning("ckpt_warning_step_unknown", error=str(exc),
                            effect="this node persists the newest committed step it knows of")
            else:
                step = reply.warning if reply.warning[0] >= 0 else None
        if step is not None and not any(s.slot_holding(*step) for s in self._ranks.values()):
            log.warning("ckpt_warning_step_missed", step=step[0], round=step[1],
                        reason="no slot here holds it any more", effect="the newest committed step is persisted")
            step = None
        self._persist_committed(reason, enabled=True, at=step)
        persisted = (step or self._committed)[0]
        log.info("ckpt_persisting_on_warning", reason=reason, step=persisted)
        return persisted if persisted >= 0 else None

    # -- the workers' socket -------------------------------------------------------------------------

    async def _serve_worker(self, stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        state: RankMemory | None = None
        async with stream:
            while True:
                try:
                    line = await reader.receive_until(b"\n", _MAX_LINE)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError,
                        anyio.DelimiterNotFound):
                    return
                try:
                    message = json.loads(line)
                    if not isinstance(message, dict):
                        raise TypeError("not an object")
                    state, reply = await self._handle(state, message)
                except (ValueError, TypeError, KeyError, SteadError, OSError) as exc:
                    reply = {"ok": False, "error": str(exc) if isinstance(exc, SteadError) else
                             f"bad checkpoint request ({exc!r}); run the workers and the agent with the same stead"}
                    if isinstance(exc, SharedMemoryTooSmall):
                        reply["kind"] = "shm_too_small"
                    log.warning("ckpt_request_failed", error=reply["error"])
                if reply is not None and isinstance(message, dict) and "id" in message:
                    reply["id"] = message["id"]
                    try:
                        await stream.send((json.dumps(reply) + "\n").encode())
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        return

    async def _handle(self, state: RankMemory | None,
                      message: dict[str, Any]) -> tuple[RankMemory | None, dict[str, Any] | None]:
        op = message.get("op")
        if op == "hello":
            state = self._hello(message)
            return state, {"ok": True, "control": state.control.name,
                           "data_prefix": f"{self.names.prefix}i{self.incarnation}-r{state.local_rank}-"}
        if state is None:
            raise CheckpointError(f"{op!r} before 'hello': run the workers and the agent with the same stead")
        match op:
            case "reserve":
                await self._reserve(state, int(message["bytes"]), [int(i) for i in message["slots"]])
                return state, {"ok": True}
            case "saved":
                self._saved(state, int(message["slot"]), int(message["step"]), int(message["seq"]),
                            bool(message.get("persist")), _seconds(message.get("seconds")))
            case "skipped":
                state.passed = max(state.passed, int(message["step"]))
                self._dirty.set()
            case "restored":
                self._spawn(self._report_restored, state, int(message["step"]), str(message["tier"]),
                            (int(message.get("own", 0)), int(message.get("peer", 0)), int(message.get("remote", 0))))
            case "corrupt":
                self._spawn(self._report_corrupt, state, int(message["step"]), str(message["tier"]),
                            str(message.get("detail", "")))
            case "parts":
                return state, {"ok": True, "parts": self._parts(int(message["step"]), int(message["round"])),
                               "port": self.peers.access()}
            case "persisted":
                step = int(message["step"])
                with anyio.move_on_after(max(0.0, float(message.get("wait_s", 0.0)))):
                    while state.persisted < step and state.persist_failed < step:
                        await state.changed.wait()
                return state, {"ok": True, "step": state.persisted}
            case _:
                raise CheckpointError(f"unknown checkpoint request {op!r}; run the workers and the agent with the "
                                      "same stead version")
        return state, None

    def _hello(self, message: dict[str, Any]) -> RankMemory:
        local_rank = int(message["local_rank"])
        if not self._ranks:
            self._spawn(_import_torch)  # the job uses flash checkpoints: a persist will need torch soon
        state = self._state(local_rank)
        state.rank, state.world, state.round = int(message["rank"]), int(message["world"]), int(message["round"])
        state.passed = -1
        state.newest_saved = (-1, -1)
        return state

    def _state(self, local_rank: int) -> RankMemory:
        """What the agent keeps of ``local_rank``, its control block created on first use."""
        state = self._ranks.get(local_rank)
        if state is None:
            control = Control(self.names.control(local_rank), create=True, local_rank=local_rank)
            state = self._ranks[local_rank] = RankMemory(local_rank=local_rank, control=control)
        return state

    async def _reserve(self, state: RankMemory, nbytes: int, slots: list[int]) -> None:
        """Give ``slots`` at least ``nbytes`` each: a new segment (allocated, every page) for a smaller one."""
        control = state.control
        grow = []
        for index in slots:
            info = control.slot(index)
            if info.capacity >= nbytes:
                continue
            if len(slots) > 1 and info.complete:
                continue  # a size hint does not touch a slot that holds a step (a restore may need it)
            grow.append(index)
        capacity = round_capacity(nbytes)
        total = capacity * len(grow)
        for index in grow:
            gen = self._new_gen()
            name = self.names.data(state.local_rank, index, gen)
            await anyio.to_thread.run_sync(_create, name, capacity, total)
            total = 0
            state.use_segment(self.names, index, gen, capacity)
            log.debug("ckpt_slot_allocated", local_rank=state.local_rank, slot=index, bytes=capacity)

    def _saved(self, state: RankMemory, index: int, step: int, seq: int, persist: bool,
               seconds: float | None) -> None:
        state.passed = max(state.passed, step)
        state.newest_saved = (index, seq)
        if seconds is not None:
            state.save_s[step] = seconds
        if persist:
            self._want_persist(state, PersistJob(step=step, round=state.round, reason="requested"))
        self._spawn(self._checksum, state, index, seq)
        self._dirty.set()
        self._pending_changed.set()

    # -- commits ---------------------------------------------------------------------------------------

    def _current(self) -> list[RankMemory]:
        return [s for s in self._ranks.values() if s.rank >= 0 and s.world > 0 and s.round == self._round_of()]

    def _round_of(self) -> int:
        rounds = [s.round for s in self._ranks.values() if s.rank >= 0]
        return max(rounds, default=self._round)

    async def _report_now(self) -> None:
        """Report the current holdings of this node's ranks once (no retry)."""
        ranks = self._current()
        if not ranks or self._master_refused:
            return
        try:
            await self._send_report(ranks)
        except SteadError as exc:
            log.warning("ckpt_report_failed", error=str(exc))

    async def _send_report(self, ranks: list[RankMemory]) -> None:
        report = {}
        for state in ranks:
            held = state.held()
            state.passed = max(state.passed, *held, -1)
            state.save_s = {step: s for step, s in state.save_s.items() if step in held}
            report[state.rank] = Saved(step=state.passed, held=held, seconds=state.save_s)
        round_ = ranks[0].round
        reply = await self._client.report_saved(round_=round_, world_size=ranks[0].world, tier="memory",
                                                ranks=report, host=self.peers.host,
                                                replica_address=self.peers.address, replicas=self.peers.held())
        self.peers.set_targets(reply.targets)
        self._apply(reply, round_)

    async def _report_loop(self) -> None:
        backoff = Backoff(self.settings)
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            ranks = self._current()
            if not ranks or self._master_refused:
                continue
            try:
                await self._send_report(ranks)
            except RetryableError as exc:
                log.warning("ckpt_report_failed", error=str(exc), action=f"retrying in {backoff.delay:g} s")
                self._dirty.set()
                await backoff.wait()
                continue
            except PermanentError as exc:
                self._refused(exc)
                continue
            backoff.reset()

    async def _poll_loop(self) -> None:
        """While a local rank waits for its newest save to be committed, long-poll the master."""
        backoff = Backoff(self.settings)
        while True:
            ranks = self._current()
            pending = [s for s in ranks if self._pending(s)]
            if not pending or self._master_refused:
                self._pending_changed = anyio.Event()
                await self._pending_changed.wait()
                continue
            round_ = pending[0].round
            after = self._committed[0] if self._committed[1] == round_ else -1
            known = self.peers.replicated
            try:
                reply = await self._client.get_committed(round_=round_, after_step=after,
                                                         wait_s=self.ckpt.commit_poll_s,
                                                         ranks=[s.rank for s in pending],
                                                         replicated=known)
            except RetryableError as exc:
                log.warning("ckpt_poll_failed", error=str(exc), action=f"retrying in {backoff.delay:g} s")
                await backoff.wait()
                continue
            except PermanentError as exc:
                self._refused(exc)
                continue
            backoff.reset()
            self._apply(reply, round_)

    def _pending(self, state: RankMemory) -> bool:
        """Whether the rank waits for its newest save's commit or release, or for the step its slots keep for
        replicas to be replicated (its next save waits for it)."""
        known = self.peers.replicated
        if known is not None and known.replicating != known.replicated \
                and state.slot_holding(*known.replicating) is not None:
            return True
        held = state.held()
        if not held:
            return False
        newest = max(held)
        committed, committed_round = self._committed
        if committed_round == state.round and committed >= newest:
            return False
        released, released_round = state.control.released
        return not (released_round == state.round and released == newest)

    def _refused(self, exc: PermanentError) -> None:
        if not self._master_refused:
            log.error("ckpt_master_refused", error=str(exc),
                      effect="no step is committed: saves are skipped; enable the master's ckpt plugin")
        self._master_refused = True

    def _apply(self, reply: Committed, round_: int) -> None:
        if reply.replication is not None:
            self._keep(reply.replication)  # first: a worker sees a commit only once the slots to keep are marked
        if reply.round_step >= 0 and (round_ > self._committed[1] or reply.round_step > self._committed[0]):
            self._committed = (reply.round_step, round_)
            for state in self._ranks.values():
                if state.round == round_:
                    state.control.set_committed(reply.round_step, round_)
            self.peers.committed(reply.round_step, round_)
        for state in self._ranks.values():
            if state.round == round_ and state.rank in reply.released:
                state.control.set_released(reply.released[state.rank], round_)
        self._check_persists()

    def _keep(self, replication: Replicated) -> None:
        """Mark the replicated and replicating steps' slots as kept (when the master says to keep them) and tell
        the replica holder and sender which steps those are."""
        none = (-1, -1)
        kept = (replication.replicated, replication.replicating) if replication.keep else (none, none)
        for state in self._ranks.values():
            if state.control.kept != kept:
                with state.control.locked():
                    state.control.set_kept(*kept)
        if replication != self.peers.replicated:
            self.peers.replication(replication)
            self._pending_changed.set()  # a step whose replicas are awaited: the poll watches for them
            for state in self._ranks.values():  # X is sent once its checksums are known: skipped if a newer save came
                slot = state.slot_holding(*replication.replicating)
                if slot is not None and slot.checks_seq != slot.seq \
                        and (slot.index, slot.seq) not in state.checksumming:
                    self._spawn(self._checksum, state, slot.index, slot.seq)

    # -- checksums and verification ------------------------------------------------------------------

    def _spawn(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` in the node's task group; a failure is logged, never fatal to the node."""

        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:
                log.exception("ckpt_task_failed", task=getattr(fn, "__name__", repr(fn)))

        if self._tg is not None:
            self._tg.start_soon(guarded)

    async def _checksum(self, state: RankMemory, index: int, seq: int) -> None:
        """Compute the slot's per-tensor checksums off the training thread and publish them."""
        done = state.checksumming.setdefault((index, seq), anyio.Event())
        try:
            async with self._checksummer:  # one at a time: they read gigabytes
                info = state.control.slot(index)
                replicating = self.peers.replicated.replicating if self.peers.replicated is not None else (-1, -1)
                if info.seq != seq or not info.complete or (state.newest_saved != (index, seq)
                                                            and not info.holds(*replicating)):
                    return  # rewritten, or a newer save is waiting for its checksums (X's are wanted anyway)
                _, sums = await anyio.to_thread.run_sync(state.sums, info, self.names)
            view = state.mapping(info, self.names)
            with state.control.locked():
                if state.control.slot(index).seq != seq:
                    return  # rewritten meanwhile: these sums describe nothing
                for i, value in enumerate(sums):
                    _U64.pack_into(view, info.checks_off + 8 * i, value)
                state.control.set_checks_seq(index, seq)
            self.peers.wake()  # a committed step waits for its checksums before it is sent to peers
        except (CheckpointError, OSError, ValueError) as exc:
            log.warning("ckpt_checksum_failed", local_rank=state.local_rank, error=str(exc))
        finally:
            done.set()
            state.checksumming.pop((index, seq), None)

    async def _verify(self, state: RankMemory, info: SlotInfo) -> None:
        """Check the slot a restarting worker will restore against its checksums; tell the worker the result."""
        running = state.checksumming.get((info.index, info.seq))
        if running is not None:
            await running.wait()
        result = VerifyState.UNCHECKED
        detail = ""
        try:
            current = state.control.slot(info.index)
            if current.checks_seq == info.seq:
                _, sums = await anyio.to_thread.run_sync(state.sums, current, self.names)
                view = state.mapping(current, self.names)
                stored = [_U64.unpack_from(view, current.checks_off + 8 * i)[0] for i in range(len(sums))]
                bad = sum(1 for a, b in zip(sums, stored, strict=True) if a != b)
                result = VerifyState.OK if not bad else VerifyState.CORRUPT
                detail = f"{bad} of {len(sums)} tensors fail their checksums"
        except CheckpointError as exc:
            result, detail = VerifyState.CORRUPT, str(exc)
        except (OSError, ValueError) as exc:
            result, detail = VerifyState.CORRUPT, f"cannot read the slot: {exc}"
        state.control.set_verify(info.index, info.seq, result)
        if result is VerifyState.CORRUPT:
            log.warning("ckpt_memory_corrupt", local_rank=state.local_rank, step=info.step, detail=detail)
            await self._report_corrupt(state, info.step, "memory", detail, rank=info.rank)

    # -- persistence ---------------------------------------------------------------------------------

    def _persist_committed(self, reason: str, *, enabled: bool | None = None,
                           at: tuple[int, int] | None = None) -> None:
        """Write the newest committed step to disk (``at``: that step instead), unless it is there already."""
        step, round_ = at or (self._committed if self._committed[0] >= 0 else self.hint)
        if step < 0 or not (self.ckpt.persist_on_failure if enabled is None else enabled):
            return
        for state in self._ranks.values():
            slot = state.slot_holding(step, round_)
            if slot is None or self._on_disk(step, slot.rank):
                continue
            if state.persist is not None and state.persist.step >= step:
                continue  # a newer step is about to be written anyway
            self._want_persist(state, PersistJob(step=step, round=round_, reason=reason))

    def _on_disk(self, step: int, rank: int) -> bool:
        return _disk.is_complete(self.root, step) or (_disk.step_dir(self.root, step) / f"rank_{rank}.json").exists()

    def _want_persist(self, state: RankMemory, job: PersistJob) -> None:
        """Pin the slot holding the step (no save overwrites it); it is written once committed."""
        if state.writing:
            state.deferred = job  # one slot is pinned at a time: this one once the write in progress ends
            return
        if self._stale(job, self._round):
            self._dropped(state, job)
            return
        control = state.control
        with control.locked():
            slot = state.slot_holding(job.step, job.round)
            if slot is None:
                log.warning("ckpt_persist_missed", step=job.step, local_rank=state.local_rank,
                            reason="the slot was overwritten before it could be pinned")
                self._give_up(state, job)
                return
            control.set_pinned(job.step, job.round)
        state.persist = job
        self._check_persists()

    def _check_persists(self) -> None:
        for state in self._ranks.values():
            job = state.persist
            if job is None or state.queued:
                continue
            committed, committed_round = self._committed
            released, released_round = state.control.released
            if committed_round == job.round and committed >= job.step:
                state.queued = True
                self._persists.append(state)
                self._persist_wakeup.set()
            elif released_round == job.round and released == job.step:
                self._give_up(state, job)

    @staticmethod
    def _give_up(state: RankMemory, job: PersistJob) -> None:
        """``job`` will not be written: its slot is unpinned and whoever waits for it told."""
        if state.persist is job:
            state.persist = None
        if state.control.pinned == (job.step, job.round):
            state.control.set_pinned(-1, -1)
        state.persist_failed = max(state.persist_failed, job.step)
        state.notify()

    async def _persist_loop(self) -> None:
        while True:
            if not self._persists:
                self._persist_wakeup = anyio.Event()
                await self._persist_wakeup.wait()
                continue
            batch, self._persists = self._persists, []
            self._persisting = True
            written: dict[int, list[tuple[RankMemory, float]]] = {}
            try:
                for state in batch:
                    state.writing = True
                for state in batch:
                    job = state.persist
                    started = time.perf_counter()
                    if job is not None and await self._persist_one(state, job):
                        written.setdefault(job.step, []).append((state, time.perf_counter() - started))
                for step, wrote in written.items():
                    world = wrote[0][0].world
                    try:
                        complete = await anyio.to_thread.run_sync(_finish, self.root, step, world,
                                                                  self.ckpt.keep_last)
                    except Exception as exc:  # a full disk, a read-only directory: later steps are still written
                        self._not_completed(step, [state for state, _ in wrote], exc)
                        continue
                    if complete:
                        log.info("ckpt_step_on_disk", step=step, path=str(_disk.step_dir(self.root, step)))
                    for state, _ in wrote:
                        state.persisted = max(state.persisted, step)
                        state.notify()
                    await self._report_disk(step, {state.rank: seconds for state, seconds in wrote}, world)
            finally:
                for state in batch:
                    state.writing = state.queued = False
                    deferred, state.deferred = state.deferred, None
                    if deferred is not None:
                        self._want_persist(state, deferred)
                self._persisting = False
                self._idle.set()

    def _not_completed(self, step: int, states: list[RankMemory], exc: Exception) -> None:
        """Completing ``step`` on disk failed (its ``.metadata``, the tracker): it is not persisted, and whoever
        waits for it is told so."""
        log.error("ckpt_persist_failed", step=step, ranks=sorted(s.rank for s in states), error=str(exc) or repr(exc),
                  effect="the step is not persisted (no .metadata, not in the tracker); later steps still are",
                  hint=f"check that {self.root} is writable and has room", exc_info=not isinstance(exc, OSError))
        for state in states:
            state.persist_failed = max(state.persist_failed, step)
            state.notify()

    async def _persist_one(self, state: RankMemory, job: PersistJob) -> bool:
        control = state.control
        try:
            info = state.slot_holding(job.step, job.round)
            if info is None:
                raise CheckpointError(f"step {job.step} is no longer in memory")
            copy_first = self.ckpt.persist_copy and _room_for_copy(info.capacity)

            def unpin() -> None:  # the step is copied out: the workers may save into its slot while it is written
                if control.pinned == (job.step, job.round):
                    control.set_pinned(-1, -1)

            if not self._on_disk(job.step, info.rank):
                await anyio.to_thread.run_sync(functools.partial(state.write_to_disk, info, self.names, self.root,
                                                                 copied=unpin if copy_first else None))
                if not copy_first and control.slot(info.index).seq != info.seq:
                    raise CheckpointError("the slot changed while it was being written (it was not pinned)")
            log.info("ckpt_persisted_rank", step=job.step, rank=info.rank, reason=job.reason)
            return True
        except CheckpointError as exc:
            state.persist_failed = max(state.persist_failed, job.step)
            log.warning("ckpt_persist_failed", step=job.step, local_rank=state.local_rank, error=str(exc))
            if "checksum" in str(exc):
                await self._report_corrupt(state, job.step, "memory", str(exc))
            return False
        except OSError as exc:
            state.persist_failed = max(state.persist_failed, job.step)
            log.error("ckpt_persist_failed", step=job.step, local_rank=state.local_rank, error=str(exc),
                      hint=f"check that {self.root} is writable and has room")
            return False
        except Exception:
            state.persist_failed = max(state.persist_failed, job.step)
            log.exception("ckpt_persist_failed", step=job.step, local_rank=state.local_rank)
            return False
        finally:
            if state.persist is job:
                state.persist = None
            if control.pinned == (job.step, job.round):
                control.set_pinned(-1, -1)
            state.notify()

    # -- reports to the master -----------------------------------------------------------------------

    async def _report_disk(self, step: int, ranks: dict[int, float], world: int) -> None:
        """Tell the master that ``ranks`` wrote ``step`` (rank -> seconds the write took)."""
        try:
            await self._client.report_saved(round_=self._round_of(), world_size=world, tier="disk",
                                            ranks={r: Saved(step=step, seconds={step: s}) for r, s in ranks.items()},
                                            path=str(_disk.step_dir(self.root, step)))
        except SteadError as exc:
            log.warning("ckpt_report_failed", what="disk", step=step, error=str(exc))

    async def _report_restored(self, state: RankMemory, step: int, tier: str, parts: tuple[int, int, int]) -> None:
        """Tell the master where the rank restored ``step`` from (``parts``: for a reshard from memory, how many of
        the old ranks' slots were own slots, peers' replicas held here, and slots read from other nodes)."""
        if tier == "memory" and step in self.peers.fetched.get(state.local_rank, ()):
            tier = "peer"  # its slot was given the step from another host's replica
        try:
            await self._client.report_restored(round_=state.round, world_size=state.world, rank=state.rank,
                                               step=step, tier=tier, parts=parts)
        except SteadError as exc:
            log.warning("ckpt_report_failed", what="restored", error=str(exc))

    async def _report_corrupt(self, state: RankMemory, step: int, tier: str, detail: str, *, rank: int = -1) -> None:
        try:
            await self._client.report_corrupt(CheckpointCorrupt(
                node_id=self._client.node_id, rank=rank if rank >= 0 else state.rank, step=step, tier=tier,
                detail=detail))
        except SteadError as exc:
            log.warning("ckpt_report_failed", what="corrupt", error=str(exc))


def _unchanged(control: Control, index: int, seq: int) -> bool:
    """Whether slot ``index`` still holds what it held at ``seq`` (no save went into it since)."""
    return control.slot(index).seq == seq


def _seconds(value: object) -> float | None:
    """A worker's reported duration, or None when it sent none (an older worker) or nonsense."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0.0 <= value < float("inf") else None


def _room_for_copy(nbytes: int) -> bool:
    """Whether the host has room for a persist's copy of a slot: twice its size free, so the copy never pushes the
    host towards swapping or the OOM killer (the slot then stays pinned for the write, as without a copy)."""
    import psutil

    return psutil.virtual_memory().available > 2 * nbytes
