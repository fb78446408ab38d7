"""Old ranks' slots held only on other nodes, for a reshard from memory: where they are, and their tensors read
over those nodes' replica ports.

When the world size changed and a rank's node lacks some old rank's slot of the step, another node of the new
round may hold it (its own slot, or a replica its port holds). The ranks say which old slots their nodes hold and
where their ports are through the restore's own agreement (:func:`locate`: MIN all-reduces on the process group,
as every step of a restore): every rank of the round is alive and knows its node's memory now, where the master
knows only what the last reports said, and of the replicas alone. Each rank then opens a :class:`RemoteSlot` per
old slot it lacks: the slot's checksums and layout document first (the layout checked against its checksum and
description), then, as torch.distributed.checkpoint's planner asks, the byte ranges of the tensors it needs, each
checked against its checksum before any byte of it is kept (:func:`._memreshard.read_tensor`). A part that cannot
be reached or fails a check makes every rank reshard from disk instead.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from stead.plugins.ckpt._group import Group
from stead.plugins.ckpt._layout import parse_document
from stead.plugins.ckpt._memreshard import SlotPart, slot_part
from stead.plugins.ckpt._replicas import ReplicaMeta, check_layout
from stead.plugins.ckpt._replicawire import Conn, ReplicaError, connect
from stead.plugins.ckpt.errors import CheckpointError

__all__ = ["PeerAccess", "RemoteSlot", "locate", "with_other_nodes"]

log = structlog.get_logger("stead.ckpt")

#: what a rank without the value puts in a MIN all-reduce (above any rank, world size or byte)
_NONE = 1 << 62
#: the most bytes of a replica port's address the ranks exchange ("[v6 address]:port" fits)
_ADDRESS_BYTES = 96
#: the largest old world whose slots are located over the process group (one int64 per old rank)
_MAX_OLD_WORLD = 1 << 16


@dataclasses.dataclass(frozen=True)
class PeerAccess:
    """How this rank's node reaches other nodes' replica ports: its own port's address ("" when it has none), the
    job's token and name (the ports' proof), the TLS context when the job has certificates, and the timeout."""

    address: str
    token: str
    job: str
    tls: ssl.SSLContext | None
    timeout_s: float


class RemoteSlot:
    """One old rank's slot on another node, read over that node's replica port (one connection, many reads; the
    slots of one node share one: ``via``, another slot on the same port)."""

    def __init__(self, address: str, access: PeerAccess, *, rank: int, step: int, round_: int,
                 via: RemoteSlot | None = None) -> None:
        self.address, self.rank, self.step, self.round = address, rank, step, round_
        self.where = f"the slot of rank {rank} on the node at {address}"
        self._conn: Conn | None = via._conn if via is not None and via.address == address else \
            connect(address, token=access.token, job=access.job, tls=access.tls, timeout_s=access.timeout_s)
        #: bytes of tensors read (for the logs and tests)
        self.read_bytes = 0

    def part(self) -> SlotPart:
        """The slot as a reshard reads it: its head fetched and checked now, its tensors read as they are asked
        for. ReplicaError when it cannot be read or its layout fails its checks."""
        answer = self._request({"op": "head", "rank": self.rank, "step": self.step, "round": self.round})
        meta = ReplicaMeta.from_json(answer.get("meta"))
        if (meta.rank, meta.step, meta.round) != (self.rank, self.step, self.round):
            raise ReplicaError(f"{self.where}: step {meta.step} of rank {meta.rank} (round {meta.round}) came for "
                               f"step {self.step}")
        head = bytearray(meta.nbytes - meta.checks_off)
        self._receive(memoryview(head))
        check_layout(memoryview(head)[meta.layout_off - meta.checks_off:], meta, capacity=meta.nbytes,
                     where=self.where)
        doc = parse_document(bytes(head[meta.layout_off - meta.checks_off:]), expected_sum=meta.layout_sum,
                             where=self.where)
        sums = memoryview(head)[:8 * meta.n_tensors].cast("Q")
        try:
            return slot_part(doc, list(sums), self.read, where=self.where)
        finally:
            sums.release()

    def read(self, offset: int, nbytes: int) -> bytearray:
        """Bytes ``offset``.. ``offset + nbytes`` of the slot (checked by the caller against the tensor's sum)."""
        self._request({"op": "read", "rank": self.rank, "step": self.step, "round": self.round,
                       "ranges": [[offset, nbytes]]})
        got = bytearray(nbytes)
        self._receive(memoryview(got))
        self.read_bytes += nbytes
        return got

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._conn is None:
            raise ReplicaError(f"{self.where}: its connection was closed")
        try:
            self._conn.send_line(request)
            answer = self._conn.json()
        except (OSError, ReplicaError) as exc:
            raise ReplicaError(f"{self.where}: the holder went away ({exc}); the step is resharded from disk") \
                from None
        if not answer.get("ok"):
            raise ReplicaError(f"{self.where}: the holder refused a {request['op']}: "
                               f"{answer.get('error', '(no reason given)')}")
        return answer

    def _receive(self, target: memoryview) -> None:
        """The answer's bytes into ``target``, then the holder's word that the slot did not change meanwhile."""
        assert self._conn is not None
        try:
            self._conn.read_into(target)
            intact = self._conn.json().get("intact") is True
        except (OSError, ReplicaError) as exc:
            raise ReplicaError(f"{self.where}: the holder went away mid-read ({exc}); the step is resharded from "
                               "disk") from None
        if not intact:
            raise ReplicaError(f"{self.where}: the slot was saved over while it was read; the step is resharded "
                               "from disk")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def locate(group: Group, held: Sequence[int] | None, saved: int, *, rank: int, address: str
           ) -> dict[int, str] | None:
    """old rank -> the replica port of a node of this round that holds its slot, for each old rank of a world of
    ``saved`` ranks whose slot this rank's node lacks (``held``: the old ranks it holds; None: its parts are
    unusable, it neither serves nor reshards). Every rank calls it (two all-reduces); None on every rank when some
    rank lacks a slot that no node (with a replica port) holds."""
    if not 0 < saved <= _MAX_OLD_WORLD:
        raise CheckpointError(f"a step of {saved} ranks is not located over the process group")
    encoded = address.encode()
    serving = held is not None and 0 < len(encoded) <= _ADDRESS_BYTES
    mine = set(held or ())
    holders = group.min([rank if serving and old in mine else _NONE for old in range(saved)])
    ports = sorted({h for h in holders if h != _NONE})
    usable = held is not None and all(old in mine or holders[old] != _NONE for old in range(saved))
    row = [*encoded, *([0] * (_ADDRESS_BYTES - len(encoded)))] if serving else [_NONE] * _ADDRESS_BYTES
    reduced = group.min([*(v for h in ports for v in (row if h == rank else [_NONE] * _ADDRESS_BYTES)),
                         1 if usable else 0])
    if reduced[-1] != 1:
        return None
    addresses = {h: bytes(b for b in reduced[i * _ADDRESS_BYTES:(i + 1) * _ADDRESS_BYTES] if b).decode()
                 for i, h in enumerate(ports)}
    return {old: addresses[holders[old]] for old in range(saved) if old not in mine}


def with_other_nodes(group: Group, held: Sequence[SlotPart] | None, access: PeerAccess | None, *, rank: int,
                     world: int, step: int, round_: int, remote: list[RemoteSlot],
                     report: Callable[[int, str, str], None]) -> list[SlotPart] | None:
    """Every old rank's slot of ``step`` (saved in ``round_``): those this rank's node holds (``held``: None without
    an agent), and each it lacks read from a node of the round that holds it (opened into ``remote``, its head
    checked); None on every rank when the step was not saved by another world size as a sharded state, or some rank
    lacks a slot no node holds or cannot read it (``report(step, tier, detail)`` says why). Every rank calls it,
    once the ranks found that not every rank's node holds every slot."""
    parts = list(held or ())
    worlds = {p.doc.world for p in parts}
    bad = held is None or len(worlds) > 1 or not all(p.sharded for p in parts)
    saved = next(iter(worlds)) if len(worlds) == 1 else _NONE
    lowest, negated_highest, fine = group.min([saved, -saved if saved != _NONE else _NONE, 0 if bad else 1])
    if not fine or lowest in (_NONE, world) or lowest != -negated_highest:
        return None  # a state to reshard from disk, or one the ranks restore as before
    try:
        where = locate(group, [p.rank for p in parts], lowest, rank=rank,
                       address=access.address if access is not None else "")
    except CheckpointError as exc:
        log.info("ckpt_reshard_not_from_memory", step=step, rank=rank, reason=str(exc))
        return None
    if where is None:
        return None
    failure = ""
    found = list(parts)
    ports: dict[str, RemoteSlot] = {}  # one connection per port this rank reads from
    for old, address in sorted(where.items()):
        try:
            if access is None:
                raise CheckpointError("the agent gave no way to reach other nodes' replica ports")
            remote.append(RemoteSlot(address, access, rank=old, step=step, round_=round_, via=ports.get(address)))
            ports.setdefault(address, remote[-1])
            found.append(remote[-1].part())
        except Exception as exc:  # whatever stopped it, every rank must reach the agreement below
            failure = str(exc) if isinstance(exc, (CheckpointError, OSError)) else repr(exc)
            break
    if failure:
        report(step, "memory", failure)
    return found if group.agree(not failure) else None
