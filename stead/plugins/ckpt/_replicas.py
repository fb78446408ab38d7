"""Replicas of flash checkpoints between agents: a rank's committed slot copied into another host's memory.

One TCP connection per transfer (:mod:`._replicawire`), wrapped in TLS when the job has certificates (``tls_*``
settings). Before anything else both sides prove they hold the job's token without sending it: the server sends a
nonce, the client answers with its own nonce and an HMAC-SHA256 of both (and of the job's name) under the token, the
server checks it and answers with its own HMAC, which the client checks before it sends or reads a byte of a
checkpoint. A process that took a dead agent's port learns nothing and is refused; one of another job (or token)
fails either proof.

Then one request, a JSON line:

- ``{"op": "put", "meta": {...}}``, answered ``{"ok": true}`` once the holder made room (or a refusal: too little
  memory, ``ckpt.replica_max_bytes``), then the slot's bytes (``meta["nbytes"]``, in :func:`wire_order`: the
  checksums and the layout document first, then the tensors), and ``{"intact": bool}``: whether the slot was left
  unchanged while it was read (a save into it meanwhile makes the copy torn, and it is dropped). The holder writes
  the bytes into a segment of its own, checks the layout document against its checksum as soon as it arrived, and
  each tensor against the checksum the source's agent computed as soon as the tensor's bytes are in (a thread
  beside the receiving loop: the check ends moments after the last byte, not a pass over the whole later), and
  only once every check passed and the sender said intact puts it in place of the rank's previous replica
  (double-buffered: a replica is never torn, and a failed transfer leaves the previous one; the replicated step's
  copy, :meth:`ReplicaServer.keep`, is kept beside the newer one until a newer step is replicated). Answer
  ``{"ok": true}`` or ``{"ok": false, "error": ...}``.
- ``{"op": "get", "rank": R, "step": S, "round": r}``: the holder answers ``{"ok": true, "meta": {...}}`` and the
  bytes (in :func:`wire_order` too), or ``{"ok": false, "error": ...}``; the fetcher checks them the same way as
  they arrive, and uses them only once every check passed.
- ``{"op": "head", "rank": R, "step": S, "round": r}`` and ``{"op": "read", ..., "ranges": [[offset, length],
  ...]}``, any number of them on one connection (up to ``_MAX_REQUESTS``): parts of a slot for a reshard from
  memory on another node (:mod:`._remoteparts`), from a replica held here (read under the lock that guards its
  replacement) or from one of this node's own slots (its sequence number read again after the bytes went). A head
  is answered ``{"ok": true, "meta": {...}}``, the slot's checksums and layout document (its bytes from
  ``checks_off`` on), then ``{"intact": bool}``; a read ``{"ok": true, "bytes": n}``, the ranges' bytes one after
  the other, then ``{"intact": bool}``. A read of more than ``_MAX_RANGES`` ranges or ``_MAX_READ_BYTES`` bytes, or
  of bytes outside the slot's tensor data, is refused with the reason (``{"ok": false, "error": ...}``): the
  reader checks every tensor against the checksums of the head it checked, and uses nothing unchecked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import mmap
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from stead.plugins.ckpt._checksum import hasher
from stead.plugins.ckpt._layout import parse_document
from stead.plugins.ckpt._replicawire import (
    _CHUNK,
    _GREETING,
    _REFUSED,
    Conn,
    ReplicaError,
    _Closed,
    _proof,
    connect,
    read_ranges,
    send_parts,
)
from stead.plugins.ckpt._shm import (
    SegmentNames,
    SlotInfo,
    create_segment,
    map_segment,
    round_capacity,
    unlink_quietly,
)
from stead.plugins.ckpt.errors import CheckpointError

__all__ = ["Held", "OwnSlot", "ReplicaError", "ReplicaMeta", "ReplicaServer", "check_layout", "connect", "fetch",
           "push", "wire_order"]

log = structlog.get_logger("stead.plugins.ckpt")

#: the largest replica taken (one rank's slot): bounds what a request may make the holder allocate
_MAX_REPLICA_BYTES = 1 << 40
#: the largest layout document (JSON) a replica may carry
_MAX_LAYOUT_BYTES = 256 << 20
#: the bytes received before the thread that checks the tensors is told (fewer, shorter wake-ups; still in cache)
_HASH_STEP = 2 << 20
#: the requests one connection may make (a reader of a slot's parts asks for one tensor at a time)
_MAX_REQUESTS = 1 << 20
#: connections a replica port serves at once (each node sends one at a time; a flood of strangers is cut here)
_MAX_CONNECTIONS = 64


@dataclasses.dataclass(frozen=True)
class ReplicaMeta:
    """What a replica is: the rank, world, step and round it holds, and its slot's layout (offsets and sizes)."""

    rank: int
    world: int
    step: int
    round: int
    data_bytes: int
    n_tensors: int
    checks_off: int
    layout_off: int
    layout_len: int
    layout_sum: int

    @property
    def nbytes(self) -> int:
        return self.layout_off + self.layout_len

    @classmethod
    def of_slot(cls, info: SlotInfo) -> ReplicaMeta:
        return cls(rank=info.rank, world=info.world, step=info.step, round=info.round, data_bytes=info.data_bytes,
                   n_tensors=info.n_tensors, checks_off=info.checks_off, layout_off=info.layout_off,
                   layout_len=info.layout_len, layout_sum=info.layout_sum)

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> ReplicaMeta:
        """Parsed and bounded: a meta that could make the holder allocate or read out of bounds is refused."""
        if not isinstance(value, dict):
            raise ReplicaError("a replica's description is not an object; run every node with the same stead")
        fields = [f.name for f in dataclasses.fields(cls)]
        numbers = {name: value.get(name) for name in fields}
        bad = [n for n, v in numbers.items() if not isinstance(v, int) or isinstance(v, bool) or v < -1]
        if bad:
            raise ReplicaError(f"a replica's description has no valid {', '.join(bad)}; run every node with the "
                               "same stead")
        meta = cls(**{n: int(v) for n, v in numbers.items() if isinstance(v, int)})
        if not (0 <= meta.rank < meta.world and meta.step >= 0 and meta.round >= 0 and meta.layout_len > 0
                and meta.checks_off + 8 * meta.n_tensors <= meta.layout_off and meta.data_bytes <= meta.checks_off
                and meta.layout_len <= _MAX_LAYOUT_BYTES and meta.nbytes <= _MAX_REPLICA_BYTES
                and meta.layout_sum >= 0 and meta.n_tensors >= 0):
            raise ReplicaError(f"a replica's description does not hold together ({meta}); it is refused")
        return meta


