"""One node's side of peer replicas: its replica port, the copies of its ranks' committed steps sent to other hosts,
and the replicas a node that replaces a lost one fetches into its own slots before its workers start.

The master places the replicas (:mod:`._placement`) and answers each memory report with the nodes this node sends
to and the committed step every node copies now (X, :mod:`._replicated`; the newest commit when the master does not
say); a node's agent sends each local rank's slot of it there once its checksums are computed, in a thread of its
own (never the training thread). While the worker keeps the slot (the master's X or R: no save goes into it) it is
sent straight from the worker's memory; otherwise it is copied into a buffer of the agent's by a thread ahead of the
send, piece by piece, the send following it (a memory copy, done long before the transfer is: a copy a newer save
tore meanwhile is never sent whole). Either way the slot's sequence number, read again once it was read, tells the
holder whether the bytes are the slot as saved. The holders check each tensor's hash as it arrives, keep the copy of
the replicated step (R) while a newer one arrives, and serve either. A node new to the round (a spare, a relaunched
node) whose ranks' committed step is not in its memory asks the master who holds replicas of it, fetches each into
one of its own slots, verified by hash, and marks the slot as holding the step: its workers then restore it as they
restore their own memory, with no disk read.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np
import structlog

from stead.plugin import (
    HOST_ENV,
    Settings,
    client_context,
    interface_toward,
    server_context,
    tls_files,
)
from stead.plugins.ckpt._client import PeerCopy, Replicated
from stead.plugins.ckpt._rankmem import RankMemory
from stead.plugins.ckpt._replicas import (
    Held,
    OwnSlots,
    ReplicaError,
    ReplicaMeta,
    ReplicaServer,
    fetch,
    push,
    wire_order,
)
from stead.plugins.ckpt._shm import (
    SegmentNames,
    SlotInfo,
    VerifyState,
    create_segment,
    round_capacity,
)
from stead.plugins.ckpt.errors import CheckpointError
from stead.plugins.ckpt.settings import CheckpointSettings

__all__ = ["PeerReplicas"]

log = structlog.get_logger("stead.plugins.ckpt")


@dataclasses.dataclass
class _Sent:
    step: int
    round: int


class PeerReplicas:
    """The replicas of one node (lives on the checkpoint's event loop; transfers run in threads)."""

    def __init__(self, *, ckpt: CheckpointSettings, settings: Settings, names: SegmentNames, token: str, job: str,
                 master_address: str, new_gen: Callable[[], int]) -> None:
        #: the next generation of a slot segment's name (shared with the node's own allocations)
        self.new_gen = new_gen
        self.enabled = ckpt.replicas > 0
        self.ckpt, self.settings, self.names, self.token, self.job = ckpt, settings, names, token, job
        self.master_address = master_address
        self.host = os.environ.get(HOST_ENV) or socket.gethostname()
        self.address = ""
        self.targets: tuple[PeerCopy, ...] = ()
        #: local rank -> the steps its slots were given from peers' replicas (its restore's tier is "peer")
        self.fetched: dict[int, set[int]] = {}
        #: what the master last said of replication (None: nothing, or a master that does not say)
        self.replicated: Replicated | None = None
        self._server: ReplicaServer | None = None
        self._client_tls: ssl.SSLContext | None = None
        self._sent: dict[tuple[str, int], _Sent] = {}
        self._said: set[str] = set()
        self._wake = anyio.Event()
        self._committed_at: dict[tuple[int, int], float] = {}
        #: local rank -> the buffer its slot is copied into before it is sent
        self._buffers: dict[int, bytearray] = {}

    async def start(self, changed: Callable[[], None], own: OwnSlots | None = None) -> None:
        """Open the replica port on the address that reaches the master (``changed``: a replica was taken; ``own``:
        the node's own slots, served to reshards on other nodes)."""
        if not self.enabled:
            return
        files = tls_files(self.settings)
        server_tls = server_context(files) if files is not None else None
        self._client_tls = client_context(files) if files is not None else None
        host, _, port = self.master_address.rpartition(":")
        found = interface_toward(host.strip("[]"), int(port)) if port.isdigit() else None
        bind = found[1] if found is not None else "127.0.0.1"
        loop = anyio.lowlevel.current_token()

        def taken() -> None:
            anyio.from_thread.run_sync(changed, token=loop)

        self._server = ReplicaServer(names=self.names, token=self.token, job=self.job, tls=server_tls,
                                     max_bytes=self.ckpt.replica_max_bytes, timeout_s=self._timeout_s, changed=taken,
                                     own=own)
        self.address = await anyio.to_thread.run_sync(self._server.start, bind)
        log.debug("ckpt_replica_port", address=self.address, host=self.host)

    def access(self) -> dict[str, Any]:
        """What this node's workers need to read other nodes' slots over their replica ports (:mod:`._remoteparts`),
        sent to them over the agent's local socket: this port's address, the job's token and name, the TLS files."""
        tls = {name: str(getattr(self.settings, name)) for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")
               if getattr(self.settings, name)}
        return {"address": self.address, "token": self.token, "job": self.job, "tls": tls or None,
                "timeout_s": self._timeout_s}

    @property
    def _timeout_s(self) -> float:
        return max(self.settings.rpc_timeout_s, 5.0)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def copies(self, step: int, round_: int) -> list[Held]:
        """The replicas this node holds of ``step`` saved in ``round_`` (:meth:`ReplicaServer.copies`)."""
        return self._server.copies(step, round_) if self._server is not None else []

    def held(self) -> list[tuple[int, int, int, int, int]]:
        """(rank, world, step, round, bytes) of each replica this node holds for others."""
        if self._server is None:
            return []
        return [(m.rank, m.world, m.step, m.round, capacity) for m, capacity in self._server.holdings()]

    # -- sending ---------------------------------------------------------------------------------------

    def set_targets(self, targets: tuple[PeerCopy, ...] | None) -> None:
        if targets is None or targets == self.targets:
            return
        self.targets = targets
        self.wake()

    def replication(self, replicated: Replicated) -> None:
        """The master's word on replication: send its X, and keep R's copies held here (while it asks to keep)."""
        if replicated == self.replicated:
            return
        self.replicated = replicated
        if self._server is not None:
            self._server.keep(replicated.replicated if replicated.keep else (-1, -1))
        self.wake()

    def _to_send(self, committed: tuple[int, int]) -> tuple[int, int]:
        """The step to send: the master's X, else (a master that does not say) the newest commit."""
        return self.replicated.replicating if self.replicated is not None else committed

    def committed(self, step: int, round_: int) -> None:
        self._committed_at.setdefault((step, round_), time.monotonic())
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    async def send_loop(self, ranks: Callable[[], Sequence[RankMemory]], committed: Callable[[], tuple[int, int]]
                        ) -> None:
        """Send each local rank's slot of X (:meth:`_to_send`) to the targets that lack it, as commits come."""
        if not self.enabled:
            return
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            step, round_ = self._to_send(committed())
            if step < 0 or not self.targets:
                continue
            done, sent_bytes, sending_s = True, 0, 0.0
            for state in ranks():
                slot = state.slot_holding(step, round_)
                if slot is None:
                    continue  # not saved here (a newer save took the slot: the newer commit follows)
                if slot.checks_seq != slot.seq:
                    done = False  # its checksums are not computed yet (that wakes us again)
                    continue
                for target in self.targets:
                    sent = self._sent.get((target.address, slot.rank))
                    if sent is not None and (sent.round, sent.step) >= (round_, step):
                        continue
                    began = time.monotonic()
                    ok = await anyio.to_thread.run_sync(self._push, state, slot, target)
                    if ok:
                        self._sent[target.address, slot.rank] = _Sent(step=step, round=round_)
                        sent_bytes += slot.layout_off + slot.layout_len
                        sending_s += time.monotonic() - began
                    done = done and ok
            if not done:
                continue
            started = self._committed_at.pop((step, round_), None)
            self._committed_at = {(s, r): t for (s, r), t in self._committed_at.items() if (r, s) > (round_, step)}
            if started is not None:  # (bench/replicas.py reads the lag and the bandwidth from these lines)
                log.debug("ckpt_replicated", step=step, round=round_, lag_s=round(time.monotonic() - started, 4),
                          bytes=sent_bytes, sending_s=round(sending_s, 4), targets=[t.node_id for t in self.targets])

    def _push(self, state: RankMemory, slot: SlotInfo, target: PeerCopy) -> bool:
        """Send ``slot``: straight from it while the worker keeps it, else from a copy taken as it is sent (the
        worker may save into the slot again while it travels)."""
        meta = ReplicaMeta.of_slot(slot)
        kept = slot.round == state.round and any(slot.holds(*pair) for pair in state.control.kept)
        copy = None if kept else _CopyAhead(state, slot, self.names, self._buffer(state.local_rank, meta.nbytes))
        memory = memoryview(state.mapping(slot, self.names) if copy is None else copy.buffer)
        try:
            push(target.address, token=self.token, job=self.job, tls=self._client_tls, meta=meta, source=memory,
                 intact=(lambda: state.control.slot(slot.index).seq == slot.seq) if copy is None else copy.intact,
                 ready=None if copy is None else copy.ready, timeout_s=self._timeout_s)
        except ReplicaError as exc:
            if state.control.slot(slot.index).seq != slot.seq:
                log.debug("ckpt_replica_skipped", step=slot.step, rank=slot.rank,
                          reason="a newer save rewrote the slot while it was read; the next commit is sent")
            else:
                self._say(target.address, "ckpt_replica_not_sent", str(exc), step=slot.step, rank=slot.rank,
                          node=target.node_id)
            return False
        finally:
            if copy is not None:
                copy.close()
            memory.release()
        return True

    def _buffer(self, local_rank: int, nbytes: int) -> bytearray:
        """This rank's send buffer, of ``nbytes`` at least (kept for the next step's copy)."""
        buffer = self._buffers.get(local_rank)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._buffers[local_rank] = bytearray(round_capacity(nbytes))
        return buffer

    def _say(self, key: str, what: str, error: str, **fields: object) -> None:
        """Warn once per peer and kind of trouble, then only at debug level (a peer that stays away is not news)."""
        said = f"{key}|{error.split(':', 1)[0]}"
        if said in self._said:
            log.debug(what, error=error, **fields)
            return
        self._said.add(said)
        log.warning(what, error=error, **fields, effect="that replica is not in place; the step stays restorable "
                                                        "from this node's memory and from disk")

    # -- fetching ----------------------------------------------------------------------------------------

    async def take(self, state: RankMemory, rank: int, world: int, sources: Sequence[PeerCopy],
                   unusable: Callable[[int, str], Awaitable[None]]) -> tuple[int, int] | None:
        """Fetch ``rank``'s replica (saved in a world of ``world`` ranks) from the first of ``sources`` (newest
        first) that serves it whole and verified, into a slot of ``state`` (a local rank whose workers have not
        started), and note its step as committed there; (step, round) of the one taken, None when none was.
        ``unusable(step, detail)`` reports each replica that failed its checks or could not be fetched."""
        for source in sources:
            step, round_ = source.step, source.round
            started = time.monotonic()
            try:
                meta = await anyio.to_thread.run_sync(self._fetch_into, state, source, rank, world, step, round_)
            except (ReplicaError, OSError) as exc:
                log.warning("ckpt_replica_unusable", rank=rank, step=step, holder=source.node_id, error=str(exc),
                            effect="the next holder is tried, then disk")
                await unusable(step, f"the replica held by {source.node_id} ({source.address}): {exc}")
                continue
            state.control.note_committed(step, round_)  # only committed steps are replicated
            self.fetched.setdefault(state.local_rank, set()).add(step)
            log.info("ckpt_replica_fetched", rank=rank, step=step, holder=source.node_id, bytes=meta.nbytes,
                     seconds=round(time.monotonic() - started, 4))
            return step, round_
        return None

    def _fetch_into(self, state: RankMemory, source: PeerCopy, rank: int, world: int, step: int,
                    round_: int) -> ReplicaMeta:
        control = state.control
        index = min(control.slots(), key=lambda s: (s.complete, s.step)).index  # an empty slot, else the oldest
        seq = control.begin_write(index)
        target: list[memoryview] = []

        def into(meta: ReplicaMeta) -> memoryview:
            if meta.world != world:
                raise ReplicaError(f"the holder sent a copy saved by a world of {meta.world} ranks for one of {world}")
            info = control.slot(index)
            if info.capacity < meta.nbytes:
                self._regrow(state, index, round_capacity(meta.nbytes))
                info = control.slot(index)
            target.append(memoryview(state.mapping(info, self.names)))
            return target[0]

        try:
            meta = fetch(source.address, token=self.token, job=self.job, tls=self._client_tls, rank=rank, step=step,
                         round_=round_, into=into, timeout_s=self._timeout_s)
        except BaseException:
            control.abandon_write(index)
            raise
        finally:
            for view in target:
                view.release()
        even = control.end_write(index, seq=seq, step=meta.step, round_=meta.round, rank=meta.rank, world=meta.world,
                                 data_bytes=meta.data_bytes, n_tensors=meta.n_tensors, checks_off=meta.checks_off,
                                 layout_off=meta.layout_off, layout_len=meta.layout_len, layout_sum=meta.layout_sum)
        control.set_checks_seq(index, even)
        control.set_verify(index, even, VerifyState.OK)  # every tensor was checked against its checksum on arrival
        return meta

    def _regrow(self, state: RankMemory, index: int, capacity: int) -> None:
        """Give slot ``index`` a segment of ``capacity`` bytes (the node's workers have not mapped it yet)."""
        gen = self.new_gen()
        create_segment(self.names.data(state.local_rank, index, gen), capacity)
        state.use_segment(self.names, index, gen, capacity)


class _Rewritten(ReplicaError):
    """The slot was rewritten while it was copied: the copy is not sent whole."""


class _CopyAhead:
    """A slot copied into a send buffer by a thread of its own, piece by piece in :func:`wire_order`, ahead of the
    send that follows it (:meth:`ready`): the copy runs at memory speed, so the transfer starts at once and a save
    into the slot can tear the copy only while the copy runs, not while the slower transfer does."""

    def __init__(self, state: RankMemory, slot: SlotInfo, names: SegmentNames, buffer: bytearray) -> None:
        self.state, self.slot, self.names, self.buffer = state, slot, names, buffer
        self._meta = ReplicaMeta.of_slot(slot)
        self._cond = threading.Condition()
        self._copied = 0
        #: None while copying; then whether the slot was left unchanged while it was copied
        self._intact: bool | None = None
        #: why the copy could not be made (the slot's memory could not be read)
        self._error = ""
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="stead-ckpt-replica-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        intact = False
        try:
            source = np.frombuffer(self.state.mapping(self.slot, self.names), dtype=np.uint8, count=self._meta.nbytes)
            target = np.frombuffer(self.buffer, dtype=np.uint8, count=self._meta.nbytes)
            for start, end in wire_order(self._meta):
                if self._stop:
                    return
                np.copyto(target[start:end], source[start:end])  # (one thread, the GIL released)
                with self._cond:
                    self._copied += end - start
                    self._cond.notify_all()
            del source, target
            intact = self.state.control.slot(self.slot.index).seq == self.slot.seq
        except (CheckpointError, OSError, ValueError) as exc:
            self._error = f"rank {self.slot.rank}'s slot could not be copied ({exc})"
        finally:
            with self._cond:
                self._intact = intact
                self._cond.notify_all()

    def ready(self, upto: int) -> None:
        """Return once the first ``upto`` bytes (in wire order) are copied, and the last of them only once the copy
        is known intact; _Rewritten when it is not (nothing more of it is sent)."""
        last = upto >= self._meta.nbytes
        with self._cond:
            self._cond.wait_for(lambda: self._intact is not None or (not last and self._copied >= upto))
            if self._intact is not False and self._copied >= upto:
                return
        if self._error:
            raise ReplicaError(self._error)
        raise _Rewritten(f"rank {self.slot.rank}'s slot was rewritten while step {self.slot.step} was copied (a "
                         "newer save): the copy is not sent")

    def intact(self) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._intact is not None)
            return self._intact is True

    def close(self) -> None:
        """Stop copying (a send that failed) and wait for the thread: the buffer is free for the next copy."""
        self._stop = True
        self._thread.join()
