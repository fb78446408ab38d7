"""After a replica mismatch the master bounds the restore (STEAD_CKPT_RESTORE_BOUNDS): the newest committed step at
or before the last step whose fingerprints agreed, from whichever tier holds one (memory slots, disk), none when no
tier does; copies that later rounds saved are not concerned."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stead.core.config import Settings
from stead.core.events import CheckpointRestored, RestoreBound
from stead.core.worker.numerics_settings import RESTORE_BOUNDS_ENV, restore_bounds, restore_bounds_env
from stead.plugins.ckpt.settings import CheckpointSettings

from .conftest import Cluster


@pytest.fixture
def kept(tmp_path: Path, settings: CheckpointSettings) -> Iterator[Cluster]:
    """A cluster whose disk keeps the newest 4 persisted steps."""
    with Cluster(tmp_path, dataclasses.replace(settings, keep_last=4), job="bound-test",
                 stead_settings=Settings(retry_deadline_s=5.0)) as running:
        yield running


def _restore(cluster: Cluster, round_: int, bounds: str, monkeypatch: pytest.MonkeyPatch) -> int | None:
    """A new round restores under ``bounds``: the step it got (None: nothing), checked to be that step's state."""
    cluster.failure(round_=round_ - 1)
    cluster.round(round_, restart_count=round_ - 1)
    monkeypatch.setenv(RESTORE_BOUNDS_ENV, bounds)
    with cluster.worker(round_=round_) as ckpt:
        found = ckpt.load()
    if found is None:
        return None
    step, state = found
    assert torch.equal(state["w"], torch.full((4,), float(step)))
    return step


def test_a_bounded_restore_takes_the_newest_step_at_or_before_the_bound_from_any_tier_or_none(
        kept: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    kept.agent()
    kept.round(1)
    with kept.worker() as ckpt:
        for step in range(6):  # memory: 4 and 5 (two slots); disk: 2 to 5 (keep_last=4)
            assert ckpt.save(step, {"w": torch.full((4,), float(step))}, persist=True)
            assert ckpt.wait_persisted(timeout=30) == step
    table = [
        ("", 5),            # no bound: the committed step, from memory
        ("5@1", 5),         # a bound at the committed step changes nothing
        ("4@1", 4),         # the other memory slot
        ("3@1", 3),         # disk
        ("9@0,3@1", 3),     # every bound applies
        ("2@0", 5),         # round 1's copies are not concerned by a mismatch of round 0
        ("1@1", None),      # no tier holds a step at or before 1 (disk kept 2 to 5): the initial state
        ("-1@1", None),     # the replicas agreed on no step: the initial state
    ]
    got = [(bounds, _restore(kept, round_, bounds, monkeypatch)) for round_, (bounds, _) in enumerate(table, 2)]
    assert got == table
    kept.settle()
    restored = [e.step for e in kept.events if isinstance(e, CheckpointRestored)]
    assert restored[-len(table):] == [-1 if s is None else s for _, s in table]  # what the job's record says


def test_a_bound_keeps_out_the_mismatch_round_s_copies_but_not_what_later_rounds_saved(
        kept: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    kept.agent()
    kept.round(1)
    with kept.worker() as ckpt:
        for step in range(6):
            assert ckpt.save(step, {"w": torch.full((4,), float(step))}, persist=True)
            assert ckpt.wait_persisted(timeout=30) == step
    assert _restore(kept, 2, "2@1", monkeypatch) == 2  # the mismatch of round 1: fingerprints agreed at step 2
    with kept.worker(round_=2) as ckpt:  # round 2 trains on from step 2 and commits step 3 again (memory only)
        assert ckpt.load() is not None
        assert ckpt.save(3, {"w": torch.full((4,), 3.0)})
    # round 3, another failure, the same bound in force: round 2's step 3, not round 1's steps 4 and 5 (on disk)
    assert _restore(kept, 3, "2@1", monkeypatch) == 3


@pytest.mark.parametrize(("bound", "step", "round_", "excluded"), [
    (RestoreBound(step=4, round=2), 5, 2, True),    # after the bound, saved in the mismatch's round
    (RestoreBound(step=4, round=2), 5, 1, True),    # ... or an earlier one
    (RestoreBound(step=4, round=2), 4, 2, False),   # the last agreed step itself
    (RestoreBound(step=4, round=2), 9, 3, False),   # a later round's copy: saved after the rollback
    (RestoreBound(step=-1, round=0), 0, 0, True),   # no step agreed: every copy of that round is out
])
def test_what_a_bound_excludes(bound: RestoreBound, step: int, round_: int, excluded: bool) -> None:
    assert bound.excludes(step, round_) is excluded


def test_the_bounds_cross_to_the_workers_and_a_bad_value_is_refused_saying_what_it_should_be() -> None:
    bounds = (RestoreBound(step=-1, round=1), RestoreBound(step=12, round=3))
    (text,) = restore_bounds_env(bounds).values()
    assert restore_bounds(text) == bounds and restore_bounds_env(()) == {} and restore_bounds("") == ()
    for bad in ("12", "x@1", "3@-1", "-2@1"):
        with pytest.raises(ValueError, match="not STEP@ROUND"):
            restore_bounds(bad)
