"""The README's training scripts (DDP, FSDP2), run exactly as written, recover to the uninterrupted result.

Each recipe runs three ways with 2 gloo workers, side by side: uninterrupted under plain torchrun
(the reference); under `stead run` with rank 1 crashing mid-epoch (restored from the
agent's memory); and under torchrun SIGKILLed as a whole mid-epoch, then run again
(restored from disk). Faults and the final-state dump come from a ``sitecustomize``
module on ``PYTHONPATH`` (an optimizer step hook), so the scripts stay the README's.
In every run each rank's optimizer state (AdamW's moments and step) and parameters
end equal to the reference's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from stead.core.config import env_name
from stead.testing.leaks import SHM_NAMESPACE_ENV

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FAULT_AT_STEP = 11  # optimizer steps of a process (2 epochs of 256 samples, 2 ranks, batches of 8: 32 steps)

SITECUSTOMIZE = """
import os
import signal

if os.environ.get("RECIPE_FAULT") is not None and "stead agent" not in " ".join(__import__("sys").argv):
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = [0]

    def _local(value):
        if hasattr(value, "to_local"):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: _local(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_local(v) for v in value]
        return value

    def _after_step(optimizer, args, kwargs):
        if os.environ.get("RANK") is None:
            return
        steps[0] += 1
        rank = os.environ["RANK"]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.save({"optim": _local(optimizer.state_dict()["state"]), "params": [_local(p) for p in params]},
                   f"final-{rank}.pt")
        fault = os.environ["RECIPE_FAULT"]
        if fault and steps[0] == int(os.environ["RECIPE_FAULT_AT"]) and rank == "1" and not os.path.exists("faulted"):
            open("faulted", "w").close()
            if fault == "crash":
                os._exit(17)
            os.killpg(0, signal.SIGKILL)  # the whole torchrun: launcher and workers

    register_optimizer_step_post_hook(_after_step)
"""


def recipes() -> dict[str, str]:
    blocks = re.findall(r"<!-- file: (recipes/\S+) -->\n```python\n(.*?)```", (ROOT / "README.md").read_text(),
                        flags=re.S)
    return dict(blocks)


def _env(tmp: Path, fault: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STEAD_", "TORCHELASTIC_")) or k in (SHM_NAMESPACE_ENV, env_name("", "spare_agents"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp / "hooks"), env.get("PYTHONPATH", "")]), RECIPE_FAULT=fault,
               RECIPE_FAULT_AT=str(FAULT_AT_STEP), PERSIST_EVERY="5")
    return env


def _torchrun(cwd: Path, script: str, fault: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script], cwd=cwd, env=_env(cwd, fault), capture_output=True, text=True, timeout=180,
                          start_new_session=True)


def _stead(cwd: Path, script: str, fault: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stead", "run", "--nproc-per-node", "2", "--max-restarts", "2",
                           "--job-name", "recipe", script], cwd=cwd, env=_env(cwd, fault), capture_output=True,
                          text=True, timeout=180)


def _workdir(tmp_path: Path, name: str, path: str, text: str) -> Path:
    cwd = tmp_path / name
    (cwd / "hooks").mkdir(parents=True)
    (cwd / "hooks" / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    (cwd / path).parent.mkdir(parents=True, exist_ok=True)
    (cwd / path).write_text(text)
    return cwd


def _final(cwd: Path, rank: int) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(cwd / f"final-{rank}.pt", weights_only=False)
    return state


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, where
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), f"{where}: {(got - want).abs().max()}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("recipe", ["recipes/train_ddp.py", "recipes/train_fsdp.py"])
def test_the_readme_recipe_recovers_to_the_uninterrupted_optimizer_state(recipe: str, tmp_path: Path) -> None:
    text = recipes()[recipe]
    reference = _workdir(tmp_path, "reference", recipe, text)
    crashed = _workdir(tmp_path, "stead", recipe, text)
    killed = _workdir(tmp_path, "torchrun", recipe, text)
    with ThreadPoolExecutor(3) as pool:  # three independent runs side by side (each in its own directory)
        reference_run = pool.submit(_torchrun, reference, recipe, "")
        stead_run = pool.submit(_stead, crashed, recipe, "crash")
        killed_runs = pool.submit(lambda: (_torchrun(killed, recipe, "kill"), _torchrun(killed, recipe, "kill")))

    done = reference_run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    job = stead_run.result()
    assert job.returncode == 0, job.stderr[-4000:]
    assert (crashed / "faulted").exists() and "succeeded after 1 restart(s)" in job.stderr
    first, again = killed_runs.result()
    assert first.returncode != 0 and (killed / "faulted").exists()
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]

    for rank in (0, 1):
        want = _final(reference, rank)
        assert want["optim"], "the reference run has no optimizer state"
        for name, run in (("stead run with a crash", crashed), ("torchrun killed and relaunched", killed)):
            _assert_same(_final(run, rank), want, f"{name}, rank {rank}")
