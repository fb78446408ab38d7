"""Shared-memory segments of the flash checkpoint and the control block both sides share.

The agent owns every segment: it creates them under ``/dev/shm`` (names start with
``stead-ckpt-<job>-<node>-i<incarnation>-``), allocates their pages up front and
unlinks them when it exits; a relaunched agent of the same job and node removes
those a killed predecessor left. Workers open them by name and map them.

Per local rank there is one control segment (a page) and one data segment per
slot. The control block, little endian::

    0    magic 8s | version u32 | local_rank u32
    16   committed_step i64 | committed_round i64          written by the agent
    32   released_step i64  | released_round i64           written by the agent
    48   pinned_step i64    | pinned_round i64             written by the agent (a persist reads that slot)
    64   4 x (step i64 | round i64)                         written by the agent: the newest commits, newest first
    128  slot 0, 256 slot 1 (128 bytes each):
         seq u64 | state u32 | pad u32 | step i64 | round i64 | rank i32 | world i32     worker
         data_bytes u64 | n_tensors u64 | checks_off u64 | layout_off u64 | layout_len u64  worker
         layout_sum u64                                                                     worker
         gen u64 | capacity u64 | checks_seq u64 | verify_seq u64 | verify_state u32        agent
    384  replicated_step i64 | replicated_round i64      written by the agent: every rank's copy is on another host
    400  replicating_step i64 | replicating_round i64    written by the agent: the step being copied there

``seq`` is odd while the worker writes the slot; ``state`` is COMPLETE once the
step is fully copied. Each side writes only its own fields; choosing a slot to
overwrite (worker) and pinning one (agent) happen under ``flock`` on the control
segment, so a persist never reads a slot being rewritten. The worker never
overwrites the slot of the pinned step, nor (while the master says to keep them)
those of the replicated and the replicating steps (:mod:`._replicated`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import fcntl
import hashlib
import mmap
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path

from stead.plugins.ckpt.errors import CheckpointError, SharedMemoryTooSmall

__all__ = [
    "CONTROL_BYTES",
    "SHM_DIR",
    "Control",
    "SlotInfo",
    "SlotState",
    "VerifyState",
    "create_segment",
    "map_segment",
    "segment_names",
    "shm_too_small_message",
    "unlink_quietly",
]

#: the tmpfs holding the segments: ``ckpt.shm_dir``, read from its environment variable at import, which every
#: process of a node (agent and workers) has the same (a container's /dev/shm is the default)
SHM_DIR = Path(os.environ.get("STEAD_CKPT_SHM_DIR") or "/dev/shm")
CONTROL_BYTES = 4096
MAGIC = b"STEADCK1"
VERSION = 1
SLOTS = 2
_SLOT_BASE = 128
_SLOT_BYTES = 128
#: tmpfs allocation granularity we round capacities to (fewer regrowths, cheap to fault)
ALLOC_ROUND = 2 << 20

_HEAD = struct.Struct("<8sII")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
# the worker's part of a slot, at +0 (88 bytes); the agent's fields follow
_SLOT_WORKER = struct.Struct("<QIIqqiiQQQQQQ")
_GEN, _CAPACITY, _CHECKS_SEQ, _VERIFY_SEQ, _VERIFY_STATE = 88, 96, 104, 112, 120
_COMMITTED, _RELEASED, _PINNED = 16, 32, 48
_REPLICATED, _REPLICATING = 384, 400
#: the newest commits the agent heard of (or a replica it fetched proves), newest first
_RECENT, _RECENT_PAIRS = 64, 4


class SlotState(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    COMPLETE = 2


class VerifyState(enum.IntEnum):
    NONE = 0
    RUNNING = 1
    OK = 2
    CORRUPT = 3
    #: no checksums were computed before the writer died: nothing to verify against
    UNCHECKED = 4


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """One slot as read from the control block."""

    index: int
    seq: int
    state: SlotState
    step: int
    round: int
    rank: int
    world: int
    data_bytes: int
    n_tensors: int
    checks_off: int
    layout_off: int
    layout_len: int
    layout_sum: int
    gen: int
    capacity: int
    checks_seq: int
    verify_seq: int
    verify_state: VerifyState

    @property
    def complete(self) -> bool:
        return self.state is SlotState.COMPLETE and self.seq % 2 == 0

    def holds(self, step: int, round_: int) -> bool:
        return self.complete and self.step == step and self.round == round_


def _tag(text: str, limit: int) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.]", "_", text)[:limit]
    return f"{clean}.{hashlib.sha256(text.encode()).hexdigest()[:8]}"


@dataclasses.dataclass(frozen=True)
class SegmentNames:
    """The names of one agent's segments (job, node and incarnation are all in them)."""

    prefix: str  # stead-ckpt-<job>-<node>-
    incarnation: int

    def control(self, local_rank: int) -> str:
        return f"{self.prefix}i{self.incarnation}-r{local_rank}-ctl"

    def data(self, local_rank: int, slot: int, gen: int) -> str:
        return f"{self.prefix}i{self.incarnation}-r{local_rank}-s{slot}-g{gen}"

    def replica(self, rank: int, gen: int) -> str:
        """A replica this node holds of another node's global ``rank``."""
        return f"{self.prefix}i{self.incarnation}-p{rank}-g{gen}"

    def stale(self) -> list[str]:
        """Segments of this job and node left by another incarnation of the agent."""
        mine = f"{self.prefix}i{self.incarnation}-"
        try:
            names = [p.name for p in SHM_DIR.iterdir()]
        except OSError:
            return []
        return sorted(n for n in names if n.startswith(self.prefix) and not n.startswith(mine))

    def all_mine(self) -> list[str]:
        mine = f"{self.prefix}i{self.incarnation}-"
        try:
            return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(mine))
        except OSError:
            return []


