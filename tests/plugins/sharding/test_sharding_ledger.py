"""The ledger's decisions: leases on demand, rounds, cursors, rollback, bad input (pure, no IO)."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stead.core.errors import InvalidRequest
from stead.plugins.sharding.intervals import SlotMap
from stead.plugins.sharding.ledger import (
    UNBOUNDED,
    CursorState,
    DatasetSpec,
    LeaseAnswer,
    Ledger,
    Op,
    Range,
    Tally,
    decode_op,
    encode_op,
)
from stead.plugins.sharding.lockstep import left_out, split

SPEC = DatasetSpec(name="ids", shard_size=4, size=10, seed=3, epochs=2)


def _apply(ledger: Ledger, ops: Sequence[Op], now: float = 0.0) -> None:
    for op in ops:
        assert decode_op(encode_op(op)) == op  # every op survives the journal
        ledger.apply(op, now=now)


def _declare(ledger: Ledger, round_: int, world: int, cursor: CursorState | None = None,
             ranks: Sequence[int] | None = None) -> None:
    for rank in ranks if ranks is not None else range(world):
        _apply(ledger, ledger.decide_declare(round_=round_, rank=rank, world_size=world, node_id=f"node-{rank // 2}",
                                             nonce=f"p{round_}.{rank}", cursor=cursor))


def _lease(ledger: Ledger, round_: int, rank: int, *, have: int, count: int = 1, epoch: int = 0,
           consumed: int = 0) -> LeaseAnswer:
    ops, answer = ledger.decide_lease(round_=round_, rank=rank, nonce=f"p{round_}.{rank}", epoch=epoch, have=have,
                                      count=count, consumed=consumed)
    _apply(ledger, ops)
    return answer


def _cut(ledger: Ledger, *, round_: int, consumed: Sequence[int], epochs: Sequence[int]) -> CursorState:
    ops, cursor = ledger.decide_cut(round_=round_, consumed=consumed, epochs=epochs)
    _apply(ledger, ops)
    again_ops, again = ledger.decide_cut(round_=round_, consumed=consumed, epochs=epochs)
    assert again == cursor and again_ops == []  # every rank asks: the same cursor, folded once
    return cursor


def _slots(ranges: Sequence[Range]) -> list[tuple[int, int]]:
    return [(p, i) for p, s, e in ranges for i in range(s, e)]


def test_shards_are_leased_on_demand_so_a_faster_rank_reads_more() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 2)
    fast: list[Range] = []
    while not (answer := _lease(ledger, 1, 0, have=len(fast))).exhausted:
        fast.extend(answer.ranges)
        if len(fast) == 1:
            slow = _lease(ledger, 1, 1, have=0).ranges
    assert sorted(_slots(fast) + _slots(slow)) == [(0, i) for i in range(10)]
    assert len(_slots(fast)) > len(_slots(slow))
    assert all(e - s <= 4 and s // 4 == (e - 1) // 4 for _, s, e in fast)  # one shard at a time, as asked
    assert _lease(ledger, 1, 1, have=1).exhausted
    assert _lease(ledger, 1, 1, have=1, epoch=1, count=10).ranges == ((1, 0, 10),)  # contiguous shards merge


def test_a_round_starts_once_every_rank_iterated_or_restored() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 1)
    _lease(ledger, 1, 0, have=0, count=1)
    cursor = _cut(ledger, round_=1, consumed=[3], epochs=[0])
    _declare(ledger, 2, 3, ranks=[0])  # rank 0 begins iterating without a cursor
    assert ledger.waiting_for(2) == (1, 2) and not ledger.started(2)
    _declare(ledger, 2, 3, cursor, ranks=[1, 2])
    assert ledger.started(2) and ledger.gen is not None and ledger.gen.digest == cursor.digest
    assert ledger.remaining == SlotMap(cursor.remaining)


def test_ranks_restoring_different_cursors_refuse_the_round() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 1)
    _lease(ledger, 1, 0, have=0, count=2)
    one, two = (_cut(ledger, round_=1, consumed=[n], epochs=[0]) for n in (1, 2))
    _declare(ledger, 2, 2, one, ranks=[0])
    _declare(ledger, 2, 2, two, ranks=[1])
    with pytest.raises(InvalidRequest, match="restored 2 different cursors"):
        _lease(ledger, 2, 0, have=0)


def test_a_lost_reply_is_answered_with_the_same_ranges() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 1)
    first = _lease(ledger, 1, 0, have=0, count=2)
    assert _lease(ledger, 1, 0, have=0, count=2) == first  # the worker never saw the first answer
    assert _lease(ledger, 1, 0, have=1, count=2).ranges[0] != first.ranges[0]


def test_a_cursor_keeps_the_unread_tail_of_a_half_read_shard_and_it_is_read_first() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 2)
    assert _lease(ledger, 1, 0, have=0, count=1).ranges == ((0, 0, 4),)
    assert _lease(ledger, 1, 1, have=0, count=1).ranges == ((0, 4, 8),)
    assert _lease(ledger, 1, 0, have=1, count=1).ranges == ((0, 8, 10),)  # prefetched, not read
    cursor = _cut(ledger, round_=1, consumed=[3, 4], epochs=[0, 0])  # rank 0 read 3 of its 4, rank 1 all of its
    assert cursor.remaining == ((0, 3, 4), (0, 8, 10), (1, 0, 10))
    _declare(ledger, 2, 1, cursor)
    assert _lease(ledger, 2, 0, have=0, count=2).ranges == ((0, 3, 4), (0, 8, 10))


def test_failed_and_silent_workers_leases_go_back_to_the_queue() -> None:
    ledger = Ledger(dataclasses.replace(SPEC, size=16))
    _declare(ledger, 1, 3)
    for rank in range(3):
        _lease(ledger, 1, rank, have=0, count=1)
    ledger.note_progress(1, 1, consumed=1, epoch=0, now=5.0)
    ledger.note_progress(1, 0, consumed=4, epoch=0, now=5.0)
    _apply(ledger, ledger.decide_failed(node_id="node-0", round_=1, rank=1, reason="rank 1 failed"))
    assert ledger.remaining.part(0) == SlotMap([(0, 5, 8), (0, 12, 16)]).part(0)
    with pytest.raises(InvalidRequest, match="lost its leases"):
        _lease(ledger, 1, 1, have=1)
    _apply(ledger, ledger.decide_expire(now=62.0, timeout_s=60.0))  # rank 2 silent since 0, rank 0 since 5
    assert ledger.gen is not None and ledger.gen.streams[2].dead and not ledger.gen.streams[0].dead
    assert _lease(ledger, 1, 0, have=1, count=9, consumed=4).ranges == ((0, 5, 16),)
    assert ledger.decide_failed(node_id="node-0", round_=7, reason="another round") == []


def test_a_worker_gives_back_what_it_will_not_read() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 2)
    _lease(ledger, 1, 0, have=0, count=2)
    _apply(ledger, ledger.decide_report(round_=1, rank=0, nonce="p1.0", consumed=5, release_rest=True))
    assert ledger.gen is not None and ledger.gen.streams[0].ranges == [(0, 0, 5)]
    assert _lease(ledger, 1, 1, have=0, count=5).ranges == ((0, 5, 10),)
    assert _lease(ledger, 1, 0, have=1, count=5, consumed=5).exhausted


def test_the_world_shrinks_and_grows_between_rounds_without_loss_or_repetition() -> None:
    ledger = Ledger(dataclasses.replace(SPEC, size=40, epochs=1))
    history: list[tuple[int, int]] = []
    cursor = None
    for round_, world, reads in ((1, 4, 6), (2, 2, 9), (3, 3, 40)):
        _declare(ledger, round_, world, cursor)
        held: dict[int, list[tuple[int, int]]] = {r: [] for r in range(world)}
        have = dict.fromkeys(range(world), 0)
        done = set()
        for step in range(reads):
            for rank in range(world):
                if rank in done:
                    continue
                if step >= len(held[rank]):
                    answer = _lease(ledger, round_, rank, have=have[rank], consumed=step)
                    have[rank] += len(answer.ranges)
                    held[rank].extend(_slots(answer.ranges))
                    if answer.exhausted:
                        done.add(rank)
                        continue
        consumed = [min(reads, len(held[r])) for r in range(world)]
        if round_ < 3:  # a checkpoint now, then the round fails after reading one more sample each
            cursor = _cut(ledger, round_=round_, consumed=consumed, epochs=[0] * world)
        history += [slot for r in range(world) for slot in held[r][:consumed[r]]]
    assert sorted(history) == [(0, i) for i in range(40)]


def test_checkpoints_keep_the_ledger_small_in_a_long_round() -> None:
    ledger = Ledger(DatasetSpec(name="ids", shard_size=1, size=1000, epochs=1, shuffle=False))
    _declare(ledger, 1, 1)
    for read in range(1, 1001):
        _lease(ledger, 1, 0, have=read - 1, consumed=read - 1)  # one slot a call: never contiguous with the last
        if read % 10 == 0:
            cursor = _cut(ledger, round_=1, consumed=[read], epochs=[0])
            assert cursor.remaining == (((0, read, 1000),) if read < 1000 else ())
    assert ledger.gen is not None
    stream = ledger.gen.streams[0]
    assert (stream.ranges, stream.base, stream.dropped, stream.delivered) == ([], 1000, 1000, 1000)
    assert len(json.dumps(ledger.to_json())) < 500  # the snapshot does not grow with the leases
    with pytest.raises(InvalidRequest, match="before the position 1000 its last checkpoint's cursor was cut at"):
        ledger.decide_cut(round_=1, consumed=[990], epochs=[0])


def test_bad_input_is_refused_with_what_to_do_and_changes_nothing() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 2, 2)
    _lease(ledger, 2, 0, have=0)
    before = ledger.to_json()
    cases = [
        (lambda: ledger.decide_register(dataclasses.replace(SPEC, size=11), {}, False), "already registered as"),
        (lambda: ledger.decide_register(dataclasses.replace(SPEC, seed=4), {}, False), "give the new definition"),
        (lambda: ledger.decide_report(round_=2, rank=0, nonce="p2.0", consumed=5, release_rest=False),
         "only 4 were leased to it"),
        (lambda: ledger.decide_report(round_=2, rank=1, nonce="p2.1", consumed=1, release_rest=False),
         "only 0 were leased"),
        (lambda: ledger.decide_lease(round_=2, rank=0, nonce="other", epoch=0, have=1, count=1, consumed=0),
         "from another process"),
        (lambda: ledger.decide_lease(round_=1, rank=0, nonce="p1.0", epoch=0, have=0, count=1, consumed=0),
         "round 1 of dataset 'ids' is over"),
        (lambda: ledger.decide_lease(round_=2, rank=0, nonce="p2.0", epoch=0, have=7, count=1, consumed=0),
         "says it holds 7 leases"),
        (lambda: ledger.decide_lease(round_=2, rank=0, nonce="p2.0", epoch=0, have=1, count=0, consumed=0),
         "ask for 1 to"),
        (lambda: ledger.decide_declare(round_=3, rank=2, world_size=2, node_id="n", nonce="x", cursor=None),
         "outside the world"),
        (lambda: ledger.decide_declare(round_=2, rank=0, world_size=2, node_id="n", nonce="p2.0",
                                       cursor=CursorState("bad", 0, ())), "another definition"),
        (lambda: ledger.decide_declare(round_=3, rank=0, world_size=2, node_id="n", nonce="x",
                                       cursor=CursorState(SPEC.fingerprint(), 0, ((0, 5, 99),))), "outside the data"),
        (lambda: ledger.decide_cut(round_=2, consumed=[1], epochs=[0]), "needs the progress of its 2 ranks"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            call()
        assert ledger.to_json() == before


def test_a_streaming_source_leases_what_exists_and_refuses_offsets_going_backwards() -> None:
    spec = DatasetSpec(name="events", shard_size=5, streaming=True)
    ledger = Ledger(spec)
    _apply(ledger, ledger.decide_register(spec, {0: (100, 108), 1: (0, 3)}, False))
    _declare(ledger, 1, 1)
    answer = _lease(ledger, 1, 0, have=0, count=10)
    assert answer.ranges == ((0, 100, 105), (1, 0, 3), (0, 105, 108)) and not answer.exhausted
    assert _lease(ledger, 1, 0, have=3, count=10) == LeaseAnswer()  # nothing yet, not the end: wait
    before = ledger.to_json()
    with pytest.raises(InvalidRequest, match="went backwards: its end offset is 108, the update says 107"):
        ledger.decide_register(spec, {0: (100, 107)}, False)
    with pytest.raises(InvalidRequest, match="starts at offset 100, not 90"):
        ledger.decide_register(spec, {0: (90, 120)}, False)
    assert ledger.to_json() == before
    _apply(ledger, ledger.decide_register(spec, {0: (100, 112), 2: (7, 9)}, True))
    assert _lease(ledger, 1, 0, have=3, count=10).ranges == ((0, 108, 110), (2, 7, 9), (0, 110, 112))
    cursor = _cut(ledger, round_=1, consumed=[17], epochs=[0])  # all 17 leased
    assert cursor.remaining == ((0, 112, UNBOUNDED), (1, 3, UNBOUNDED), (2, 9, UNBOUNDED))
    assert _lease(ledger, 1, 0, have=6, count=1).exhausted
    with pytest.raises(InvalidRequest, match="was closed"):
        ledger.decide_register(spec, {0: (100, 200)}, False)


def test_a_lockstep_round_gives_every_rank_an_equal_block_of_each_epoch() -> None:
    ledger = Ledger(dataclasses.replace(SPEC, lockstep=True))  # 10 samples, 3 ranks: 3 each, 1 left out
    _declare(ledger, 1, 3)
    got = {rank: _slots(_lease(ledger, 1, rank, have=0, count=9).ranges) for rank in (2, 0, 1)}
    assert {rank: len(slots) for rank, slots in got.items()} == {0: 3, 1: 3, 2: 3}
    assert sorted(s for slots in got.values() for s in slots) == [(0, i) for i in range(9)]
    assert _lease(ledger, 1, 0, have=1, count=1).exhausted  # rank 0's block is read; slot 9 is nobody's
    assert not ledger.decide_lease(round_=1, rank=0, nonce="p1.0", epoch=1, have=1, count=1, consumed=3)[1].exhausted
    # a cursor in the middle of epoch 0 keeps the left-out slot; once every rank is in epoch 1 it is dropped
    mid = _cut(ledger, round_=1, consumed=[2, 3, 3], epochs=[0, 0, 0])
    assert _slots(mid.remaining) == [(0, 2), (0, 9), *[(1, i) for i in range(10)]]
    after = _cut(ledger, round_=1, consumed=[3, 3, 3], epochs=[1, 1, 1])
    assert after.epoch == 1 and _slots(after.remaining) == [(1, i) for i in range(10)]
    # two ranks restore the middle cursor: 2 + 1 left of epoch 0 -> one each, and one left out
    _declare(ledger, 2, 2, mid)
    first = [_slots(_lease(ledger, 2, rank, have=0, count=9).ranges) for rank in (0, 1)]
    assert [len(slots) for slots in first] == [1, 1]
    assert ledger.spec.fingerprint() == SPEC.fingerprint()  # a cursor does not care how ranks split the samples


@given(st.integers(0, 40), st.integers(1, 6), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40),
                                                                 st.integers(0, 40)), max_size=6))
def test_lockstep_blocks_are_equal_disjoint_and_leave_out_fewer_than_the_world(
        size: int, world: int, holes: list[tuple[int, int, int]]) -> None:
    start = SlotMap((e, 0, size) for e in range(3))
    for epoch, a, b in holes:
        start.remove(epoch, min(a, b), max(a, b))
    blocks = split(start, world, range(3))
    for epoch in range(3):
        sizes = {blocks[rank][epoch].total for rank in range(world)}
        assert len(sizes) == 1
        assert start.part(epoch).total - world * sizes.pop() < world
    rest = left_out(start, blocks)
    read = [(e, s, x) for r in range(world) for e in range(3) for s, x in blocks[r][e].ranges()]
    assert sum(x - s for _, s, x in read) + rest.total == start.total
    union = SlotMap(read)
    union.update(rest)
    assert union == start


def test_the_ledger_survives_a_snapshot_round_trip() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 2)
    _lease(ledger, 1, 0, have=0, count=2)
    cursor = _cut(ledger, round_=1, consumed=[2, 0], epochs=[0, 0])
    _declare(ledger, 2, 2, cursor, ranks=[1])
    copy = Ledger.from_json(ledger.to_json(), now=0.0)
    assert copy.to_json() == ledger.to_json()
    _declare(copy, 2, 2, cursor, ranks=[0])
    assert copy.started(2) and copy.remaining == SlotMap(cursor.remaining)


# -- skipped steps ---------------------------------------------------------------------------------------


def _skip(ledger: Ledger, round_: int, rank: int, step: int, *ranges: Range) -> None:
    _apply(ledger, ledger.decide_skipped(round_=round_, rank=rank, step=step, ranges=ranges))


def _report(ledger: Ledger, round_: int, consumed: Sequence[int]) -> None:
    for rank, at in enumerate(consumed):
        ledger.note_progress(round_, rank, consumed=at, epoch=0, now=0.0)


def test_a_skipped_step_s_samples_are_recorded_as_skipped_and_done_plus_skipped_is_every_sample() -> None:
    ledger = Ledger(SPEC)  # 10 samples, 2 epochs: 20 in all
    _declare(ledger, 1, 2)
    assert ledger.tally() == Tally(total=20, done=0, skipped=0, unread=20)
    _lease(ledger, 1, 0, have=0, count=1)
    _lease(ledger, 1, 1, have=0, count=1)
    _report(ledger, 1, [4, 4])
    _skip(ledger, 1, 0, 6, (0, 2, 4))  # rank 0's step 6 held slots 2-3 of epoch 0
    _skip(ledger, 1, 1, 6, (0, 6, 8))
    _skip(ledger, 1, 1, 6, (0, 6, 8))  # the same note again (forwarded twice): recorded once
    assert ledger.skipped == SlotMap([(0, 2, 4), (0, 6, 8)])
    assert ledger.tally() == Tally(total=20, done=4, skipped=4, unread=12)
    for rank in (0, 1):
        _lease(ledger, 1, rank, have=1, count=4, epoch=0)
        _lease(ledger, 1, rank, have=ledger.gen.streams[rank].delivered, count=4, epoch=1)  # type: ignore[union-attr]
    _report(ledger, 1, [ledger.gen.streams[r].leased for r in (0, 1)])  # type: ignore[union-attr]
    tally = ledger.tally()  # every sample read: each either trained on or skipped, never lost
    assert (tally.unread, tally.done + tally.skipped, tally.skipped) == (0, 20, 4)


def test_a_rollback_before_the_skipped_step_reads_its_samples_again_and_they_are_skipped_no_more() -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 1)
    _lease(ledger, 1, 0, have=0, count=1)  # slots 0-3
    cursor = _cut(ledger, round_=1, consumed=[2], epochs=[0])  # a checkpoint after slots 0-1
    _skip(ledger, 1, 0, 3, (0, 2, 4))
    _declare(ledger, 2, 1, cursor)  # round 2 restores that checkpoint: it reads 2-3 again
    assert not ledger.skipped
    _skip(ledger, 1, 0, 3, (0, 2, 4))  # round 1's note, late: round 2 reads those slots, they are not skipped
    assert not ledger.skipped
    _lease(ledger, 2, 0, have=0, count=1)
    _skip(ledger, 2, 0, 3, (0, 2, 4))  # round 2 skips them (its workers say so): skipped
    later = _cut(ledger, round_=2, consumed=[2], epochs=[0])
    _declare(ledger, 3, 1, later)  # a rollback after the skipped step: they stay skipped
    assert ledger.skipped == SlotMap([(0, 2, 4)])
    copy = Ledger.from_json(ledger.to_json(), now=0.0)
    assert copy.skipped == ledger.skipped and copy.to_json() == ledger.to_json()


@pytest.mark.parametrize(("ranges", "round_", "why"), [
    (((2, 0, 4),), 1, "names epoch 2 \\(the dataset has 2\\)"),
    (((0, 8, 12),), 1, "slots 8-12 of epoch 0, past its 10 samples"),
    (((0, 4, 4),), 1, "slots 4-4 \\(need 0 <= start < end\\)"),
    (((0, 0, 4),), 2, "round 2 of dataset 'ids' has not started"),
])
def test_a_skipped_step_naming_slots_outside_the_dataset_is_refused_and_changes_nothing(
        ranges: tuple[Range, ...], round_: int, why: str) -> None:
    ledger = Ledger(SPEC)
    _declare(ledger, 1, 1)
    before = ledger.to_json()
    with pytest.raises(InvalidRequest, match=why):
        ledger.decide_skipped(round_=round_, rank=0, step=1, ranges=ranges)
    assert ledger.to_json() == before


def test_a_streaming_source_s_skipped_offsets_must_exist() -> None:
    ledger = Ledger(DatasetSpec(name="events", shard_size=2, streaming=True))
    _apply(ledger, ledger.decide_register(ledger.spec, {0: (5, 9)}, False))
    _declare(ledger, 1, 1)
    with pytest.raises(InvalidRequest, match="offsets 7-11 of partition 0, outside its records 5-9"):
        ledger.decide_skipped(round_=1, rank=0, step=0, ranges=[(0, 7, 11)])
    with pytest.raises(InvalidRequest, match="partition 3, unknown"):
        ledger.decide_skipped(round_=1, rank=0, step=0, ranges=[(3, 0, 1)])
    _skip(ledger, 1, 0, 0, (0, 5, 7))
    assert ledger.tally() == Tally(total=4, done=0, skipped=2, unread=2)  # 5-6 skipped (read), 7-8 not read yet


# -- exactly once, whatever fails ------------------------------------------------------------------------


@dataclasses.dataclass
class _Worker:
    rank: int
    epoch: int
    slots: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # the stream, in order
    have: int = 0
    read: int = 0
    done: bool = False


def _read_one(ledger: Ledger, round_: int, w: _Worker, epochs: int, prefetch: int) -> None:
    """The worker reads its next sample, leasing (and moving to the next epoch) as needed."""
    while not w.done:
        if len(w.slots) - w.read < prefetch:
            answer = _lease(ledger, round_, w.rank, have=w.have, count=prefetch, epoch=w.epoch, consumed=w.read)
            assert not answer.waiting_for
            w.have += len(answer.ranges)
            w.slots += _slots(answer.ranges)
            if answer.exhausted and w.read == len(w.slots):
                w.epoch += 1
                w.done = w.epoch >= epochs
                continue
        if w.read < len(w.slots):
            assert w.slots[w.read][0] == w.epoch
            w.read += 1
            return


class _RecordingLedger(Ledger):
    """A ledger that keeps every op it applied: the journal a restarted master would replay."""

    journal: list[Op]

    def apply(self, op: Op, *, now: float = 0.0) -> None:
        self.journal.append(op)
        super().apply(op, now=now)


def _durable(ledger: Ledger) -> dict[str, object]:
    """The ledger without its soft state (reported progress), which is not journaled."""
    body = ledger.to_json()
    if body["gen"] is not None:
        body["gen"]["streams"] = [entry[:7] + entry[9:] for entry in body["gen"]["streams"]]
    return body


def _restart(ledger: _RecordingLedger) -> _RecordingLedger:
    """A master restart: the ledger from its snapshot, and the same ledger from its journal alone."""
    replayed = Ledger(ledger.spec)
    for op in ledger.journal:
        replayed.apply(op)
    assert _durable(replayed) == _durable(ledger)
    restarted = _RecordingLedger.from_json(json.loads(json.dumps(ledger.to_json())), now=0.0)
    assert isinstance(restarted, _RecordingLedger)
    restarted.journal = ledger.journal
    assert _durable(restarted) == _durable(ledger)
    return restarted


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_sample_is_consumed_exactly_once_per_epoch_by_the_surviving_steps(data: st.DataObject) -> None:
    size, shard, epochs = data.draw(st.integers(1, 30)), data.draw(st.integers(1, 7)), data.draw(st.integers(1, 3))
    lockstep = data.draw(st.booleans(), label="lockstep")
    ledger = _RecordingLedger(DatasetSpec(name="ids", shard_size=shard, size=size, seed=1, epochs=epochs,
                                          lockstep=lockstep))
    ledger.journal = []
    #: checkpoints: (cursor, the samples read by the history the checkpoint holds)
    checkpoints: list[tuple[CursorState, list[tuple[int, int]]]] = []
    failures = data.draw(st.integers(0, 4))
    widest = 0
    for round_ in range(1, failures + 2):
        world = data.draw(st.integers(1, 4), label="world")
        widest = max(widest, world)
        restore = data.draw(st.sampled_from([None, *range(len(checkpoints))]), label="restore")
        cursor, base = checkpoints[restore] if restore is not None else (None, [])
        _declare(ledger, round_, world, cursor)
        workers = [_Worker(r, cursor.epoch if cursor else 0) for r in range(world)]
        last = round_ == failures + 1
        prefetch = data.draw(st.integers(1, 3), label="prefetch")
        for _ in range(10**6 if last else data.draw(st.integers(0, 3 * size * epochs), label="steps")):
            live = [w for w in workers if not w.done]
            if not live:
                break
            _read_one(ledger, round_, data.draw(st.sampled_from(live), label="reader"), epochs, prefetch)
            if not last and data.draw(st.integers(0, 5), label="checkpoint?") == 0:
                cut = _cut(ledger, round_=round_, consumed=[w.read for w in workers],
                           epochs=[w.epoch for w in workers])
                checkpoints.append((cut, base + [s for w in workers for s in w.slots[:w.read]]))
            if data.draw(st.integers(0, 20), label="master restart?") == 0:
                ledger = _restart(ledger)
        if last:
            history = base + [s for w in workers for s in w.slots[:w.read]]
            expected = collections.Counter((e, i) for e in range(epochs) for i in range(size))
            if not lockstep:
                assert collections.Counter(history) == expected
                continue
            # lockstep: nothing twice; an epoch leaves out fewer samples than the ranks of the widest round (the
            # rest of the dataset is read), and every rank of the last round reads as many of each epoch
            assert len(history) == len(set(history)) and set(history) <= set(expected)
            for epoch in range(epochs):
                assert size - sum(1 for e, _ in history if e == epoch) < widest
                assert len({sum(1 for e, _ in w.slots if e == epoch) for w in workers}) == 1