def wire_order(meta: ReplicaMeta) -> list[tuple[int, int]]:
    """The (start, end) byte ranges of a replica in the order they travel: its checksums and layout document first
    (what the receiver needs to check each tensor as it arrives), then its tensors, ``_CHUNK`` bytes at a time."""
    return [(meta.checks_off, meta.nbytes), *((start, min(start + _CHUNK, meta.checks_off))
                                              for start in range(0, meta.checks_off, _CHUNK))]


def check_layout(layout: bytes | memoryview, meta: ReplicaMeta, *, capacity: int, where: str
                 ) -> list[tuple[int, int]]:
    """A replica's layout document (arrived: ``layout``, its bytes) checked against its checksum and its
    description: each tensor's (offset, size), every one inside the replica's data; ReplicaError naming what
    failed."""
    try:
        doc = parse_document(bytes(layout), expected_sum=meta.layout_sum, where=where)
        doc.check_fits(capacity, where=where)
    except CheckpointError as exc:
        raise ReplicaError(str(exc)) from None
    if (doc.step, doc.round, doc.rank, doc.world) != (meta.step, meta.round, meta.rank, meta.world) \
            or len(doc.tensors) != meta.n_tensors:
        raise ReplicaError(f"{where}: its layout names step {doc.step} of rank {doc.rank} (round {doc.round}, world "
                           f"{doc.world}, {len(doc.tensors)} tensors), not what it was sent as")
    regions = doc.regions()
    if any(offset + nbytes > meta.data_bytes for offset, nbytes in regions):
        raise ReplicaError(f"{where}: its layout places tensors beyond its {meta.data_bytes} bytes of tensor data; "
                           "it is refused")
    return regions


