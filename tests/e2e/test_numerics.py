"""A NaN gradient under DDP with numerics.on_nan=restore: caught on the rank that made it, before the step;
restored and trained on to the fault-free weights; the same NaN again at the same step fails the job on its second
occurrence (the default, on_nan=skip, skips the step instead: test_numerics_skip.py). A flipped bit in
one replica's parameters: the replicas' fingerprints name that rank, its node is relaunched, and the job ends
with the fault-free weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_failure_classes import RunJob, events, of_type, status
from tests.support.readme import readme_files

pytestmark = pytest.mark.e2e

#: the README's script: DDP, a flash checkpoint every step, the final weights printed as JSON
SCRIPT = readme_files()["numerics_train.py"]
#: the same with a bug: rank 1's loss is infinite at step 4 in every run
BUGGY = SCRIPT.replace("    loss.backward()", "    if rank == 1 and step == 4:\n        loss = loss * float('inf')\n"
                                            "    loss.backward()")


def _weights(stdout: str) -> Any:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("WEIGHTS ")]
    return json.loads(line.removeprefix("WEIGHTS "))


def _torchrun(cwd: Path, nproc: int, **env: str) -> subprocess.Popen[str]:
    """The README's script under plain torchrun, without faults, in ``cwd``."""
    cwd.mkdir()
    (cwd / "train.py").write_text(SCRIPT)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STEAD_", "TORCHELASTIC_"))}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(nproc), "train.py"], cwd=cwd, env=clean | env | {"TMPDIR": str(cwd)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _decided(job: Any, name: str, reference: subprocess.Popen[str], reference_err: str, *, rule: str, action: str,
             rank: int) -> dict[str, Any]:
    """The faulty job and its fault-free reference both ended well, and the job's one decision was the numerical
    ``rule``'s ``action`` on ``rank``."""
    assert job.returncode == 0, job.stderr[-4000:]
    assert reference.returncode == 0, reference_err[-3000:]
    (decision,) = of_type(events(job, name), "recovery.decided")
    assert (decision["failure_class"], decision["rule"], decision["action"], decision["rank"]) == (
        "numerical", rule, action, rank)
    return decision


@pytest.mark.extended("a NaN caught on its rank, rolled back, the job ending with a fault-free run's weights: "
                      "tests/e2e/test_numerics_skip.py (numerics.on_nan=skip, the default); restore's decision: "
                      "tests/plugins/test_numerics_decisions.py")
def test_a_nan_gradient_is_caught_on_its_rank_before_the_step_and_the_job_ends_as_a_fault_free_one(
        run_job: RunJob, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # 2 ranks: a sum of two gradients is the same in any order, so the restored run's DDP buckets (built anew,
    # in another order) cannot round differently from the fault-free run's; with 3, gloo's ring could
    with _torchrun(tmp_path / "reference", 2) as torchrun:  # the fault-free run, beside the faulty one
        monkeypatch.setenv("STEAD_NUMERICS_INJECT", "nan:rank=1:step=4")
        faulty = run_job(SCRIPT, job="nan", flags=("--nproc-per-node", "2", "--max-restarts", "2",
                                                   "--set", "numerics.on_nan=restore"))
        clean_out, clean_err = torchrun.communicate(timeout=120)
    decision = _decided(faulty, "nan", torchrun, clean_err, rule="non-finite-gradient", action="restart", rank=1)
    assert "non-finite gradient (NaN or Inf) on rank 1" in decision["evidence"]
    assert "at step 4" in decision["evidence"] and "before the all-reduce" in decision["evidence"]
    assert "last failure: numerical (non-finite-gradient)" in status(faulty, "nan")
    assert _weights(faulty.stdout) == _weights(clean_out)  # the NaN step was never applied, nor committed


@pytest.mark.extended("the rule that decides it (repeated-failure): tests/e2e/test_failure_classes.py's repeated "
                      "failure; a NaN caught on its rank: the test above")
def test_a_nan_that_comes_back_at_the_same_step_after_the_restore_fails_the_job_on_its_second_time(
        run_job: RunJob) -> None:
    assert BUGGY != SCRIPT
    job = run_job(BUGGY, job="bug", flags=("--nproc-per-node", "2", "--max-restarts", "3",
                                           "--set", "numerics.on_nan=restore"))
    assert job.returncode != 0
    decisions = of_type(events(job, "bug"), "recovery.decided")
    assert [(d["failure_class"], d["action"]) for d in decisions] == [("numerical", "restart"),
                                                                        ("user_error", "fail")]
    assert decisions[1]["rule"] == "repeated-failure" and "at the same step twice" in decisions[1]["evidence"]
    assert "NonFiniteGradientError" in decisions[1]["evidence"] and "rank 1" in decisions[1]["evidence"]


@pytest.mark.long(30)
def test_a_flipped_bit_in_one_replica_is_pinned_on_its_rank_its_node_relaunched_and_the_job_ends_fault_free(
        run_job: RunJob, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # 3 ranks, for a majority; fingerprints every step, in the fault-free run too (no false alarm in 8 steps). The
    # relaunched node restores from disk (its memory went with it): nothing was persisted, so it trains from step
    # 0, exactly as the fault-free run does
    every_step = {"STEAD_NUMERICS_FINGERPRINT_EVERY": "1"}
    with _torchrun(tmp_path / "reference", 3, **every_step) as torchrun:
        monkeypatch.setenv("STEAD_NUMERICS_INJECT", "bitflip:rank=2:step=4")
        monkeypatch.setenv("STEAD_NUMERICS_FINGERPRINT_EVERY", "1")
        # (the relaunched node waits ckpt.persist_grace_s for a persisted step that nobody writes: its memory went
        # with the node it replaces; 5 s instead of 60)
        faulty = run_job(SCRIPT, job="flip", flags=("--nproc-per-node", "3", "--max-restarts", "2",
                                                    "--set", "ckpt.persist_grace_s=5"))
        clean_out, clean_err = torchrun.communicate(timeout=120)
    decision = _decided(faulty, "flip", torchrun, clean_err, rule="replica-mismatch", action="relaunch", rank=2)
    assert "replica mismatch: rank 2 (host " in decision["evidence"] and "at step 4" in decision["evidence"]
    assert "(2 of 3 replicas agree) in 0.weight" in decision["evidence"]
    assert "last agreed at step 3" in decision["evidence"]
    assert _weights(faulty.stdout) == _weights(clean_out)  # the flipped step was never saved
