"""The worker's side of numerics beyond the guard's checks: the loss-spike detector (a table and properties),
stead.report_loss with and without a stead agent, a step the master says to skip (nothing applied, on a guarded
model or not), and the notes a worker writes for its agent: read back, refused when malformed, bounded."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stead
import stead.numerics
from stead.core.agent.notes import MAX_PENDING_NOTES, NotesReader, parse_note
from stead.core.errors import ConfigError
from stead.core.events import MAX_NOTES_PER_REPORT, MAX_SAMPLE_RANGES, MAX_SAMPLE_SETS, NumericsNote, StepSamples
from stead.core.worker import loss_spike, notes, skipping
from stead.core.worker.loss_spike import LossSpikeError, SpikeDetector
from stead.core.worker.numerics_settings import SKIP_STEPS_ENV, NumericsSettings
from stead.core.worker.progress import PROGRESS_ENV

# -- the detector ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("losses", "spikes"), [
    ([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 50.0], [6]),  # a jump far above the recent spread
    ([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.3], []),  # within the spread
    ([1.0, 1.1, 0.9, 50.0], []),  # in the warm-up: not judged
    ([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 0.01], []),  # a drop is no spike
    ([1.0] * 6 + [1.005, 1.2], [7]),  # equal losses: the spread is at least 1% of the median
    ([1.0, 1.1, 0.9, 1.0, math.nan, 1.0], [4]),  # a non-finite loss is always one, warm-up or not
])
def test_the_detector_flags_a_loss_far_above_the_recent_median(losses: list[float], spikes: list[int]) -> None:
    detector = SpikeDetector(window=10, warmup=4, threshold=6.0)
    assert [i for i, loss in enumerate(losses) if detector.observe(loss) is not None] == spikes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.5, max_value=2.0), min_size=4, max_size=60),
       st.floats(min_value=0.5, max_value=2.0))
def test_a_loss_within_the_windows_range_is_never_a_spike(history: list[float], loss: float) -> None:
    detector = SpikeDetector(window=100, warmup=4, threshold=6.0)
    for value in history:
        detector.observe(value)
    # a loss no higher than the highest recent one is never 6 robust deviations above the median ... unless the
    # deviation is tiny: that is what the 1% floor bounds (6 x 1% above the median at least)
    if loss <= max(history) and loss <= sorted(history)[len(history) // 2] * 1.06:
        assert detector.observe(loss) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.1, max_value=10.0), min_size=4, max_size=60), st.floats(1.0, 1e6))
def test_a_loss_scaled_far_past_everything_seen_is_a_spike_and_kept_out_when_asked(history: list[float],
                                                                                   factor: float) -> None:
    detector = SpikeDetector(window=100, warmup=4, threshold=6.0)
    for value in history:
        detector.observe(value)
    spike = detector.observe(max(history) * 100 * factor, keep_spike=False)
    assert spike is not None and spike.score > 6.0
    assert len(detector.recent) == len(history)  # the spike did not enter the window


def test_settings_refuse_an_unknown_mode_or_a_warmup_past_the_window() -> None:
    with pytest.raises(ConfigError, match=r"numerics.on_nan='drop' is not a mode: use one of skip, restore, fail"):
        NumericsSettings(on_nan="drop")
    with pytest.raises(ConfigError, match=r"numerics.loss_spike='on' is not a mode"):
        NumericsSettings(loss_spike="on")
    with pytest.raises(ConfigError, match=r"loss_spike_warmup=50 is larger than numerics.loss_spike_window=10"):
        NumericsSettings(loss_spike_window=10, loss_spike_warmup=50)


# -- report_loss and skipped steps ------------------------------------------------------------------------------------


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[loss_spike._Reporter]:
    """A fresh reporter in place of the process's, and no global hook of it or of the skip hook left after."""
    reporter = loss_spike._Reporter()
    monkeypatch.setattr(loss_spike, "_reporter", reporter)
    monkeypatch.setattr(skipping, "_counter", skipping._StepCounter())
    monkeypatch.setattr(skipping, "_done", set())
    monkeypatch.setattr(skipping, "_window", skipping._Window())  # no sample source of another test
    for name in (PROGRESS_ENV, SKIP_STEPS_ENV, "STEAD_NUMERICS_LOSS_SPIKE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield reporter
    finally:
        for handle in (reporter.handle, skipping._counter.handle, skipping._window.handle):
            if handle is not None:
                handle.remove()


def _steps(losses: list[float], *, model: torch.nn.Module | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model or torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for value in losses:
        loss = model(torch.ones(1, 2)).sum()
        stead.report_loss(loss * 0 + value)  # the reported value, the script's own gradient
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def test_report_loss_is_off_by_default_and_costs_no_hook(fresh: loss_spike._Reporter) -> None:
    _steps([1.0] * 5 + [1e6])
    assert fresh.handle is None and fresh.pending is None


def test_under_plain_torchrun_a_spike_is_a_warning_whatever_the_mode(fresh: loss_spike._Reporter,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEAD_NUMERICS_LOSS_SPIKE", "skip")
    monkeypatch.setenv("STEAD_NUMERICS_LOSS_SPIKE_WARMUP", "4")
    with pytest.warns(UserWarning, match=r"loss spike on rank 0 .* at step 5: loss 1e\+06.*not skipped: without a "
                                         r"stead agent nothing rolls back"):
        _steps([1.0, 1.1, 0.9, 1.0, 1.05, 1e6, 1.0])


def test_under_stead_skip_mode_raises_before_the_step_and_writes_a_note(
        fresh: loss_spike._Reporter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    progress = tmp_path / "rank0"
    monkeypatch.setenv(PROGRESS_ENV, str(progress))
    monkeypatch.setenv("STEAD_NUMERICS_LOSS_SPIKE", "skip")
    monkeypatch.setenv("STEAD_NUMERICS_LOSS_SPIKE_WARMUP", "4")
    monkeypatch.setenv("STEAD_ROUND", "3")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(LossSpikeError, match=r"at step 5: .*the step was not applied"):
        _steps([1.0, 1.1, 0.9, 1.0, 1.05, 1e6], model=model)
    (line,) = Path(notes.notes_path(str(progress))).read_bytes().splitlines()
    note = parse_note(line)
    assert (note.kind, note.rank, note.step, note.loss, note.action, note.round) == ("loss_spike", 0, 5, 1e6, "skip", 3)


@pytest.mark.parametrize("guarded", [True, False], ids=["guard", "report_loss only"])
def test_a_step_to_skip_applies_nothing_and_the_steps_go_on(fresh: loss_spike._Reporter, guarded: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SKIP_STEPS_ENV, "1")
    monkeypatch.setenv("STEAD_NUMERICS_LOSS_SPIKE", "record")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    guard = stead.numerics.guard(model) if guarded else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for step in range(3):
                before = [p.detach().clone() for p in model.parameters()]
                loss = model(torch.ones(1, 2)).sum() * (math.inf if step == 1 else 1.0)  # the skipped step's NaN
                stead.report_loss(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
                seen.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)))
    finally:
        if guard is not None:
            guard.remove()
    assert seen == [False, True, False]  # step 1 applied nothing (not even momentum), steps 0 and 2 did
    assert [str(w.message) for w in said if "skipped" in str(w.message)] == [
        "stead.numerics: step 1 skipped on rank 0 (" + ("its batch caused a numerical fault before the rollback"
                                                        if guarded else "the master's decision") +
        "): its gradients were dropped before the optimizer step, its batch is recorded as skipped"]


def test_a_bad_skip_list_is_refused_saying_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SKIP_STEPS_ENV, "4,x")
    with pytest.raises(ValueError, match=r"STEAD_NUMERICS_SKIP_STEPS='4,x' is not a comma-separated list"):
        skipping.skip_steps()


# -- notes: worker -> agent ---------------------------------------------------------------------------------------


def test_every_rank_s_skipped_step_names_its_samples_in_its_note_or_says_they_are_unknown(
        fresh: loss_spike._Reporter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    progress = tmp_path / "rank1"
    monkeypatch.setenv(PROGRESS_ENV, str(progress))
    monkeypatch.setenv(SKIP_STEPS_ENV, "1,3")
    monkeypatch.setenv("RANK", "1")  # not rank 0: every rank says what its own step held
    skipping.install_skip_hook()
    position = [0]

    class Source:  # what stead's sampler gives: the samples received since its last call
        taken = 0

        def __call__(self) -> list[StepSamples]:
            start, Source.taken = Source.taken, position[0]
            return [StepSamples(dataset="d", count=position[0] - start, ranges=((0, start, position[0]),))]

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            if step == 2:
                skipping.watch_samples(Source())  # the script made its sampler: its steps are known from now on
            position[0] += 4
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
    skipped = [parse_note(line) for line in Path(notes.notes_path(str(progress))).read_bytes().splitlines()]
    assert [(n.kind, n.rank, n.step, n.samples) for n in skipped] == [
        ("step_skipped", 1, 1, None),  # no sampler of stead's: unknown
        ("step_skipped", 1, 3, (StepSamples(dataset="d", count=4, ranges=((0, 12, 16),)),))]


def test_a_step_s_samples_are_bounded_to_fit_one_note_keeping_their_count() -> None:
    many = [StepSamples(dataset=f"{i}" * 200, count=1000, ranges=tuple((0, 10 * r, 10 * r + 5) for r in range(20)))
            for i in range(6)]
    fitted = skipping.fit_samples(many, lambda out: notes.line_bytes("step_skipped", step=7, rank=3,
                                                                     samples=out) <= notes.MAX_LINE_BYTES)
    line = json.dumps({"kind": "step_skipped", "step": 7, "rank": 3, "samples": fitted}, separators=(",", ":")).encode()
    assert len(line) <= notes.MAX_LINE_BYTES
    note = parse_note(line)
    assert note.samples is not None and 1 <= len(note.samples) <= MAX_SAMPLE_SETS
    assert all(s.count == 1000 and len(s.ranges) <= MAX_SAMPLE_RANGES for s in note.samples)
    assert skipping.fit_samples(many[:1], lambda out: True)[0][2] == [[0, 10 * r, 10 * r + 5] for r in range(8)]


@pytest.mark.parametrize(("line", "why"), [
    (b"not json", "not JSON"),
    (b"[1, 2]", "not a JSON object but list"),
    (b'{"kind": "party", "rank": 0, "step": 1}', "kind 'party' is not one of loss_spike, step_skipped"),
    (b'{"kind": "loss_spike", "rank": -1, "step": 1}', "rank '-1' is not a count from 0"),
    (b'{"kind": "loss_spike", "rank": 0, "step": true}', "step 'True' is not a count from 0"),
    (b'{"kind": "loss_spike", "rank": 0, "step": 1, "loss": "big"}', "loss 'big' is not a finite number or null"),
    (b'{"kind": "loss_spike", "rank": 0, "step": 1, "loss": Infinity}', "loss 'inf' is not a finite number"),
    (b'{"kind": "loss_spike", "rank": 0, "step": 1, "action": "panic"}', "action 'panic' is not record or skip"),
    (b'{"kind": "loss_spike", "rank": 0, "step": 1, "round": "2"}', "round '2' is not a count from 0"),
    (b'{"kind": "loss_spike", "rank": 0, "step": 1, "round": 4294967296}', "round 4294967296 is past 2"),
    (b'{"kind": "loss_spike", "rank": 0, "step": 1, "shell": "rm"}', "unknown field(s) shell"),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "pad": "' + b"x" * 2000 + b'"}', "over 1024"),
    (b'{"kind": "loss_spike", "rank": 0, "step": 1, "samples": []}', "a loss_spike note names no samples"),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": {"d": 1}}', "is not a list of at most 4 datasets"),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": [' + b",".join([b'["d", 1, []]'] * 5) + b"]}",
     "is not a list of at most 4 datasets"),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": [["d", 4]]}', "is not .dataset, count, ranges."),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": [["", 4, []]]}', "is not a name of 1 to 200"),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": [["d", -1, []]]}', "count '-1' is not a count"),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": [["d", 90, [' + b",".join([b"[0, 1, 2]"] * 9)
     + b"]]]}", "are not a list of at most 8 ranges"),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": [["d", 4, [[0, 5, 5]]]]}',
     "is not part >= 0 and 0 <= start < end"),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": [["d", 4, [[0, "a", 5]]]]}',
     "is not .part, start, end."),
    (b'{"kind": "step_skipped", "rank": 0, "step": 1, "samples": [["d", 1, [[0, 0, 4]]]]}',
     "name 4 samples, more than its count 1"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_malformed_note_is_refused_saying_why(line: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_note(line)


def test_the_reader_takes_complete_lines_refuses_bad_ones_and_counts_them(tmp_path: Path) -> None:
    progress = tmp_path / "rank0"
    reader = NotesReader({0: progress})
    reader.look()  # no file yet: nothing, no error
    good = json.dumps({"kind": "loss_spike", "rank": 3, "step": 7, "loss": 9.5, "median": 1.0, "score": 40.0,
                       "action": "record"}).encode()
    with open(notes.notes_path(str(progress)), "ab") as out:
        out.write(good + b"\n" + b"garbage\n" + good[:10])  # a line half written: left for the next look
    reader.look()
    assert list(reader.pending) == [NumericsNote(kind="loss_spike", rank=3, step=7, loss=9.5, median=1.0, score=40.0,
                                                 action="record")]
    with open(notes.notes_path(str(progress)), "ab") as out:
        out.write(good[10:] + b"\n")
    reader.look()
    taken, dropped = reader.take()
    assert len(taken) == 2 and dropped == 1 and not reader.pending
    assert reader.take() == ((), 0)


def test_a_flood_of_notes_is_bounded_at_each_step(tmp_path: Path) -> None:
    progress = tmp_path / "rank0"
    line = json.dumps({"kind": "step_skipped", "rank": 0, "step": 1}).encode() + b"\n"
    Path(notes.notes_path(str(progress))).write_bytes(line * (MAX_PENDING_NOTES + 5))
    reader = NotesReader({0: progress})
    reader.look()
    assert len(reader.pending) == MAX_PENDING_NOTES and reader.dropped == 5
    taken, dropped = reader.take()
    assert len(taken) == MAX_NOTES_PER_REPORT and dropped == 5  # a report carries a bounded number


def test_a_worker_writes_notes_only_under_an_agent_and_at_most_max_notes(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert notes.write("step_skipped", step=1, rank=0) is False  # plain torchrun: nowhere to write
    monkeypatch.setenv(PROGRESS_ENV, str(tmp_path / "rank0"))
    monkeypatch.setattr(notes._Count, "written", notes.MAX_NOTES - 1)
    monkeypatch.setattr(notes._Count, "warned", False)
    assert notes.write("loss_spike", step=2, rank=0, loss=math.inf) is True
    with pytest.warns(UserWarning, match="wrote 1000 numerical notes"):
        assert notes.write("loss_spike", step=3, rank=0) is False
    (line,) = Path(notes.notes_path(str(tmp_path / "rank0"))).read_bytes().splitlines()
    assert parse_note(line).loss is None  # JSON has no infinity: written as null