class _Checks:
    """Each tensor of a replica checked against its checksum by a thread of its own, as soon as the tensor's bytes
    have arrived (:meth:`arrived` says how far they have), beside the loop that receives them."""

    def __init__(self, view: memoryview, regions: list[tuple[int, int]], sums: list[int]) -> None:
        self._view, self._regions, self._sums = view, regions, sums
        self._cond = threading.Condition()
        self._arrived = 0
        self._ended = False
        #: the tensors that failed their checksums (or could not be checked: the bytes never all arrived)
        self._bad: list[int] = []
        self._thread = threading.Thread(target=self._run, name="stead-ckpt-replica-check", daemon=True)
        self._thread.start()

    def arrived(self, upto: int) -> None:
        """The replica's first ``upto`` bytes of tensor data are in."""
        with self._cond:
            self._arrived = upto
            self._cond.notify()

    def finish(self) -> list[int]:
        """Once every byte arrived (or none will any more): the indexes of the tensors that failed their checks
        (every one not wholly arrived among them)."""
        with self._cond:
            self._ended = True
            self._cond.notify()
        self._thread.join()
        return sorted(self._bad)

    def _run(self) -> None:
        bad = list(range(len(self._regions)))  # (a failure of this thread's own: nothing is vouched for)
        try:
            bad = [i for i in sorted(range(len(self._regions)), key=lambda i: self._regions[i]) if not self._check(i)]
        finally:
            self._bad = bad

    def _check(self, index: int) -> bool:
        offset, nbytes = self._regions[index]
        state, done, end = hasher(), offset, offset + nbytes
        while done < end:
            with self._cond:
                while self._arrived <= done and not self._ended:
                    self._cond.wait()
                upto = min(self._arrived, end)
            if upto <= done:
                return False  # ended before this tensor's bytes all came
            state.update(self._view[done:upto])
            done = upto
        return state.intdigest() == self._sums[index]


def _receive(conn: Conn, view: memoryview, meta: ReplicaMeta, *, capacity: int, where: str) -> ReplicaError | None:
    """Read a replica (:func:`wire_order`) into ``view``, its layout checked once it arrived and each tensor as its
    bytes come in; why it is not to be used (its layout or a tensor failed its checks), None when every check
    passed. ReplicaError when the peer stops sending."""
    conn.read_into(view[meta.checks_off:meta.nbytes])
    try:
        regions = check_layout(view[meta.layout_off:meta.nbytes], meta, capacity=capacity, where=where)
    except ReplicaError as exc:
        conn.read_into(view[:meta.checks_off])  # read all the same: the sender hears why, not a reset connection
        return exc
    sums = view[meta.checks_off:meta.checks_off + 8 * meta.n_tensors].cast("Q")
    try:
        checks = _Checks(view, regions, sums.tolist())
    finally:
        sums.release()
    try:
        conn.read_into(view[:meta.checks_off], progress=checks.arrived, step=_HASH_STEP)
    finally:
        bad = checks.finish()
    if bad:
        return ReplicaError(f"{where}: {len(bad)} of {meta.n_tensors} tensors fail their checksums (first: tensor "
                            f"{bad[0]}); the copy was damaged on its way and is not used")
    return None


