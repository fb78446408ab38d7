"""Where a step's old ranks' slots are in this node's memory, for a reshard from memory when the world size changed.

The agent answers a worker's ``parts`` request with :func:`node_parts`: for each old rank of the step, one copy this
node holds (a local rank's own slot, a slot given a peer's replica, or a replica its replica port holds for another
host), as the segment's name and the slot's description. The worker maps them (:func:`map_parts`), checks each
layout document against its checksum and takes the checksums its agent (or the replica's arrival) computed, so the
reshard (:mod:`._memreshard`) reads only the tensors it needs, each checked as it is read. A part this node lacks is
read from another node of the round that holds it, over its replica port (:mod:`._remoteparts`): the agent's answer
says how to reach the ports (:func:`peer_access`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from stead.plugins.ckpt._layout import parse_document
from stead.plugins.ckpt._rankmem import RankMemory
from stead.plugins.ckpt._replicas import Held, ReplicaError, ReplicaMeta
from stead.plugins.ckpt._shm import SegmentNames, VerifyState
from stead.plugins.ckpt.errors import CheckpointError

if TYPE_CHECKING:  # (the agent imports this module, and torch only when a job's worker needs it)
    from stead.plugins.ckpt._mapped import MappedSlot
    from stead.plugins.ckpt._memreshard import SlotPart
    from stead.plugins.ckpt._remoteparts import PeerAccess

__all__ = ["MappedParts", "is_sharded", "map_parts", "node_parts", "peer_access"]

#: a part in a local rank's own slot (a surviving rank's memory), or a peer host's replica
OWN, PEER = "own", "peer"


def node_parts(ranks: Iterable[RankMemory], names: SegmentNames, replicas: Iterable[Held],
               fetched: Mapping[int, set[int]], *, step: int, round_: int) -> list[dict[str, Any]]:
    """One copy per old rank of ``step`` (saved in ``round_``) that this node holds, its own slots first: a slot
    whose checksums its agent has not computed yet, or found corrupt, is left out. Each says whether it holds
    shards (its layout document read, checked)."""
    found: dict[int, dict[str, Any]] = {}
    for state in ranks:
        slot = state.slot_holding(step, round_)
        if slot is None or slot.rank in found or slot.checks_seq != slot.seq or (
                slot.verify_seq == slot.seq and slot.verify_state is VerifyState.CORRUPT):
            continue
        meta = ReplicaMeta.of_slot(slot)
        found[slot.rank] = {"meta": meta.to_json(), "capacity": slot.capacity,
                            "name": names.data(state.local_rank, slot.index, slot.gen),
                            "tier": PEER if step in fetched.get(state.local_rank, ()) else OWN,
                            "sharded": _holds_shards(state.mapping(slot, names), meta)}
    for held in replicas:
        if held.meta.rank not in found:
            found[held.meta.rank] = {"meta": held.meta.to_json(), "name": held.name, "capacity": held.capacity,
                                     "tier": PEER, "sharded": _holds_shards(held.view, held.meta)}
    return [found[rank] for rank in sorted(found)]


def _holds_shards(view: mmap.mmap, meta: ReplicaMeta) -> bool:
    """Whether the slot in ``view`` holds shards; False when its layout document fails its checksum."""
    try:
        doc = parse_document(view[meta.layout_off:meta.layout_off + meta.layout_len], expected_sum=meta.layout_sum,
                             where=f"the slot of rank {meta.rank}")
    except (CheckpointError, ValueError):
        return False
    return any("global_shape" in t for t in doc.tensors)


def is_sharded(part: SlotPart) -> bool:
    """Whether the slot holds shards (FSDP2, DTensor): only such a state is resharded from memory; a replicated
    one (DDP) is taken from an old rank's copy once the copies are shown to be the same, as before."""
    return part.sharded


