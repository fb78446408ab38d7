"""The master's commit book: pure table and property tests."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stead.plugins.ckpt._book import Book, Holding, disk_report, memory_report, released, save_seconds


def h(passed: int, *steps: int) -> Holding:
    return Holding(passed=passed, steps=frozenset(steps))


def test_a_step_is_committed_only_when_every_rank_holds_it() -> None:
    book, step = memory_report(Book(), round_=1, world_size=2, ranks={0: h(5, 4, 5)})
    assert step is None
    book, step = memory_report(book, round_=1, world_size=2, ranks={1: h(4, 3, 4)})
    assert step == 4 and book.round_step == 4 and (book.step, book.step_round) == (4, 1)
    book, step = memory_report(book, round_=1, world_size=2, ranks={1: h(5, 4, 5)})
    assert step == 5


def test_reports_of_an_older_round_are_ignored_and_a_new_round_starts_fresh() -> None:
    book, _ = memory_report(Book(), round_=2, world_size=1, ranks={0: h(7, 6, 7)})
    assert book.round_step == 7
    stale, step = memory_report(book, round_=1, world_size=1, ranks={0: h(9, 8, 9)})
    assert step is None and stale == book
    book, step = memory_report(book, round_=3, world_size=2, ranks={0: h(3, 3)})
    assert step is None and book.round_step == -1 and book.step == 7  # a restart still restores step 7
    book, step = memory_report(book, round_=3, world_size=2, ranks={1: h(3, 3)})
    assert step == 3 and (book.step, book.step_round) == (3, 3)  # a rollback commits a lower step


def test_a_pending_step_is_released_when_another_rank_passed_it_without_keeping_it() -> None:
    book, _ = memory_report(Book(), round_=1, world_size=2, ranks={0: h(5, 4, 5), 1: h(4, 3, 4)})
    assert book.round_step == 4
    assert released(book, [0]) == {}  # rank 1 may still save 5
    book, _ = memory_report(book, round_=1, world_size=2, ranks={1: h(5, 4)})  # rank 1 skipped 5
    assert released(book, [0, 1]) == {0: 5}


def test_a_step_is_on_disk_when_every_rank_of_its_world_wrote_it() -> None:
    book, complete = disk_report(Book(), step=10, world_size=2, ranks=[1])
    assert not complete and book.persisted == -1
    book, complete = disk_report(book, step=10, world_size=2, ranks=[0])
    assert complete and book.persisted == 10
    book, complete = disk_report(book, step=10, world_size=2, ranks=[0])
    assert not complete  # reported once


def test_a_step_takes_as_long_as_its_slowest_rank_to_save_and_to_write() -> None:
    book, _ = memory_report(Book(), round_=1, world_size=3, ranks={
        0: Holding(passed=2, steps=frozenset({1, 2}), seconds={1: 0.4, 2: 0.1}),
        1: Holding(passed=2, steps=frozenset({2}), seconds={2: 0.3}),
        2: h(2, 2)})  # a rank that reports no time (an older agent) is not counted as zero
    assert book.round_step == 2
    assert save_seconds(book, 2) == 0.3 and save_seconds(book, 1) == 0.4 and save_seconds(book, 7) is None
    book, _ = disk_report(book, step=2, world_size=2, ranks=[0], seconds=1.5)
    book, complete = disk_report(book, step=2, world_size=2, ranks=[1], seconds=0.5)
    assert complete and book.disk_s == {2: 1.5}
    book, _ = disk_report(book, step=2, world_size=4, ranks=[0], seconds=0.2)  # a new world writes it afresh
    assert book.disk_s == {2: 0.2}
    book, _ = disk_report(book, step=3, world_size=1, ranks=[0])
    assert book.disk_s == {2: 0.2}  # no time said, none kept


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 8), st.sets(st.integers(0, 8), max_size=2)),
                max_size=30))
def test_a_commit_is_held_by_every_rank_and_never_released(reports: list[tuple[int, int, set[int]]]) -> None:
    book = Book()
    for rank, passed, steps in reports:
        book, step = memory_report(book, round_=1, world_size=3, ranks={rank: Holding(passed, frozenset(steps))})
        if step is not None:
            assert all(step in book.holdings[r].steps for r in range(3))
        for freed in released(book, range(3)).values():
            assert freed > book.round_step
