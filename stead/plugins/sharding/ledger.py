"""The ledger of one dataset: what remains, what each worker holds, where each round started.

Deterministic, no IO, no clock (``now`` is passed in). Every request goes through a
*decision* method that validates it against the ledger and returns the ops it leads
to (and the answer); :meth:`Ledger.apply` folds an op in. Ops are what the journal
stores, so a restarted master replays exactly the same ledger. Bad input raises
:class:`~stead.core.errors.InvalidRequest` before any op exists: the ledger is unchanged.

Slots. A dataset of ``size`` samples has, per epoch, the slots ``[0, size)``: slot
``o`` is position ``o`` of the epoch's shuffled order (see :mod:`.order`), and a
*part* is an epoch. A streaming source's part is a partition and its slots are the
partition's offsets, from the registered start on (``UNBOUNDED`` stands for "and
everything that will be appended").

Streams. A worker (one rank of one round) reads one *stream*: the ordered list of the
ranges leased to it. Its progress is a single number, how many slots of that list it
has consumed, so the worker and the master agree on a position without listing shards.

Rounds. Each round starts from a set of remaining slots: a checkpoint's cursor when
its ranks restore one, else the whole dataset. It starts once every rank has said
which (restore or first lease), so a rank that is fast to lease cannot start the
round from scratch while another is about to restore. See the package docstring for
the rollback semantics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from stead.plugin import InvalidRequest
from stead.plugins.sharding.intervals import Range, SlotMap, SlotSet
from stead.plugins.sharding.lockstep import split
from stead.plugins.sharding.ops import (
    MAX_LEASE_COUNT,
    UNBOUNDED,
    CursorState,
    DatasetSpec,
    Declared,
    Folded,
    Granted,
    Op,
    PartitionsChanged,
    Released,
    RoundRefused,
    Skipped,
    Started,
    Truncated,
    decode_op,
    decode_ranges,
    encode_op,
)

__all__ = [  # the ops' names are re-exported: callers import the whole vocabulary from here
    "MAX_LEASE_COUNT",
    "UNBOUNDED",
    "Range",
    "CursorState",
    "DatasetSpec",
    "Generation",
    "LeaseAnswer",
    "Ledger",
    "Op",
    "Stream",
    "Tally",
    "decode_op",
    "encode_op",
]

# -- state ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stream:
    """One rank's reading of a round: the ranges leased to it, in order.

    Positions count slots from the round's start. The list keeps only what a later
    cut may still need: a cut folds the prefix it covers into the round's start set
    (positions only move forward), so ``base`` slots in ``dropped`` ranges are gone.
    """

    rank: int
    node_id: str
    nonce: str
    ranges: list[Range] = dataclasses.field(default_factory=list)
    #: slots before the first range of ``ranges`` (folded by a cut), and how many ranges that was
    base: int = 0
    dropped: int = 0
    #: slots leased in all (positions run from 0 to this)
    leased: int = 0
    #: soft state (not journaled): the last progress the worker reported, when, and in which epoch
    consumed: int = 0
    epoch: int = 0
    last_seen: float = 0.0
    dead: str = ""

    @property
    def delivered(self) -> int:
        """Ranges granted so far (what a worker that received everything says it ``has``)."""
        return self.dropped + len(self.ranges)

    def slots_before(self, at: int) -> SlotMap:
        """The slots from position ``base`` up to position ``at``."""
        out = SlotMap()
        at -= self.base
        for part, start, end in self.ranges:
            if at <= 0:
                break
            stop = min(end, start + at)
            out.add(part, start, stop)
            at -= stop - start
        return out

    def slots_after(self, at: int) -> SlotMap:
        """The slots from position ``at`` (at least ``base``) on."""
        out = SlotMap()
        at = max(at - self.base, 0)
        for part, start, end in self.ranges:
            length = end - start
            if at < length:
                out.add(part, start + at, end)
            at = max(at - length, 0)
        return out

    def cut_at(self, at: int) -> None:
        """Forget everything from position ``at`` on."""
        kept: list[Range] = []
        at -= self.base
        for part, start, end in self.ranges:
            if at <= 0:
                break
            kept.append((part, start, min(end, start + at)))
            at -= end - start
        self.ranges = kept
        self.leased = self.base + sum(e - s for _, s, e in kept)

    def fold(self, at: int) -> None:
        """Forget the positions before ``at`` (a cut has moved them into the round's start set)."""
        skip = at - self.base
        whole = 0
        while whole < len(self.ranges) and self.ranges[whole][2] - self.ranges[whole][1] <= skip:
            skip -= self.ranges[whole][2] - self.ranges[whole][1]
            whole += 1
        del self.ranges[:whole]
        self.dropped += whole
        if skip > 0 and self.ranges:
            part, start, end = self.ranges[0]
            self.ranges[0] = (part, start + skip, end)
        self.base = at


@dataclasses.dataclass
class Generation:
    """The current round: where it started and every rank's stream.

    ``start`` moves forward as cursors fold read slots out of it; ``origin`` is the
    set the round really started from, which a lockstep round splits into each
    rank's block of each epoch (:mod:`.lockstep`).
    """

    round: int
    world_size: int
    start: SlotMap
    epoch: int
    digest: str
    streams: dict[int, Stream]
    origin: SlotMap
    lockstep: bool = False
    _blocks: dict[int, dict[int, SlotSet]] = dataclasses.field(default_factory=dict)

    def block(self, rank: int, epoch: int) -> SlotSet:
        """A lockstep round's slots of ``epoch`` for ``rank`` (computed once per epoch)."""
        per_rank = self._blocks.get(epoch)
        if per_rank is None:
            per_rank = self._blocks[epoch] = {r: b[epoch] for r, b in split(self.origin, self.world_size,
                                                                            [epoch]).items()}
        return per_rank[rank]


@dataclasses.dataclass
class _Pending:
    world_size: int
    declared: dict[int, Declared] = dataclasses.field(default_factory=dict)
    cursors: dict[str, CursorState] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Tally:
    """Every sample of a dataset accounted for: ``done`` (read by the steps the job keeps) + ``skipped`` (read by a
    step that was skipped, see :meth:`Ledger.decide_skipped`) + ``unread`` = ``total``. A streaming source's total
    is the records that exist now."""

    total: int
    done: int
    skipped: int
    unread: int


@dataclasses.dataclass(frozen=True)
class LeaseAnswer:
    #: the stream's ranges from position ``have`` of its list (those not delivered yet, then new ones)
    ranges: tuple[Range, ...] = ()
    #: nothing is left to lease in the asked epoch (a closed streaming source: at all)
    exhausted: bool = False
    #: the round waits for these ranks to declare themselves (start iterating or restore)
    waiting_for: tuple[int, ...] = ()


class Ledger:
    """The sharding state of one dataset."""

    def __init__(self, spec: DatasetSpec) -> None:
        self.spec = spec
        #: streaming: partition -> [start, end) of the records known to exist
        self.partitions: dict[int, tuple[int, int]] = {}
        self.closed = False
        self.remaining = self.full()
        self.gen: Generation | None = None
        self.pending: dict[int, _Pending] = {}
        self.refused: dict[int, str] = {}
        #: slots read by a step that was skipped (a numerical fault's batch): read, but trained nothing
        self.skipped = SlotMap()

    # -- the dataset -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    def full(self) -> SlotMap:
        """Every slot of the dataset: where a round starts when nobody restores a cursor."""
        if self.spec.streaming:
            return SlotMap((p, start, UNBOUNDED) for p, (start, _) in self.partitions.items())
        return SlotMap((e, 0, self.spec.size) for e in range(self.spec.epochs))

    def decide_register(self, spec: DatasetSpec, partitions: Mapping[int, tuple[int, int]],
                        closed: bool) -> list[Op]:
        if spec != self.spec:
            raise InvalidRequest(
                f"dataset {spec.name!r} is already registered as a {self.spec.describe()}, not "
                f"{spec.describe()}; register it as it was (same size, shard size, seed, epochs, lockstep), "
                "or give the new definition another name")
        if not spec.streaming:
            return []
        changed: list[tuple[int, int, int]] = []
        for p, (start, end) in sorted(partitions.items()):
            known = self.partitions.get(p)
            if known is None:
                changed.append((p, start, end))
                continue
            if start != known[0]:
                raise InvalidRequest(
                    f"partition {p} of streaming source {spec.name!r} starts at offset {known[0]}, not {start}; "
                    "register each partition with the start offset it was first registered with")
            if end < known[1]:
                raise InvalidRequest(
                    f"partition {p} of streaming source {spec.name!r} went backwards: its end offset is "
                    f"{known[1]}, the update says {end}; offsets only grow: send the partition's current end")
            if end > known[1]:
                changed.append((p, start, end))
        if changed and self.closed:
            raise InvalidRequest(f"streaming source {spec.name!r} was closed: no partition may grow after that; "
                                 "register a new source for new records")
        if changed or (closed and not self.closed):
            return [PartitionsChanged(tuple(changed), closed)]
        return []

    # -- rounds ----------------------------------------------------------------------------------

    def _check_round(self, round_: int) -> None:
        if self.gen is not None and round_ < self.gen.round:
            raise InvalidRequest(
                f"round {round_} of dataset {self.name!r} is over (round {self.gen.round} has started): this "
                "worker belongs to a stopped round; it should exit (stead restarts workers with each round)")
        reason = self.refused.get(round_)
        if reason:
            raise InvalidRequest(reason)

    def decide_declare(self, *, round_: int, rank: int, world_size: int, node_id: str, nonce: str,
                       cursor: CursorState | None) -> list[Op]:
        """A rank says where its round starts (``cursor``; None: wherever the others say, else the beginning)."""
        self._check_round(round_)
        if not 0 <= rank < world_size:
            raise InvalidRequest(f"rank {rank} is outside the world of {world_size} reading dataset {self.name!r}; "
                                 "pass rank and world_size with 0 <= rank < world_size")
        if cursor is not None:
            self._check_cursor(cursor)
        digest = cursor.digest if cursor is not None else ""
        gen = self.gen
        if gen is not None and gen.round == round_:
            self._stream_of(round_, rank, nonce, world_size)  # the same process, alive
            if cursor is not None and digest != gen.digest:
                started = "a different checkpoint's cursor" if gen.digest else "the beginning (no cursor)"
                raise InvalidRequest(
                    f"round {round_} of dataset {self.name!r} already started from {started}: call "
                    "load_state_dict with the same checkpoint on every rank, before any rank iterates")
            return []
        pending = self.pending.get(round_)
        if pending is not None and pending.world_size != world_size:
            raise InvalidRequest(
                f"rank {rank} says round {round_} of dataset {self.name!r} has {world_size} ranks, others said "
                f"{pending.world_size}; every rank must pass the same world_size")
        before = pending.declared.get(rank) if pending else None
        if before is not None:
            if before.nonce != nonce:
                raise self._other_process(round_, rank)
            if cursor is None or before.digest == digest:
                return []
            raise InvalidRequest(
                f"rank {rank} of round {round_} already declared it starts "
                f"{'from another cursor' if before.digest else 'without a cursor (it began iterating)'}; "
                "call load_state_dict once, before iterating")
        known = pending.cursors if pending else {}
        ops: list[Op] = [Declared(round_, rank, world_size, node_id, nonce, digest,
                                  cursor if cursor is not None and digest not in known else None)]
        declared = (len(pending.declared) if pending else 0) + 1
        if declared == world_size:
            digests = {d.digest for d in (pending.declared.values() if pending else ())} | {digest}
            digests.discard("")
            if len(digests) > 1:
                ops.append(RoundRefused(round_, (
                    f"the ranks of round {round_} restored {len(digests)} different cursors of dataset "
                    f"{self.name!r}; restore the same checkpoint on every rank")))
            else:
                ops.append(Started(round_, world_size, digests.pop() if digests else ""))
        return ops

    def waiting_for(self, round_: int) -> tuple[int, ...]:
        pending = self.pending.get(round_)
        if pending is None:
            return ()
        return tuple(r for r in range(pending.world_size) if r not in pending.declared)

    def started(self, round_: int) -> bool:
        return self.gen is not None and self.gen.round == round_

    def _other_process(self, round_: int, rank: int) -> InvalidRequest:
        return InvalidRequest(
            f"rank {rank} of round {round_} already reads dataset {self.name!r} from another process; "
            "create one sampler per dataset and rank (samplers of the same dataset in one process share it)")

    def _stream_of(self, round_: int, rank: int, nonce: str, world_size: int | None = None) -> Stream:
        self._check_round(round_)
        gen = self.gen
        if gen is None or gen.round != round_:
            raise InvalidRequest(f"round {round_} of dataset {self.name!r} has not started: every rank must "
                                 "first iterate or restore (load_state_dict)")
        if world_size is not None and world_size != gen.world_size:
            raise InvalidRequest(f"round {round_} of dataset {self.name!r} has {gen.world_size} ranks, not "
                                 f"{world_size}; every rank must pass the same world_size")
        stream = gen.streams.get(rank)
        if stream is None:
            raise InvalidRequest(f"rank {rank} is not a rank of round {round_} of dataset {self.name!r} "
                                 f"({gen.world_size} ranks)")
        if stream.nonce != nonce:
            raise self._other_process(round_, rank)
        if stream.dead:
            raise InvalidRequest(
                f"rank {rank} of round {round_} lost its leases of dataset {self.name!r} ({stream.dead}); they "
                "went back to the queue for other workers, so this worker must not go on reading: let it exit")
        return stream

    def _check_cursor(self, cursor: CursorState) -> None:
        if cursor.fingerprint != self.spec.fingerprint():
            raise InvalidRequest(
                f"the cursor was saved for another definition of dataset {self.name!r} (this one is a "
                f"{self.spec.describe()}); restore a checkpoint of this dataset, or register it as it was saved")
        if not self.spec.streaming and not 0 <= cursor.epoch <= self.spec.epochs:
            raise InvalidRequest(f"the cursor's epoch {cursor.epoch} is outside dataset {self.name!r}'s "
                                 f"{self.spec.epochs} epochs; pass the cursor state_dict() returned, unchanged")
        remaining = SlotMap(cursor.remaining)
        if any(e <= s for _, s, e in cursor.remaining) or not remaining.issubset(self.full()):
            raise InvalidRequest(f"the cursor of dataset {self.name!r} names slots outside the dataset; "
                                 "pass the cursor state_dict() returned, unchanged")

    # -- leases ----------------------------------------------------------------------------------

    def decide_lease(self, *, round_: int, rank: int, nonce: str, epoch: int, have: int, count: int,
                     consumed: int) -> tuple[list[Op], LeaseAnswer]:
        """Up to ``count`` shards of ``epoch`` for the stream, after the ``have`` ranges it already holds."""
        if not 0 < count <= MAX_LEASE_COUNT:
            raise InvalidRequest(f"a lease asks for {count} shards; ask for 1 to {MAX_LEASE_COUNT}")
        stream = self._stream_of(round_, rank, nonce)
        self._check_progress(stream, round_, consumed)
        if not stream.dropped <= have <= stream.delivered:
            raise InvalidRequest(
                f"rank {rank} of round {round_} says it holds {have} leases of dataset {self.name!r}, the master "
                f"granted {stream.delivered}; the worker talks to another job's master or store: restart it")
        if have < stream.delivered:  # the reply to an earlier call was lost: the same ranges again
            return [], LeaseAnswer(ranges=tuple(stream.ranges[have - stream.dropped:]))
        if not self.spec.streaming and epoch < 0:
            raise InvalidRequest(f"epoch {epoch} of dataset {self.name!r} does not exist; epochs count from 0")
        granted = self._take(epoch, count, rank)
        if granted:
            return [Granted(round_, rank, tuple(granted))], LeaseAnswer(ranges=tuple(granted))
        return [], LeaseAnswer(exhausted=self._exhausted(epoch, rank))

    def _available(self, epoch: int, rank: int) -> SlotSet:
        """What ``rank`` may lease of ``epoch``: what remains of it (of its block, in a lockstep round)."""
        left = self.remaining.part(epoch)
        gen = self.gen
        if gen is not None and gen.lockstep:
            return left.intersection(gen.block(rank, epoch))
        return left

    def _take(self, epoch: int, count: int, rank: int) -> list[Range]:
        """Up to ``count`` pieces (cut at shard boundaries), contiguous ones merged; nothing is changed here."""
        align = self.spec.shard_size
        if not self.spec.streaming:
            out: list[Range] = []
            if epoch >= self.spec.epochs:
                return out
            for start, end in self._available(epoch, rank).ranges():  # lowest slots first
                boundary = (start // align + 1) * align  # the end of the first (maybe partial) shard
                shards = 1 if end <= boundary else 1 + -(-(end - boundary) // align)
                taken = min(count, shards)
                out.append((epoch, start, min(end, boundary + (taken - 1) * align)))
                count -= taken
                if not count:
                    break
            return out
        pieces: list[Range] = []
        parts = [p for p in sorted(self.partitions) if self.remaining.has(p)]
        scratch = {p: self.remaining.part(p).copy() for p in parts}
        progress = True
        while len(pieces) < count and progress:
            progress = False
            for p in parts:  # round robin: every partition moves forward
                if len(pieces) >= count:
                    break
                piece = scratch[p].take(align=align, limit=self.partitions[p][1])
                if piece is not None:
                    pieces.append((p, *piece))
                    progress = True
        merged: list[Range] = []
        for part, start, end in pieces:
            if merged and merged[-1][0] == part and merged[-1][2] == start:
                merged[-1] = (part, merged[-1][1], end)
            else:
                merged.append((part, start, end))
        return merged

    def _exhausted(self, epoch: int, rank: int) -> bool:
        if self.spec.streaming:
            return self.closed and not any(
                self.remaining.part(p).intersects(start, end) for p, (start, end) in self.partitions.items())
        return epoch >= self.spec.epochs or not self._available(epoch, rank)

    def _check_progress(self, stream: Stream, round_: int, consumed: int) -> None:
        if not 0 <= consumed <= stream.leased:
            raise InvalidRequest(
                f"rank {stream.rank} of round {round_} reports {consumed} samples of dataset {self.name!r} "
                f"consumed, but only {stream.leased} were leased to it; report only samples of shards leased "
                "to this worker (the sampler counts them for you)")

    def decide_report(self, *, round_: int, rank: int, nonce: str, consumed: int,
                      release_rest: bool) -> list[Op]:
        stream = self._stream_of(round_, rank, nonce)
        self._check_progress(stream, round_, consumed)
        if release_rest and consumed < stream.leased:
            self._check_after_cut(stream, round_, consumed)
            return [Truncated(round_, rank, consumed)]
        return []

    def _check_after_cut(self, stream: Stream, round_: int, at: int) -> None:
        if at < stream.base:
            raise InvalidRequest(
                f"rank {stream.rank} of round {round_} is at position {at} of dataset {self.name!r}, before the "
                f"position {stream.base} its last checkpoint's cursor was cut at; positions only move forward: "
                "pass state_dict(consumed=...) counts that never decrease")

    def note_progress(self, round_: int, rank: int, *, consumed: int, epoch: int, now: float) -> None:
        """Soft state, not journaled: renews the stream's leases."""
        stream = self.gen.streams.get(rank) if self.gen is not None and self.gen.round == round_ else None
        if stream is not None and not stream.dead:
            stream.consumed = max(stream.consumed, min(consumed, stream.leased))
            stream.epoch = epoch
            stream.last_seen = now

    def decide_expire(self, *, now: float, timeout_s: float) -> list[Op]:
        """Streams silent for ``timeout_s``: dead, their unconsumed leases back to the queue."""
        if self.gen is None:
            return []
        return [Released(self.gen.round, s.rank, s.consumed,
                         f"no report for {timeout_s:g} s (shard_lease_timeout_s)")
                for s in self.gen.streams.values() if not s.dead and now - s.last_seen > timeout_s]

    def decide_failed(self, *, node_id: str, round_: int | None = None, rank: int | None = None,
                      reason: str) -> list[Op]:
        """A worker (``rank``) or a whole node failed: its streams of the current round die."""
        gen = self.gen
        if gen is None or (round_ is not None and round_ != gen.round):
            return []
        return [Released(gen.round, s.rank, s.consumed, reason) for s in gen.streams.values()
                if not s.dead and s.node_id == node_id and (rank is None or s.rank == rank)]

    # -- skipped steps -----------------------------------------------------------------------------

    def decide_skipped(self, *, round_: int, rank: int, step: int, ranges: Sequence[Range]) -> list[Op]:
        """Rank ``rank`` of ``round_`` skipped step ``step``, which held ``ranges`` (its note says so).

        Recorded as skipped, beside what the steps consumed. A round that starts from a cursor holding some of
        them reads them again (the rollback went back before the skipped step): they are no longer skipped, and the
        round that reads them says again whether it skips them. A note of an older round that comes after such a
        round started is recorded without what that round reads again."""
        if round_ < 0 or rank < 0 or step < 0:
            raise InvalidRequest(f"a skipped step of dataset {self.name!r} needs round, rank and step >= 0, got "
                                 f"round {round_}, rank {rank}, step {step}")
        gen = self.gen
        if gen is None or round_ > gen.round:
            raise InvalidRequest(f"round {round_} of dataset {self.name!r} has not started: its ranks read nothing "
                                 "that a step could skip")
        for part, start, end in ranges:
            problem = self._range_problem(part, start, end)
            if problem:
                raise InvalidRequest(f"the skipped step {step} of rank {rank} names {problem} of dataset "
                                     f"{self.name!r}; a step names the slots its sampler handed out")
        return [Skipped(round_, rank, step, tuple(ranges))] if ranges else []

    def _range_problem(self, part: int, start: int, end: int) -> str:
        if not 0 <= start < end:
            return f"slots {start}-{end} (need 0 <= start < end)"
        if self.spec.streaming:
            known = self.partitions.get(part)
            if known is None:
                return f"partition {part}, unknown"
            if start < known[0] or end > known[1]:
                return f"offsets {start}-{end} of partition {part}, outside its records {known[0]}-{known[1]}"
            return ""
        if not 0 <= part < self.spec.epochs:
            return f"epoch {part} (the dataset has {self.spec.epochs})"
        if end > self.spec.size:
            return f"slots {start}-{end} of epoch {part}, past its {self.spec.size} samples"
        return ""

    def tally(self) -> Tally:
        """Where every sample stands: done + skipped + unread = total (see :class:`Tally`)."""
        known = (SlotMap((p, s, e) for p, (s, e) in self.partitions.items()) if self.spec.streaming
                 else self.full())
        gen = self.gen
        unread = known if gen is None else gen.start.difference(
            self._heads(gen, [gen.streams[r].consumed if r in gen.streams else 0 for r in range(gen.world_size)]))
        skipped = known.difference(known.difference(self.skipped))  # read (whatever the last reports said)
        unread_known = known.difference(known.difference(unread)).difference(skipped)
        return Tally(total=known.total, done=known.total - unread_known.total - skipped.total,
                     skipped=skipped.total, unread=unread_known.total)

    # -- cursors ---------------------------------------------------------------------------------

    def decide_cut(self, *, round_: int, consumed: Sequence[int],
                   epochs: Sequence[int]) -> tuple[list[Op], CursorState]:
        """The cursor of a checkpoint taken when rank ``r`` had consumed ``consumed[r]`` slots of its stream."""
        self._check_round(round_)
        gen = self.gen
        if gen is None or gen.round != round_:
            raise InvalidRequest(f"round {round_} of dataset {self.name!r} has not started: every rank must "
                                 "first iterate or restore (load_state_dict)")
        if len(consumed) != gen.world_size or len(epochs) != gen.world_size:
            raise InvalidRequest(f"a cursor of round {round_} needs the progress of its {gen.world_size} ranks, "
                                 f"got {len(consumed)}; call state_dict() on every rank together")
        for rank, at in enumerate(consumed):
            self._check_progress(gen.streams[rank], round_, at)
            self._check_after_cut(gen.streams[rank], round_, at)
        cursor = self.cursor_after(self._heads(gen, consumed), epochs)
        moved = any(at > gen.streams[rank].base for rank, at in enumerate(consumed))
        return ([Folded(round_, tuple(consumed))] if moved else []), cursor

    def heads(self, round_: int, rank: int, nonce: str, consumed: int) -> SlotMap:
        """The slots ``rank`` read of its stream's first ``consumed`` (a static partition's cut: no master)."""
        stream = self._stream_of(round_, rank, nonce)
        self._check_progress(stream, round_, consumed)
        return stream.slots_before(consumed)

    def cursor_after(self, heads: SlotMap, epochs: Sequence[int]) -> CursorState:
        """The cursor once the ranks of the current round have read ``heads`` and are in ``epochs``.

        A lockstep round's ranks have all finished the epochs before ``min(epochs)``:
        the few slots those epochs left out (fewer than the world size each) are not
        carried on, as ``DistributedSampler(drop_last=True)`` drops them.
        """
        gen = self.gen
        assert gen is not None
        remaining = gen.start.difference(heads)
        epoch = min(max(min(epochs), 0), self.spec.epochs) if not self.spec.streaming else 0
        if gen.lockstep:
            remaining = SlotMap(r for r in remaining.ranges() if r[0] >= epoch)
        return CursorState(self.spec.fingerprint(), epoch, tuple(remaining.ranges()))

    @staticmethod
    def _heads(gen: Generation, consumed: Sequence[int]) -> SlotMap:
        """What every stream had read at these positions."""
        heads = SlotMap()
        for rank, at in enumerate(consumed):
            heads.update(gen.streams[rank].slots_before(at))
        return heads

    # -- apply -----------------------------------------------------------------------------------

    def apply(self, op: Op, *, now: float = 0.0) -> None:
        """Fold ``op`` into the ledger (``now`` starts the lease clock of streams it creates)."""
        match op:
            case PartitionsChanged():
                for p, start, end in op.partitions:
                    if p not in self.partitions:
                        self.remaining.add(p, start, UNBOUNDED)
                        if self.gen is not None:
                            self.gen.start.add(p, start, UNBOUNDED)
                    self.partitions[p] = (start, end)
                self.closed = self.closed or op.closed
            case Declared():
                pending = self.pending.setdefault(op.round, _Pending(op.world_size))
                pending.declared[op.rank] = op
                if op.cursor is not None:
                    pending.cursors[op.digest] = op.cursor
            case Started():
                pending = self.pending.pop(op.round, _Pending(op.world_size))
                if op.digest:
                    cursor = pending.cursors[op.digest]
                    origin, first_epoch = SlotMap(cursor.remaining), cursor.epoch
                else:
                    origin, first_epoch = self.full(), 0
                streams = {r: Stream(rank=r, node_id=d.node_id, nonce=d.nonce, epoch=first_epoch, last_seen=now)
                           for r, d in pending.declared.items()}
                self.gen = Generation(op.round, op.world_size, origin, first_epoch, op.digest, streams,
                                      origin=origin.copy(), lockstep=self.spec.lockstep and not self.spec.streaming)
                self.remaining = origin.copy()
                self.skipped = self.skipped.difference(origin)  # read again by this round: it says whether it skips
                for old in [r for r in self.pending if r < op.round]:
                    del self.pending[old]
            case RoundRefused():
                self.pending.pop(op.round, None)
                self.refused[op.round] = op.reason
            case Granted():
                stream = self._live(op.round, op.rank)
                for part, start, end in op.ranges:
                    self.remaining.remove(part, start, end)
                    stream.ranges.append((part, start, end))
                    stream.leased += end - start
            case Truncated():
                stream = self._live(op.round, op.rank)
                self.remaining.update(stream.slots_after(op.at))
                stream.cut_at(op.at)
            case Folded():
                gen = self.gen
                assert gen is not None and gen.round == op.round, f"op for round {op.round} outside its round"
                gen.start = gen.start.difference(self._heads(gen, op.positions))
                for rank, at in enumerate(op.positions):
                    gen.streams[rank].fold(at)
            case Released():
                stream = self._live(op.round, op.rank)
                if not stream.dead:
                    self.remaining.update(stream.slots_after(op.at))
                    stream.dead = op.reason or "released"
            case Skipped():
                skipped = SlotMap(op.ranges)
                if self.gen is not None and op.round < self.gen.round:
                    skipped = skipped.difference(self.gen.origin)
                self.skipped.update(skipped)

    def _live(self, round_: int, rank: int) -> Stream:
        assert self.gen is not None and self.gen.round == round_, f"op for round {round_} outside its round"
        return self.gen.streams[rank]

    # -- snapshot ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        gen = self.gen
        return {
            "spec": dataclasses.asdict(self.spec),
            "partitions": [[p, s, e] for p, (s, e) in sorted(self.partitions.items())],
            "closed": self.closed,
            "remaining": self.remaining.to_json(),
            "gen": None if gen is None else {
                "round": gen.round, "world_size": gen.world_size, "start": gen.start.to_json(),
                "epoch": gen.epoch, "digest": gen.digest, "origin": gen.origin.to_json(),
                "streams": [[s.rank, s.node_id, s.nonce, [list(r) for r in s.ranges], s.base, s.dropped, s.leased,
                             s.consumed, s.epoch, s.dead] for s in gen.streams.values()],
            },
            "pending": [{"round": r, "world_size": p.world_size,
                         "declared": [encode_op(dataclasses.replace(d, cursor=None)) for d in p.declared.values()],
                         "cursors": [[c.fingerprint, c.epoch, c.remaining] for c in p.cursors.values()]}
                        for r, p in sorted(self.pending.items())],
            "refused": [[r, why] for r, why in sorted(self.refused.items())],
            "skipped": self.skipped.to_json(),
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any], *, now: float) -> Ledger:
        ledger = cls(DatasetSpec(**body["spec"]))
        ledger.partitions = {int(p): (int(s), int(e)) for p, s, e in body["partitions"]}
        ledger.closed = bool(body["closed"])
        ledger.remaining = SlotMap(decode_ranges(body["remaining"]))
        raw = body["gen"]
        if raw is not None:
            streams = {}
            for rank, node_id, nonce, ranges, base, dropped, leased, consumed, epoch, dead in raw["streams"]:
                streams[rank] = Stream(rank=rank, node_id=node_id, nonce=nonce, ranges=list(decode_ranges(ranges)),
                                       base=base, dropped=dropped, leased=leased, consumed=consumed, epoch=epoch,
                                       last_seen=now, dead=dead)
            start = SlotMap(decode_ranges(raw["start"]))
            ledger.gen = Generation(raw["round"], raw["world_size"], start, raw["epoch"], raw["digest"], streams,
                                    origin=SlotMap(decode_ranges(raw["origin"])) if "origin" in raw else start.copy(),
                                    lockstep=ledger.spec.lockstep and not ledger.spec.streaming)
        for raw_pending in body["pending"]:
            pending = ledger.pending.setdefault(int(raw_pending["round"]), _Pending(int(raw_pending["world_size"])))
            for entry in raw_pending["declared"]:
                op = decode_op(entry)
                if not isinstance(op, Declared):
                    raise ValueError(f"a pending declaration of the snapshot is a {type(op).__name__}")
                pending.declared[op.rank] = op
            for fingerprint, epoch, remaining in raw_pending["cursors"]:
                cursor = CursorState(fingerprint, epoch, decode_ranges(remaining))
                pending.cursors[cursor.digest] = cursor
        ledger.refused = {int(r): str(why) for r, why in body["refused"]}
        ledger.skipped = SlotMap(decode_ranges(body.get("skipped", ())))
        return ledger
