"""The README's training scripts (DDP, FSDP2), run exactly as written, recover to the uninterrupted result.

Each recipe runs with 2 gloo workers, side by side: uninterrupted under plain torchrun
(the reference); under `stead run` with rank 1 crashing mid-epoch (restored from the
agent's memory); and, for the FSDP2 recipe, under torchrun SIGKILLed as a whole mid-epoch,
then run again (restored from disk: DCP's files, the harder of the two). The DDP recipe's
disk restore without an agent is the same code path on a replicated state
(tests/plugins/ckpt/test_flash.py's agentless test); a third run of it costs the suite four
more torch processes. Faults and the final-state dump come from tests.support.recipes'
hook, so the scripts stay the README's. In every run each rank's optimizer state (AdamW's
moments and step) and parameters end equal to the reference's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.readme import readme_files
from tests.support.recipes import assert_same, crashed_against_reference, final, recipe_env, run_three_ways

pytestmark = pytest.mark.e2e

FAULT_AT_STEP = 11  # optimizer steps of a process (2 epochs of 256 samples, 2 ranks, batches of 8: 32 steps)


@pytest.mark.long(20)
def test_the_readme_ddp_recipe_recovers_to_the_uninterrupted_optimizer_state(tmp_path: Path) -> None:
    recipe = "recipes/train_ddp.py"
    crashed_against_reference(tmp_path, recipe, readme_files()[recipe], "recipe",
                              lambda cwd, fault: recipe_env(cwd, fault, FAULT_AT_STEP))


@pytest.mark.long(45)
def test_the_readme_fsdp_recipe_recovers_to_the_uninterrupted_optimizer_state(tmp_path: Path) -> None:
    recipe = "recipes/train_fsdp.py"
    runs = run_three_ways(tmp_path, recipe, readme_files()[recipe], FAULT_AT_STEP, "recipe")
    for rank in (0, 1):
        want = final(runs.reference, rank)
        assert want["optim"], "the reference run has no optimizer state"
        for name, run in (("stead run with a crash", runs.crashed), ("torchrun killed and relaunched", runs.killed)):
            assert_same(final(run, rank), want, f"{name}, rank {rank}")