def push(address: str, *, token: str, job: str, tls: ssl.SSLContext | None, meta: ReplicaMeta, source: memoryview,
         intact: Callable[[], bool], timeout_s: float, ready: Callable[[int], None] | None = None) -> None:
    """Send ``source`` (a slot's first ``meta.nbytes`` bytes) to the agent at ``address`` as a replica, in
    :func:`wire_order`; ``ready(n)`` (if given) returns once the first ``n`` bytes in that order are in ``source``
    (a copy being made as they are sent) and raises ReplicaError to stop before they are sent. ``intact()``, asked
    once every byte is sent, says whether they are the slot as it was saved (False: the holder drops them)."""
    conn = connect(address, token=token, job=job, tls=tls, timeout_s=timeout_s)
    try:
        conn.send_line({"op": "put", "meta": meta.to_json()})
        answer = conn.json()
        if not answer.get("ok"):
            raise ReplicaError(f"the agent at {address} refused the replica: "
                               f"{answer.get('error', '(no reason given)')}")
        sent = 0
        for start, end in wire_order(meta):
            sent += end - start
            if ready is not None:
                ready(sent)
            conn.sock.sendall(source[start:end])
        conn.send_line({"intact": bool(intact())})
        answer = conn.json()
    except OSError as exc:
        raise ReplicaError(f"sending a replica to {address} failed ({exc})") from None
    finally:
        conn.close()
    if not answer.get("ok"):
        raise ReplicaError(f"the agent at {address} refused the replica: {answer.get('error', '(no reason given)')}")


def fetch(address: str, *, token: str, job: str, tls: ssl.SSLContext | None, rank: int, step: int, round_: int,
          into: Callable[[ReplicaMeta], memoryview], timeout_s: float) -> ReplicaMeta:
    """Fetch the replica of ``rank``'s ``step`` (of ``round_``) from ``address`` into the memory ``into(meta)``
    gives, its layout and each tensor checked as they arrive; ReplicaError when it is not there, does not arrive
    whole or fails its checks (the memory then holds no replica to use)."""
    conn = connect(address, token=token, job=job, tls=tls, timeout_s=timeout_s)
    try:
        conn.send_line({"op": "get", "rank": rank, "step": step, "round": round_})
        answer = conn.json()
        if not answer.get("ok"):
            raise ReplicaError(f"the agent at {address} has no replica of rank {rank} step {step}: "
                               f"{answer.get('error', '(no reason given)')}")
        meta = ReplicaMeta.from_json(answer.get("meta"))
        if (meta.rank, meta.step, meta.round) != (rank, step, round_):
            raise ReplicaError(f"the agent at {address} sent step {meta.step} of rank {meta.rank} for step {step} "
                               f"of rank {rank}")
        target = into(meta)
        if len(target) < meta.nbytes:
            raise ReplicaError(f"no room for the replica of rank {rank} step {step}: {meta.nbytes} bytes, "
                               f"{len(target)} given")
        unusable = _receive(conn, target, meta, capacity=len(target),
                            where=f"the replica of rank {rank} step {step} from {address}")
    except OSError as exc:
        raise ReplicaError(f"fetching a replica from {address} failed ({exc})") from None
    finally:
        conn.close()
    if unusable is not None:
        raise unusable
    return meta


# -- the holder ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Held:
    """One replica this node holds: its description and its own segment."""

    meta: ReplicaMeta
    name: str
    capacity: int
    view: mmap.mmap


@dataclasses.dataclass(frozen=True)
class OwnSlot:
    """One of this node's own slots, served to a reshard on another node: its description, its memory, and whether
    it still holds what it held when it was found (a save into it meanwhile: what was sent is not to be used)."""

    meta: ReplicaMeta
    view: mmap.mmap
    unchanged: Callable[[], bool]


#: (rank, step, round) -> the node's own slot holding that rank's step (None: none)
OwnSlots = Callable[[int, int, int], "OwnSlot | None"]


