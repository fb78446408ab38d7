"""A NaN gradient with the default numerics.on_nan=skip: the job rolls back and every rank skips the step's batch,
ending with the weights of a fault-free run that skips that step; a loss spike the script reports is recorded
(numerics.loss_spike=record) through the workers' notes; both are events and lines of stead status. Every rank's
note of the skipped step says which samples it held (here: unknown, the script reads no data through stead's
sampler; the samples named and recorded as skipped: tests/plugins/sharding)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_failure_classes import RunJob, events, of_type, status
from tests.e2e.test_numerics import SCRIPT, _decided, _torchrun, _weights

pytestmark = pytest.mark.e2e

#: the README's script, its reported loss (only the reported one: the gradients are the script's) 1000 times larger
#: on rank 0 at step 4 in the first run: a spike for the detector, nothing for the weights
SPIKED = SCRIPT.replace(
    "    stead.numerics.report_loss(loss)",
    "    first_run = __import__('os').environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'\n"
    "    stead.numerics.report_loss(loss * (1000.0 if rank == 0 and step == 4 and first_run else 1.0))")


def test_a_nan_is_rolled_back_and_its_step_skipped_on_every_rank_and_a_loss_spike_is_recorded(
        run_job: RunJob, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert SPIKED != SCRIPT
    # the fault-free reference skips step 6 as the job's workers are told to (the variable the agent sets)
    with _torchrun(tmp_path / "reference", 2, STEAD_NUMERICS_SKIP_STEPS="6") as torchrun:
        monkeypatch.setenv("STEAD_NUMERICS_INJECT", "nan:rank=1:step=6")
        job = run_job(SPIKED, job="skip", flags=(
            "--nproc-per-node", "2", "--max-restarts", "2", "--set", "numerics.loss_spike=record",
            "--set", "numerics.loss_spike_warmup=4", "--set", "numerics.loss_spike_threshold=20"))
        clean_out, clean_err = torchrun.communicate(timeout=120)
    decision = _decided(job, "skip", torchrun, clean_err, rule="non-finite-gradient", action="restart", rank=1)
    assert decision["skip_steps"] == [6]
    assert "non-finite gradient (NaN or Inf) on rank 1" in decision["evidence"]
    assert "at step 6" in decision["evidence"] and "before the all-reduce" in decision["evidence"]
    assert "step 6's batch is skipped on every rank" in decision["evidence"]
    assert _weights(job.stdout) == _weights(clean_out)  # step 6 applied nothing, on either rank
    noted = [n for r in of_type(events(job, "skip"), "numerics.reported") for n in r["notes"]]
    notes = [(n["kind"], n["rank"], n["step"], n["action"]) for n in noted]
    # every rank says what its skipped step held: the README's script reads no data through stead's sampler, so
    # its samples are unknown (null), and nothing is recorded in a sharding ledger
    assert sorted(notes) == [("loss_spike", 0, 4, "record"), ("step_skipped", 0, 6, ""),
                             ("step_skipped", 1, 6, "")], notes
    assert [n["samples"] for n in noted] == [None] * 3, noted
    shown = status(job, "skip")
    assert "numerics   step 6 skipped from round 2 on: a non-finite gradient on rank 1 (host " in shown, shown
    assert "numerics   loss spike at step 4 on rank 0 (round 1)" in shown and "; recorded" in shown
    assert ("numerics   step 6 skipped by the workers of round 2 (2 ranks say): samples unknown (not read with "
            "stead's sampler)") in shown, shown
