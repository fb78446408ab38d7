"""Slot sets behave like Python sets of integers, kept as few sorted ranges."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from stead.plugins.sharding.intervals import SlotMap, SlotSet

ranges = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)).map(lambda t: (t[0], t[0] + t[1])),
                  max_size=8)


def _as_set(slots: SlotSet) -> set[int]:
    return {i for start, end in slots.ranges() for i in range(start, end)}


def _expand(items: list[tuple[int, int]]) -> set[int]:
    return {i for start, end in items for i in range(start, end)}


def _canonical(slots: SlotSet) -> bool:
    pairs = list(slots.ranges())
    return all(s < e for s, e in pairs) and all(a[1] < b[0] for a, b in itertools.pairwise(pairs))


@given(ranges, ranges)
def test_union_difference_and_removal_match_python_sets(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> None:
    left, right = SlotSet(a), SlotSet(b)
    assert _as_set(left) == _expand(a) and _canonical(left)
    union = left.copy()
    union.update(right)
    assert _as_set(union) == _expand(a) | _expand(b) and _canonical(union)
    diff = left.difference(right)
    assert _as_set(diff) == _expand(a) - _expand(b) and _canonical(diff)
    removed = left.copy()
    for start, end in b:
        removed.remove(start, end)
    assert removed == diff
    assert left.issubset(union) and diff.issubset(left)
    assert left.total == len(_expand(a))


@given(ranges, st.integers(1, 7), st.one_of(st.none(), st.integers(0, 80)))
def test_take_hands_out_the_lowest_slots_cut_at_shard_boundaries(a: list[tuple[int, int]], align: int,
                                                                  limit: int | None) -> None:
    slots = SlotSet(a)
    everything = _as_set(slots)
    taken: list[int] = []
    while (piece := slots.take(align=align, limit=limit)) is not None:
        start, end = piece
        assert start // align == (end - 1) // align  # never crosses a shard boundary
        assert limit is None or end <= limit
        taken.extend(range(start, end))
    assert taken == sorted(everything if limit is None else {i for i in everything if i < limit})
    assert _as_set(slots) == everything - set(taken)


def test_intersects_and_maps_by_part() -> None:
    slots = SlotSet([(0, 4), (10, 12)])
    assert slots.intersects(3, 5) and slots.intersects(11, 30) and not slots.intersects(4, 10)
    both = SlotMap([(0, 0, 4), (1, 2, 3), (0, 4, 6)])
    assert both.to_json() == [[0, 0, 6], [1, 2, 3]]
    assert both.difference(SlotMap([(1, 0, 10)])) == SlotMap([(0, 0, 6)])
    assert both.total == 7 and both.parts() == [0, 1]
    both.remove(0, 0, 6)
    assert both.parts() == [1] and bool(both)