class ReplicaServer:
    """The replica port of one agent: takes replicas of other nodes' ranks and serves them back (threads), and
    serves parts of them and of the node's own slots (``own``) to reshards on other nodes."""

    def __init__(self, *, names: SegmentNames, token: str, job: str, tls: ssl.SSLContext | None, max_bytes: int,
                 timeout_s: float, changed: Callable[[], None], own: OwnSlots | None = None) -> None:
        self.names, self.token, self.job, self.tls = names, token, job, tls
        self.max_bytes, self.timeout_s, self.changed = max_bytes, timeout_s, changed
        self.own = own
        self.held: dict[int, Held] = {}
        #: rank -> the replicated step's copy, kept beside a newer one in ``held`` until a newer step is replicated
        self.kept: dict[int, Held] = {}
        #: (step, round) of the replicated step ((-1, -1): none to keep)
        self._replicated = (-1, -1)
        #: rank -> the segment its previous replica used, written over by the next one (double buffering without
        #: allocating and faulting a new segment for every step)
        self._spares: dict[int, Held] = {}
        self._lock = threading.Lock()
        self._gen = 0
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        #: each connection served and its thread (closing waits for them: a put in flight may hold a segment)
        self._conns: dict[socket.socket, threading.Thread] = {}
        #: what :meth:`holdings` returns, replaced whole under the lock (read without it: a fetch being served holds
        #: the lock for as long as it sends, and the agent's reports must not wait for it)
        self._snapshot: tuple[tuple[ReplicaMeta, int], ...] = ()
        self.address = ""

    def start(self, host: str) -> str:
        """Listen on ``host`` (a port the OS picks); returns ``host:port``."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(16)
        self._listener = listener
        port = listener.getsockname()[1]
        self.address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        self._thread = threading.Thread(target=self._accept, name="stead-ckpt-replicas", daemon=True)
        self._thread.start()
        return self.address

    def close(self) -> None:
        """Stop serving and free every replica held."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._lock:
            serving = list(self._conns.items())
            for sock, _ in serving:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for _, thread in serving:
            thread.join(timeout=5.0)
        with self._lock:
            for held in [*self.held.values(), *self.kept.values(), *self._spares.values()]:
                _free(held)
            self.held.clear()
            self.kept.clear()
            self._spares.clear()
            self._changed_holdings()

    def copies(self, step: int, round_: int) -> list[Held]:
        """Each replica held of ``step`` saved in ``round_`` (the newest copy of a rank or the replicated step's
        kept beside it): for a reshard from memory on this node."""
        with self._lock:
            return [h for h in [*self.held.values(), *self.kept.values()]
                    if (h.meta.step, h.meta.round) == (step, round_)]

    def holdings(self) -> list[tuple[ReplicaMeta, int]]:
        """Each replica held and the memory it takes (its spare segment included), a kept one too."""
        return list(self._snapshot)

    def keep(self, replicated: tuple[int, int]) -> None:
        """Keep the copies of ``replicated`` ((step, round); (-1, -1): none) while newer ones arrive; a copy kept for
        an older step becomes its rank's spare buffer."""
        with self._lock:
            self._replicated = replicated
            dropped = [(r, h) for r, h in self.kept.items() if (h.meta.step, h.meta.round) != replicated]
            for rank, _ in dropped:
                del self.kept[rank]
            self._changed_holdings()
        for rank, held in dropped:
            self._keep_spare(rank, held)

    def _changed_holdings(self) -> None:
        """(under the lock) what :meth:`holdings` says from now on."""
        self._snapshot = (*((h.meta, h.capacity + (self._spares[r].capacity if r in self._spares else 0))
                            for r, h in self.held.items()), *((h.meta, h.capacity) for h in self.kept.values()))

    def _accept(self) -> None:
        while True:
            listener = self._listener
            if listener is None:
                return
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            if len(self._conns) >= _MAX_CONNECTIONS:
                log.warning("ckpt_replica_connection_refused", reason=f"{_MAX_CONNECTIONS} connections are open "
                            "already (no node sends more than a few at once)")
                sock.close()
                continue
            thread = threading.Thread(target=self._serve, args=(sock,), name="stead-ckpt-replica", daemon=True)
            with self._lock:
                self._conns[sock] = thread
            thread.start()

    def _serve(self, raw: socket.socket) -> None:
        raw.settimeout(self.timeout_s)
        conn: Conn | None = None
        try:
            sock = self.tls.wrap_socket(raw, server_side=True) if self.tls is not None else raw
            conn = Conn(sock)
            if not self._handshake(conn):
                return
            request = conn.json()
            if request.get("op") == "put":
                self._put(conn, request)
            elif request.get("op") == "get":
                self._get(conn, request)
            elif request.get("op") in ("head", "read"):
                self._reads(conn, request)
            else:
                conn.send_line({"ok": False, "error": f"unknown request {request.get('op')!r}; run every node with "
                                                      "the same stead"})
        except (OSError, ssl.SSLError, ReplicaError) as exc:
            log.warning("ckpt_replica_connection_failed", error=str(exc))
        finally:
            with self._lock:
                self._conns.pop(raw, None)
            if conn is not None:
                conn.close()
            else:
                raw.close()

    def _handshake(self, conn: Conn) -> bool:
        nonce = secrets.token_hex(16)
        conn.send_line(f"{_GREETING} {nonce}")
        words = conn.line().split(" ")
        if len(words) != 2 or not hmac.compare_digest(words[1].encode(),
                                                      _proof(self.token, "client", self.job, nonce, words[0]).encode()):
            log.warning("ckpt_replica_unauthenticated",
                        reason="a peer did not prove it holds the job's token: nothing is read from it or sent to it")
            conn.send_line(_REFUSED)
            return False
        conn.send_line(_proof(self.token, "server", self.job, nonce, words[0]))
        return True

    def _put(self, conn: Conn, request: dict[str, Any]) -> None:
        meta = ReplicaMeta.from_json(request.get("meta"))
        capacity = round_capacity(meta.nbytes)
        with self._lock:
            others = sum(h.capacity for r, h in [*self.held.items(), *self.kept.items(), *self._spares.items()]
                         if r != meta.rank)
            mine = sum(h.capacity for h in (self.held.get(meta.rank), self.kept.get(meta.rank)) if h is not None)
            spare = self._spares.pop(meta.rank, None)
            self._gen += 1
            gen = self._gen
        if spare is not None and spare.capacity < meta.nbytes:
            _free(spare)  # (the rank's state grew)
            spare = None
        if self.max_bytes and others + mine + (capacity if spare is None else spare.capacity) > self.max_bytes:
            if spare is not None:
                _free(spare)
            conn.send_line({"ok": False, "error": (
                f"this node holds {others + mine} bytes of replicas and ckpt.replica_max_bytes={self.max_bytes} leaves "
                f"no room for rank {meta.rank}'s next {capacity} (each is double-buffered, and the replicated "
                "step's copy is kept beside a newer one: up to three per rank); raise ckpt.replica_max_bytes on the "
                "holding nodes (or lower ckpt.replicas)")})
            return
        if spare is not None:
            held = dataclasses.replace(spare, meta=meta)
        else:
            name = self.names.replica(meta.rank, gen)
            try:
                create_segment(name, capacity)
            except CheckpointError as exc:
                conn.send_line({"ok": False, "error": f"no room for rank {meta.rank}'s replica: {exc}"})
                return
            held = Held(meta=meta, name=name, capacity=capacity, view=map_segment(name, capacity))
        started = time.monotonic()
        try:
            conn.send_line({"ok": True})  # room made: the sender may send the bytes
            memory = memoryview(held.view)
            try:
                unusable = _receive(conn, memory, meta, capacity=capacity,
                                    where=f"the replica of rank {meta.rank} step {meta.step}")
                intact = conn.json().get("intact") is True
                if not intact:
                    raise ReplicaError(f"rank {meta.rank}'s slot was rewritten while step {meta.step} was sent "
                                       "(a newer save): the copy is dropped, the previous replica kept")
                if unusable is not None:
                    raise unusable
            finally:
                memory.release()
        except ReplicaError as exc:
            self._keep_spare(meta.rank, held)
            conn.send_line({"ok": False, "error": str(exc)})
            return
        except BaseException:
            self._keep_spare(meta.rank, held)
            raise
        stale: Held | None
        with self._lock:
            old = self.held.get(meta.rank)
            if old is not None and (old.meta.round, old.meta.step) > (meta.round, meta.step):
                stale, keep = held, old  # a late, older copy: the newer one stays
            else:
                self.held[meta.rank], stale, keep = held, old, held
                if old is not None and (old.meta.step, old.meta.round) == self._replicated \
                        and (meta.step, meta.round) != self._replicated:
                    stale = self.kept.pop(meta.rank, None)  # the replicated step's copy stays, beside the newer
                    self.kept[meta.rank] = old
            self._changed_holdings()
        if stale is not None:
            self._keep_spare(meta.rank, stale)
        conn.send_line({"ok": True})
        if keep is held:
            log.debug("ckpt_replica_taken", rank=meta.rank, step=meta.step, bytes=meta.nbytes,
                      seconds=round(time.monotonic() - started, 4))
            self.changed()

    def _keep_spare(self, rank: int, held: Held) -> None:
        """Keep ``held``'s segment for ``rank``'s next replica (one per rank; any other is freed)."""
        with self._lock:
            other = self._spares.get(rank)
            self._spares[rank] = held
            self._changed_holdings()
        if other is not None:
            _free(other)

    def _get(self, conn: Conn, request: dict[str, Any]) -> None:
        rank, step, round_ = (request.get(k) for k in ("rank", "step", "round"))
        with self._lock:
            copies = [self.held.get(rank), self.kept.get(rank)] if isinstance(rank, int) else []
            held = next((h for h in copies if h is not None and (h.meta.step, h.meta.round) == (step, round_)),
                        copies[0] if copies else None)
            if held is None or (held.meta.step, held.meta.round) != (step, round_):
                have = f"it holds step {held.meta.step} (round {held.meta.round})" if held is not None else \
                    "it holds none of that rank"
                conn.send_line({"ok": False, "error": f"no replica of rank {rank} step {step} round {round_}: {have}"})
                return
            conn.send_line({"ok": True, "meta": held.meta.to_json()})
            memory = memoryview(held.view)
            try:
                for start, end in wire_order(held.meta):  # under the lock: a newer put waits, never frees it
                    conn.sock.sendall(memory[start:end])
            finally:
                memory.release()

    # -- parts of a slot, for a reshard on another node -------------------------------------------------------

    def _reads(self, conn: Conn, request: dict[str, Any]) -> None:
        """Answer ``head`` and ``read`` requests until the reader hangs up (or asks for something else)."""
        for _ in range(_MAX_REQUESTS):
            if request.get("op") not in ("head", "read"):
                conn.send_line({"ok": False, "error": f"{request.get('op')!r} after a read: one put or get per "
                                                      "connection; run every node with the same stead"})
                return
            self._read(conn, request)
            try:
                request = conn.json()
            except _Closed:
                return
        conn.send_line({"ok": False, "error": f"more than {_MAX_REQUESTS} reads on one connection; open another"})

    def _read(self, conn: Conn, request: dict[str, Any]) -> None:
        named = [request.get(k) for k in ("rank", "step", "round")]
        rank, step, round_ = (v if isinstance(v, int) and not isinstance(v, bool) else -1 for v in named)
        if min(rank, step, round_) < 0:
            conn.send_line({"ok": False, "error": "a read names no valid rank, step and round"})
            return
        ranges = read_ranges(request.get("ranges")) if request["op"] == "read" else []
        if isinstance(ranges, str):
            conn.send_line({"ok": False, "error": ranges})
            return
        with self._lock:  # a held replica is not replaced (nor its segment reused) while its bytes are sent
            held = next((h for h in (self.held.get(rank), self.kept.get(rank))
                         if h is not None and (h.meta.step, h.meta.round) == (step, round_)), None)
            if held is not None:
                send_parts(conn, held.meta, held.view, ranges, lambda: True)
                return
        own = self.own(rank, step, round_) if self.own is not None else None
        if own is None:
            conn.send_line({"ok": False, "error": f"this node holds no slot of rank {rank} step {step} round "
                                                  f"{round_} (it was saved over, or the node restarted)"})
            return
        send_parts(conn, own.meta, own.view, ranges, own.unchanged)

def _free(held: Held) -> None:
    try:
        held.view.close()
    except BufferError:
        log.debug("ckpt_replica_mapping_in_use")
    unlink_quietly(held.name)