def segment_names(job: str, node_id: str, incarnation: int, namespace: str = "") -> SegmentNames:
    """The segment names of one agent; ``namespace`` (``ckpt.shm_namespace``) keeps apart jobs of the same name."""
    space = f"{_tag(namespace, 24)}-" if namespace else ""
    return SegmentNames(prefix=f"stead-ckpt-{space}{_tag(job, 48)}-{_tag(node_id, 32)}-", incarnation=incarnation)


def shm_too_small_message(needed: int, free: int) -> str:
    return (f"the flash checkpoint needs {_size(needed)} of /dev/shm for its two slots but only {_size(free)} is "
            f"free; give the node a larger /dev/shm (`docker run --shm-size={_suggest(needed)}`, a Kubernetes "
            "emptyDir volume with medium: Memory mounted at /dev/shm, or `mount -o remount,size=... /dev/shm`; "
            "containers default to 64 MiB), or save a smaller state dict per rank")


def _size(n: int) -> str:
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30)):
        if n >= scale // 4:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**20:.1f} MiB"


def _suggest(needed: int) -> str:
    return f"{max(1, -(-needed * 5 // 4) // 2**30)}g"


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def round_capacity(nbytes: int) -> int:
    return max(ALLOC_ROUND, -(-nbytes // ALLOC_ROUND) * ALLOC_ROUND)


def create_segment(name: str, size: int, *, reserve: int | None = None) -> None:
    """Create ``name`` with ``size`` bytes, every page allocated now (so no write faults in a new page later).

    ``reserve`` is the total about to be allocated in this request (checked against the free space once).
    """
    need = size if reserve is None else reserve
    try:
        free = free_bytes()
    except OSError as exc:
        raise CheckpointError(f"{SHM_DIR} is not usable ({exc}); flash checkpoints need a tmpfs there (/dev/shm, "
                              "or ckpt.shm_dir)") \
            from exc
    if need > free:
        raise SharedMemoryTooSmall(shm_too_small_message(need, free))
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        unlink_quietly(name)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SharedMemoryTooSmall(shm_too_small_message(need, free_bytes())) from exc
        raise CheckpointError(f"cannot allocate {_size(size)} in {path}: {exc}") from exc
    os.close(fd)


def map_segment(name: str, size: int) -> mmap.mmap:
    """Map an existing segment read-write (worker and agent alike)."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise CheckpointError(f"shared-memory segment {name} is gone; its agent has exited or restarted") from exc
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def unlink_quietly(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


class Control:
    """The control block of one local rank, mapped; both the agent and the worker use this class."""

    def __init__(self, name: str, *, create: bool = False, local_rank: int = 0) -> None:
        self.name = name
        if create:
            create_segment(name, CONTROL_BYTES)
        path = SHM_DIR / name
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise CheckpointError(f"the checkpoint control block {name} does not exist; is the agent running?") \
                from exc
        self.view = mmap.mmap(self._fd, CONTROL_BYTES, flags=mmap.MAP_SHARED)
        if create:
            _HEAD.pack_into(self.view, 0, MAGIC, VERSION, local_rank)
            for offset in (_COMMITTED, _RELEASED, _PINNED, _REPLICATED, _REPLICATING,
                           *(_RECENT + 16 * i for i in range(_RECENT_PAIRS))):
                _I64.pack_into(self.view, offset, -1)
                _I64.pack_into(self.view, offset + 8, -1)
        magic, version, _ = _HEAD.unpack_from(self.view, 0)
        if magic != MAGIC or version != VERSION:
            self.close()
            raise CheckpointError(f"{name} is not a stead checkpoint control block of version {VERSION}; "
                                  "run the workers and the agent with the same stead version")

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.view.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive against the other side (flock on the segment: released if the holder dies)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- agent-written pairs --------------------------------------------------------------

    def _pair(self, offset: int) -> tuple[int, int]:
        return _I64.unpack_from(self.view, offset)[0], _I64.unpack_from(self.view, offset + 8)[0]

    def _set_pair(self, offset: int, step: int, round_: int) -> None:
        _I64.pack_into(self.view, offset + 8, round_)
        _I64.pack_into(self.view, offset, step)

    @property
    def committed(self) -> tuple[int, int]:
        """(step, round) of the newest commit the agent heard of; (-1, -1) when none."""
        return self._pair(_COMMITTED)

    def set_committed(self, step: int, round_: int) -> None:
        self._set_pair(_COMMITTED, step, round_)
        self.note_committed(step, round_)

    def note_committed(self, step: int, round_: int) -> None:
        """Remember that ``step`` of ``round_`` was committed (the newest few are kept)."""
        recent = self.recently_committed()
        if (step, round_) in recent:
            return
        for i, (s, r) in enumerate(sorted({(step, round_), *recent}, key=lambda p: (p[1], p[0]),
                                          reverse=True)[:_RECENT_PAIRS]):
            self._set_pair(_RECENT + 16 * i, s, r)

    def recently_committed(self) -> list[tuple[int, int]]:
        """(step, round) of the newest commits this rank's agent heard of, newest first: a slot that holds one
        of them holds a committed step, even when a newer one was committed since."""
        pairs = [self._pair(_RECENT + 16 * i) for i in range(_RECENT_PAIRS)]
        return [p for p in pairs if p[0] >= 0]

    @property
    def released(self) -> tuple[int, int]:
        return self._pair(_RELEASED)

    def set_released(self, step: int, round_: int) -> None:
        self._set_pair(_RELEASED, step, round_)

    @property
    def pinned(self) -> tuple[int, int]:
        return self._pair(_PINNED)

    def set_pinned(self, step: int, round_: int) -> None:
        self._set_pair(_PINNED, step, round_)

    @property
    def kept(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(step, round) of the replicated step and of the step being replicated, whose slots the worker keeps;
        (-1, -1) each when none (or when the master does not ask to keep them)."""
        return self._pair(_REPLICATED), self._pair(_REPLICATING)

    def set_kept(self, replicated: tuple[int, int], replicating: tuple[int, int]) -> None:
        """Keep these steps' slots (a replicated step is committed: it is also noted as such)."""
        if replicated[0] >= 0:
            self.note_committed(*replicated)
        self._set_pair(_REPLICATED, *replicated)
        self._set_pair(_REPLICATING, *replicating)

    # -- slots ------------------------------------------------------------------------------

    def slot(self, index: int) -> SlotInfo:
        base = _SLOT_BASE + index * _SLOT_BYTES
        (seq, state, _, step, round_, rank, world, data_bytes, n_tensors, checks_off, layout_off, layout_len,
         layout_sum) = _SLOT_WORKER.unpack_from(self.view, base)
        gen, capacity, checks_seq, verify_seq = (_U64.unpack_from(self.view, base + off)[0]
                                                 for off in (_GEN, _CAPACITY, _CHECKS_SEQ, _VERIFY_SEQ))
        verify_state = _U32.unpack_from(self.view, base + _VERIFY_STATE)[0]
        try:
            slot_state = SlotState(state)
        except ValueError:
            slot_state = SlotState.EMPTY
        try:
            verify = VerifyState(verify_state)
        except ValueError:
            verify = VerifyState.NONE
        return SlotInfo(index, seq, slot_state, step, round_, rank, world, data_bytes, n_tensors, checks_off,
                        layout_off, layout_len, layout_sum, gen, capacity, checks_seq, verify_seq, verify)

    def slots(self) -> list[SlotInfo]:
        return [self.slot(i) for i in range(SLOTS)]

    def begin_write(self, index: int) -> int:
        """Mark slot ``index`` as being written; returns the (odd) seq."""
        base = _SLOT_BASE + index * _SLOT_BYTES
        seq: int = _U64.unpack_from(self.view, base)[0]
        seq = seq + 1 if seq % 2 == 0 else seq + 2
        _U64.pack_into(self.view, base, seq)
        _U32.pack_into(self.view, base + 8, SlotState.WRITING)
        return seq

    def end_write(self, index: int, *, seq: int, step: int, round_: int, rank: int, world: int, data_bytes: int,
                  n_tensors: int, checks_off: int, layout_off: int, layout_len: int, layout_sum: int) -> int:
        """Publish a fully written slot; returns its (even) seq."""
        base = _SLOT_BASE + index * _SLOT_BYTES
        _SLOT_WORKER.pack_into(self.view, base, seq, SlotState.WRITING, 0, step, round_, rank, world, data_bytes,
                               n_tensors, checks_off, layout_off, layout_len, layout_sum)
        _U32.pack_into(self.view, base + 8, SlotState.COMPLETE)
        _U64.pack_into(self.view, base, seq + 1)
        return seq + 1

    def abandon_write(self, index: int) -> None:
        """A write that failed half way: the slot holds nothing."""
        base = _SLOT_BASE + index * _SLOT_BYTES
        _U32.pack_into(self.view, base + 8, SlotState.EMPTY)
        seq = _U64.unpack_from(self.view, base)[0]
        _U64.pack_into(self.view, base, seq + 1 if seq % 2 else seq)

    def set_segment(self, index: int, gen: int, capacity: int) -> None:
        base = _SLOT_BASE + index * _SLOT_BYTES
        _U64.pack_into(self.view, base + _CAPACITY, capacity)
        _U64.pack_into(self.view, base + _GEN, gen)

    def set_checks_seq(self, index: int, seq: int) -> None:
        _U64.pack_into(self.view, _SLOT_BASE + index * _SLOT_BYTES + _CHECKS_SEQ, seq)

    def set_verify(self, index: int, seq: int, state: VerifyState) -> None:
        base = _SLOT_BASE + index * _SLOT_BYTES
        _U32.pack_into(self.view, base + _VERIFY_STATE, state)
        _U64.pack_into(self.view, base + _VERIFY_SEQ, seq)
