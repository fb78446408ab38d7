"""Fingerprints every 3 steps: a bit flipped in rank 1's parameters after step 3 reaches every replica through the
all-reduce of step 4 before the fingerprints of step 5 show it. The restore is bounded to step 2, the last step
whose fingerprints agreed (the committed steps 3 and 4 hold the corruption): the job restores step 2 from disk (the
memory slots hold 3 and 4) and ends with the weights of a fault-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_failure_classes import RunJob, events, of_type, status
from tests.e2e.test_numerics import SCRIPT, _decided, _torchrun, _weights

pytestmark = pytest.mark.e2e

#: the README's script, each step persisted to disk before the next (so that the steps before the flip are there)
PERSISTED = SCRIPT.replace("    ckpt.save(step)", "    ckpt.save(step, persist=True)\n    ckpt.wait_persisted(30)")


def test_a_flipped_bit_seen_fingerprints_later_restores_the_last_step_whose_fingerprints_agreed(
        run_job: RunJob, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert PERSISTED != SCRIPT
    # 2 ranks: a sum of two gradients is the same in any order (exact weights); no majority, so each replica runs
    # the known-answer probe, both pass, and the mismatch is nobody's (a restart, nothing relaunched)
    every = {"STEAD_NUMERICS_FINGERPRINT_EVERY": "3"}
    with _torchrun(tmp_path / "reference", 2, **every) as torchrun:
        monkeypatch.setenv("STEAD_NUMERICS_INJECT", "bitflip:rank=1:step=3")
        monkeypatch.setenv("STEAD_NUMERICS_FINGERPRINT_EVERY", "3")
        job = run_job(PERSISTED, job="bound", flags=("--nproc-per-node", "2", "--max-restarts", "2",
                                                     "--set", "ckpt.keep_last=8"))
        clean_out, clean_err = torchrun.communicate(timeout=120)
    decision = _decided(job, "bound", torchrun, clean_err, rule="replica-mismatch-unattributed", action="restart",
                        rank=0)
    assert "differ at step 5" in decision["evidence"] and "fingerprints last agreed at step 2" in decision["evidence"]
    assert decision["restore_at_most"] == 2
    assert "the restore is bounded to step 2" in decision["reason"]
    (restored,) = [r for r in of_type(events(job, "bound"), "ckpt.restored") if r["round"] == 2]
    assert (restored["step"], restored["disk_ranks"]) == (2, 2)  # not the committed step 4, nor 3 in memory
    assert "round 2 restored step 2 (bounded to step 2 or before)" in status(job, "bound")
    assert _weights(job.stdout) == _weights(clean_out)
