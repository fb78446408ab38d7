"""stead status's numerics lines: steps skipped (decided, and done by the workers), loss spikes, notes dropped."""

from __future__ import annotations

import dataclasses

from stead.core.events import (
    CheckpointRestored,
    NumericsNote,
    NumericsReported,
    Record,
    RecoveryAction,
    RecoveryDecided,
    StepSamples,
)
from stead.core.views.numerics import SHOWN, numerics_lines


def _records(*events: object) -> list[Record]:
    return [Record(seq=i, at=0.0, event=e) for i, e in enumerate(events, 1)]  # type: ignore[arg-type]


def test_status_shows_each_skip_and_spike_and_the_notes_dropped() -> None:
    decided = RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="", rank=1, rule="non-finite-gradient",
                              evidence="NonFiniteGradientError: ... on rank 1 (host h1) at step 6: ...",
                              skip_steps=(6,))
    plain = RecoveryDecided(round=2, action=RecoveryAction.RESTART, reason="", rank=0, rule="gloo-error")
    notes = NumericsReported(node_id="node-0", round=2, dropped=3, notes=(
        NumericsNote(kind="loss_spike", rank=0, step=4, loss=1200.0, median=1.1, score=512.25, action="record"),
        NumericsNote(kind="loss_spike", rank=2, step=9, action="skip", round=1),  # written in round 1, sent in 2
        NumericsNote(kind="step_skipped", rank=0, step=6)))
    assert numerics_lines(_records(decided, plain, notes)) == [
        "step 6 skipped from round 2 on: a non-finite gradient on rank 1 (host h1) (non-finite-gradient)",
        "loss spike at step 4 on rank 0 (round 2): loss 1200, 512.2 robust std above the median 1.1; recorded",
        "loss spike at step 9 on rank 2 (round 1): loss not finite; rolled back, its batch skipped",
        "step 6 skipped by the workers of round 2 (rank 0 says): samples unknown (not read with stead's sampler)",
        "3 note(s) of the workers dropped by their agents (malformed or over their bounds: the agents' logs say "
        "which)",
    ]


def test_every_rank_s_note_of_a_skipped_step_makes_one_line_naming_the_samples_they_held() -> None:
    def skip(rank: int, *samples: StepSamples, round_: int | None = None) -> NumericsNote:
        return NumericsNote(kind="step_skipped", rank=rank, step=6, round=round_, samples=samples)

    first = NumericsReported(node_id="node-0", round=2, notes=(
        skip(0, StepSamples(dataset="d", count=32, ranges=((0, 0, 32),))),
        skip(1, StepSamples(dataset="d", count=32, ranges=((0, 32, 64),)),
             StepSamples(dataset="text", count=12, ranges=((1, 5, 9), (2, 0, 4))))))
    second = NumericsReported(node_id="node-1", round=3, notes=(  # written in round 2, sent once round 3 began
        skip(2, StepSamples(dataset="d", count=40, ranges=((0, 200, 204), (0, 300, 304), (0, 400, 404), (0, 500, 504),
                                                           (0, 600, 604))), round_=2),
        dataclasses.replace(skip(3), samples=None, round=2),
        skip(1, StepSamples(dataset="d", count=32, ranges=((0, 32, 64),)), round_=2)))  # forwarded again
    assert numerics_lines(_records(first)) == [
        "step 6 skipped by the workers of round 2 (2 ranks say): 64 samples (dataset d: part 0 slots 0-63); "
        "12 samples (dataset text: part 1 slots 5-8, part 2 slots 0-3, 4 not named)"]
    assert numerics_lines(_records(first, second)) == [
        "step 6 skipped by the workers of round 2 (4 ranks say): 104 samples (dataset d: part 0 slots 0-63, "
        "200-203, 300-303, 400-403, 2 more range(s), 20 not named); "
        "12 samples (dataset text: part 1 slots 5-8, part 2 slots 0-3, 4 not named); samples of rank 3 unknown "
        "(not read with stead's sampler)"]


def test_status_shows_the_newest_lines_and_counts_the_others() -> None:
    many = NumericsReported(node_id="node-0", round=1, notes=tuple(
        NumericsNote(kind="step_skipped", rank=0, step=s) for s in range(SHOWN + 4)))
    lines = numerics_lines(_records(many))
    assert len(lines) == SHOWN + 1 and lines[0].startswith("(4 earlier: stead events")
    assert lines[-1].startswith(f"step {SHOWN + 3} skipped")
    assert numerics_lines(_records()) == []


def test_status_shows_a_bounded_restore_and_the_step_the_next_round_restored() -> None:
    mismatch = RecoveryDecided(round=1, action=RecoveryAction.RELAUNCH, reason="", rank=1, rule="replica-mismatch",
                               evidence="ReplicaMismatchError: replica mismatch: rank 1 (host h1) at step 8: ...; "
                                        "fingerprints last agreed at step 5. The step ...", restore_at_most=5)
    unattributed = RecoveryDecided(round=3, action=RecoveryAction.RESTART, reason="", rank=0,
                                   rule="replica-mismatch-unattributed", restore_at_most=-1)
    assert numerics_lines(_records(
        mismatch, CheckpointRestored(round=1, step=7), CheckpointRestored(round=2, step=4, disk_ranks=3),
        CheckpointRestored(round=3, step=9), unattributed, CheckpointRestored(round=4, step=-1),
        dataclasses.replace(mismatch, round=4), CheckpointRestored(round=5, step=-1))) == [
        "restore bounded to step 5 from round 2 on: a replica mismatch on rank 1 (host h1), fingerprints last agreed "
        "there (replica-mismatch)",
        "round 2 restored step 4 (bounded to step 5 or before)",
        "restore bounded to the initial state from round 4 on: a replica mismatch on rank 0, fingerprints last "
        "agreed there (replica-mismatch-unattributed)",
        "round 4 started from the initial state, as bounded",
        "restore bounded to step 5 from round 5 on: a replica mismatch on rank 1 (host h1), fingerprints last agreed "
        "there (replica-mismatch)",
        "round 5 restored nothing: no checkpoint at or before step 5 was left in memory or on disk; it started from "
        "the initial state",
    ]
