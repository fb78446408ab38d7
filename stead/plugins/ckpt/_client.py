"""The agent's client of the master's CheckpointService (protobuf stays in this module)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from stead.plugin import RpcConnection
from stead.plugins.ckpt._proto.stead import v1 as proto
from stead.plugins.ckpt.events import CheckpointCorrupt

__all__ = ["CheckpointClient", "Committed", "PeerCopy", "Replicated", "Saved", "corrupt_to_proto"]

#: the most of a corrupt copy's detail a report carries (the master takes up to MAX_EVIDENCE_CHARS)
_CORRUPT_DETAIL_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class Saved:
    """A rank's state for a report: the newest step it passed, the steps it holds, and what they took.

    ``seconds``: step -> seconds (memory: the copy in save(); disk: writing the step's files).
    """

    step: int
    held: frozenset[int] = frozenset()
    seconds: Mapping[int, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PeerCopy:
    """A node that holds (a source) or is to hold (a target) replicas: for a source, of ``rank``'s ``step``."""

    node_id: str
    address: str
    rank: int = -1
    step: int = -1
    round: int = -1
    world: int = 0


@dataclasses.dataclass(frozen=True)
class Replicated:
    """What the master says of replication (:mod:`._replicated`): R and X as (step, round), and whether the workers
    keep their slots (and the holders R's copy)."""

    replicated: tuple[int, int] = (-1, -1)
    replicating: tuple[int, int] = (-1, -1)
    keep: bool = False


@dataclasses.dataclass(frozen=True)
class Committed:
    step: int = -1
    round: int = 0
    round_step: int = -1
    persisted_step: int = -1
    released: Mapping[int, int] = dataclasses.field(default_factory=dict)
    #: a memory report's answer: where this node sends its ranks' replicas (None: not said)
    targets: tuple[PeerCopy, ...] | None = None
    #: the nodes that hold replicas of the committed step of the ranks asked for
    sources: tuple[PeerCopy, ...] = ()
    #: None: the master did not say (one of before "commit means replicated")
    replication: Replicated | None = None
    #: asked with ``warning``: the step (and its round) every warned node of the round persists; -1: none
    warning: tuple[int, int] = (-1, -1)


def _replicated(value: proto.Replication | None) -> Replicated | None:
    if value is None:
        return None
    return Replicated(replicated=(value.replicated_step, value.replicated_round),
                      replicating=(value.replicating_step, value.replicating_round), keep=value.keep)


def _peers(values: Sequence[proto.ReplicaPeer]) -> tuple[PeerCopy, ...]:
    return tuple(PeerCopy(node_id=p.node_id, address=p.address, rank=p.rank, step=p.step, round=p.round,
                          world=p.world) for p in values)


class CheckpointClient:
    """Calls CheckpointService over an open :class:`RpcConnection` (token and error mapping included)."""

    def __init__(self, conn: RpcConnection, *, node_id: str, incarnation: int) -> None:
        self._conn = conn
        self.node_id = node_id
        self.incarnation = incarnation

    @property
    def _stub(self) -> proto.CheckpointServiceStub:
        return proto.CheckpointServiceStub(self._conn.channel)

    async def report_saved(self, *, round_: int, world_size: int, tier: str, ranks: Mapping[int, Saved],
                           path: str = "", host: str = "", replica_address: str = "",
                           replicas: Sequence[tuple[int, int, int, int, int]] = ()) -> Committed:
        """``replicas``: (rank, world, step, round, bytes) of each replica this node holds."""
        request = proto.ReportSavedRequest(
            node_id=self.node_id, incarnation=self.incarnation, round=round_, world_size=world_size, tier=tier,
            ranks=[proto.RankSaved(rank=r, step=s.step, held_steps=sorted(s.held), seconds=dict(s.seconds))
                   for r, s in sorted(ranks.items())],
            path=path, host=host, replica_address=replica_address,
            replicas=[proto.ReplicaHeld(rank=r, world=w, step=s, round=o, bytes=b) for r, w, s, o, b in replicas])
        with self._conn.errors("CheckpointService.ReportSaved"):
            reply = await self._stub.report_saved(request, timeout=self._conn.call_timeout_s)
        return Committed(round=round_, round_step=reply.committed_step,
                         released={r.rank: r.step for r in reply.released},
                         targets=_peers(reply.replica_targets) if tier == "memory" else None,
                         replication=_replicated(reply.replication))

    async def get_committed(self, *, round_: int, after_step: int = -1, wait_s: float = 0.0,
                            ranks: Sequence[int] = (), replica_ranks: Sequence[int] = (),
                            replicated: Replicated | None = None, warning: bool = False) -> Committed:
        """``replicated``: what the caller knows of replication; a wait also ends when R or the keeping changes.
        ``warning``: the caller was warned of the job's stop (the reply's ``warning`` is the step to persist)."""
        request = proto.GetCommittedRequest(node_id=self.node_id, round=round_, after_step=after_step, wait_s=wait_s,
                                            ranks=list(ranks), replica_ranks=list(replica_ranks),
                                            replicated_step=replicated.replicated[0] if replicated else None,
                                            replicated_round=replicated.replicated[1] if replicated else None,
                                            keep=replicated.keep if replicated else False, warning=warning)
        with self._conn.errors("CheckpointService.GetCommitted"):
            reply = await self._stub.get_committed(request, timeout=wait_s + self._conn.call_timeout_s)
        return Committed(step=reply.step, round=reply.round, round_step=reply.round_step,
                         persisted_step=reply.persisted_step, released={r.rank: r.step for r in reply.released},
                         sources=_peers(reply.replica_sources), replication=_replicated(reply.replication),
                         warning=(reply.warning_step, reply.warning_round) if warning else (-1, -1))

    async def report_restored(self, *, round_: int, world_size: int, rank: int, step: int, tier: str,
                              parts: tuple[int, int, int] = (0, 0, 0)) -> None:
        """``parts``: for a reshard from memory, the old ranks' slots read from the node's own slots, from replicas it
        holds, and from other nodes."""
        request = proto.ReportRestoredRequest(node_id=self.node_id, round=round_, world_size=world_size, rank=rank,
                                              step=step, tier=tier, reshard_own=parts[0], reshard_peer=parts[1],
                                              reshard_remote=parts[2])
        with self._conn.errors("CheckpointService.ReportRestored"):
            await self._stub.report_restored(request, timeout=self._conn.call_timeout_s)

    async def report_corrupt(self, report: CheckpointCorrupt) -> None:
        """Report a copy that failed its checksums, as the event the master records for it."""
        with self._conn.errors("CheckpointService.ReportCorrupt"):
            await self._stub.report_corrupt(corrupt_to_proto(report), timeout=self._conn.call_timeout_s)


def corrupt_to_proto(report: CheckpointCorrupt) -> proto.ReportCorruptRequest:
    """The ReportCorrupt message of ``report`` (the message and the event spell their fields the same way)."""
    return proto.ReportCorruptRequest(node_id=report.node_id, rank=report.rank, step=report.step, tier=report.tier,
                                      detail=report.detail[:_CORRUPT_DETAIL_CHARS])