@dataclasses.dataclass
class MappedParts:
    """The parts a worker mapped, and how many of them are own slots and peers' replicas (close when done)."""

    parts: list[SlotPart]
    own: int
    peer: int
    _maps: list[MappedSlot]
    #: how to reach other nodes' replica ports for the slots this node lacks (None: not said)
    access: PeerAccess | None = None

    def close(self) -> None:
        for mapped in self._maps:
            mapped.close()
        self._maps.clear()


def peer_access(value: Any) -> PeerAccess | None:
    """How the agent said its workers reach other nodes' replica ports (its ``parts`` answer's ``port``): its own
    port's address, the job's token and name, the TLS files when the job has certificates; None when not said."""
    from stead.plugin import Settings, client_tls
    from stead.plugins.ckpt._remoteparts import PeerAccess

    if value is None:
        return None
    try:
        tls = {str(k): str(v) for k, v in dict(value.get("tls") or {}).items()}
        access = PeerAccess(address=str(value["address"]), token=str(value["token"]), job=str(value["job"]),
                            tls=None, timeout_s=float(value["timeout_s"]))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the agent described its replica port badly ({exc}); run the workers and the agent "
                              "with the same stead") from exc
    if not tls:
        return access
    try:
        return dataclasses.replace(access, tls=client_tls(Settings.from_mapping(tls)))
    except Exception as exc:  # (a file this worker cannot read: ConfigError) every rank must reach the agreement
        raise CheckpointError(f"the job's TLS files cannot be used to reach other nodes' replica ports ({exc})") \
            from exc


def map_parts(entries: Any, *, step: int, round_: int, prefix: str, access: PeerAccess | None = None) -> MappedParts:
    """Map the parts the agent named (``prefix``: what its segments' names start with) and check their layout
    documents; CheckpointError says what is wrong with one (the ranks then reshard from disk). ``access``: how to
    reach other nodes' replica ports for the parts this node lacks."""
    from stead.plugins.ckpt._mapped import MappedSlot
    from stead.plugins.ckpt._memreshard import slot_part

    if not isinstance(entries, list):
        raise CheckpointError(f"the agent's list of parts is a {type(entries).__name__}; run the workers and the "
                              "agent with the same stead")
    mapped = MappedParts(parts=[], own=0, peer=0, _maps=[], access=access)
    try:
        for entry in entries:
            try:
                meta = ReplicaMeta.from_json(entry["meta"])
                name, capacity, tier = str(entry["name"]), int(entry["capacity"]), str(entry["tier"])
            except (ReplicaError, KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"the agent described a part badly ({exc}); run the workers and the agent "
                                      "with the same stead") from exc
            where = f"the {'own slot' if tier == OWN else 'replica'} of rank {meta.rank} ({name})"
            if not name.startswith(prefix) or "/" in name or tier not in (OWN, PEER):
                raise CheckpointError(f"{where}: not one of this node's checkpoint segments ({prefix}...)")
            if (meta.step, meta.round) != (step, round_) or capacity < meta.nbytes:
                raise CheckpointError(f"{where}: holds step {meta.step} (round {meta.round}) in {capacity} bytes, "
                                      f"not step {step} (round {round_})")
            view = MappedSlot(name, 0, capacity)
            mapped._maps.append(view)
            doc = parse_document(bytes(view.memory(meta.layout_off, meta.layout_len)), expected_sum=meta.layout_sum,
                                 where=where)
            doc.check_fits(capacity, where=where)
            if (doc.step, doc.round, doc.rank, doc.world) != (meta.step, meta.round, meta.rank, meta.world) \
                    or len(doc.tensors) != meta.n_tensors or meta.checks_off + 8 * meta.n_tensors > capacity:
                raise CheckpointError(f"{where}: its layout document does not describe the slot the agent named")
            sums = memoryview(view.mm)[meta.checks_off:meta.checks_off + 8 * meta.n_tensors].cast("Q")
            try:
                mapped.parts.append(slot_part(doc, list(sums), view.memory, where=where))
            finally:
                sums.release()
            mapped.own += tier == OWN
            mapped.peer += tier == PEER
    except BaseException:
        with contextlib.suppress(Exception):
            mapped.close()
        raise
    return mapped
