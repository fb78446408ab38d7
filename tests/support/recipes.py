"""Running the README's recipe scripts as users do (`stead run`, torchrun), with a fault at an optimizer step.

The fault and the state the tests compare come from a ``sitecustomize`` module on ``PYTHONPATH``
(an optimizer step post-hook), so the scripts stay exactly the README's. After every optimizer step
each rank writes ``final-RANK.pt``: its optimizer's state (moments, step counts), learning rates and
parameters (a DTensor's local shard), and appends its process id to ``steps-RANK``. With
``RECIPE_FAULT=crash`` rank 1 exits (code 17) after its ``RECIPE_FAULT_AT``-th step; with ``kill``
it SIGKILLs its whole process group (torchrun with its workers); once per directory (a ``faulted``
file marks it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from stead.core.config import env_name
from stead.testing.leaks import SHM_NAMESPACE_ENV

__all__ = ["FAULT_HOOK", "ThreeRuns", "assert_same", "crashed_against_reference", "final", "recipe_env",
           "run_three_ways", "stead_run", "steps_by_process", "torchrun", "workdir"]

FAULT_HOOK = """
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
        if os.environ.get("RANK") is None:  # stead's zygote imports this before any worker has a rank
            return
        steps[0] += 1
        rank = os.environ["RANK"]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.save({"optim": _local(optimizer.state_dict()["state"]), "params": [_local(p) for p in params],
                    "lr": [group["lr"] for group in optimizer.param_groups]}, f"final-{rank}.pt")
        with open(f"steps-{rank}", "a") as steps_log:
            steps_log.write(f"{os.getpid()}\\n")
        fault = os.environ["RECIPE_FAULT"]
        if fault and steps[0] == int(os.environ["RECIPE_FAULT_AT"]) and rank == "1" and not os.path.exists("faulted"):
            open("faulted", "w").close()
            if fault == "crash":
                os._exit(17)
            os.killpg(0, signal.SIGKILL)  # the whole torchrun: launcher and workers

    register_optimizer_step_post_hook(_after_step)

if os.environ.get("RECIPE_NO_DEEPSPEED_SHM_OP"):
    # DeepSpeed on the CPU JIT-compiles a shared-memory all-reduce at its first start (35 s on the CI machine) that
    # it uses only when LOCAL_SIZE is the world size, which neither torchrun nor stead sets: not built here
    import importlib.abc
    import importlib.util
    import sys

    class _NoShmOp(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "deepspeed.comm.torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.build_shm_op = lambda: None

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _NoShmOp())
"""

#: a whole run on the 2-core CI machine takes 10-60 s; this only ends a hung one
RUN_TIMEOUT_S = 240


def workdir(tmp: Path, name: str, path: str, text: str) -> Path:
    """A directory of its own for one run: the script at ``path`` and the fault hook."""
    cwd = tmp / name
    (cwd / "hooks").mkdir(parents=True)
    (cwd / "hooks" / "sitecustomize.py").write_text(textwrap.dedent(FAULT_HOOK))
    (cwd / path).parent.mkdir(parents=True, exist_ok=True)
    (cwd / path).write_text(text)
    return cwd


def recipe_env(cwd: Path, fault: str, at_step: int, **extra: str) -> dict[str, str]:
    """This environment without stead's and torchrun's own variables, plus the hook's (``fault``: "", crash, kill)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STEAD_", "TORCHELASTIC_")) or k in (SHM_NAMESPACE_ENV, env_name("", "spare_agents"))}
    env.update(PYTHONPATH=os.pathsep.join([str(cwd / "hooks"), env.get("PYTHONPATH", "")]), RECIPE_FAULT=fault,
               RECIPE_FAULT_AT=str(at_step), PERSIST_EVERY="5", **extra)
    return env


def torchrun(cwd: Path, script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # (TMPDIR: torchrun's own log folder, torchelastic_*, which it never removes, goes with the test's folder)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           script], cwd=cwd, env={**env, "TMPDIR": str(cwd)}, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, start_new_session=True)


def stead_run(cwd: Path, script: str, env: dict[str, str], job: str = "recipe") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stead", "run", "--nproc-per-node", "2", "--max-restarts", "2",
                           "--job-name", job, script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def steps_by_process(cwd: Path, rank: int) -> list[int]:
    """The optimizer steps each process of rank ``rank`` ran, in the order the processes ran."""
    counts: dict[str, int] = {}
    for pid in (cwd / f"steps-{rank}").read_text().split():
        counts[pid] = counts.get(pid, 0) + 1
    return list(counts.values())


def final(cwd: Path, rank: int) -> dict[str, Any]:
    """What rank ``rank`` held after its last optimizer step (see the module docstring)."""
    state: dict[str, Any] = torch.load(cwd / f"final-{rank}.pt", weights_only=False)
    return state


def assert_same(got: Any, want: Any, where: str) -> None:
    """``got`` equals ``want`` (tensors within float tolerance), naming the first place that differs."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, where
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), f"{where}: {(got - want).abs().max()}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


@dataclasses.dataclass(frozen=True)
class ThreeRuns:
    """The directories of :func:`run_three_ways`' runs, and the output of the ones a test looks into."""

    reference: Path
    crashed: Path
    killed: Path
    job: subprocess.CompletedProcess[str]
    relaunch: subprocess.CompletedProcess[str]


def run_three_ways(tmp: Path, path: str, text: str, fault_at: int, job: str, **env: str) -> ThreeRuns:
    """The script three ways side by side, each in its own directory: uninterrupted under torchrun (the reference);
    under `stead run` with rank 1 crashing after step ``fault_at``; under torchrun SIGKILLed as a whole there, then run
    again. Asserts that each ended as it should (the reference and the relaunch succeeded, stead after one restart)."""
    reference, crashed, killed = (workdir(tmp, name, path, text) for name in ("reference", "stead", "torchrun"))
    kill = recipe_env(killed, "kill", fault_at, **env)
    with ThreadPoolExecutor(3) as pool:
        reference_run = pool.submit(torchrun, reference, path, recipe_env(reference, "", fault_at, **env))
        stead_job = pool.submit(stead_run, crashed, path, recipe_env(crashed, "crash", fault_at, **env), job)
        killed_runs = pool.submit(lambda: (torchrun(killed, path, kill), torchrun(killed, path, kill)))
    done = reference_run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stead = stead_job.result()
    assert stead.returncode == 0, stead.stderr[-4000:]
    assert (crashed / "faulted").exists() and "succeeded after 1 restart(s)" in stead.stderr
    first, again = killed_runs.result()
    assert first.returncode != 0 and (killed / "faulted").exists()
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return ThreeRuns(reference, crashed, killed, stead, again)


def crashed_against_reference(tmp: Path, path: str, text: str, job: str, env: Any) -> Path:
    """The script twice side by side: uninterrupted under torchrun, and under `stead run` with rank 1 crashing (the
    environments ``env(cwd, fault)`` gives). Asserts that both succeeded, stead after one restart from memory, and
    that each rank ended with the reference's state (it must hold an optimizer state); returns stead's directory."""
    reference, crashed = (workdir(tmp, name, path, text) for name in ("reference", "stead"))
    with ThreadPoolExecutor(2) as pool:  # independent runs side by side, each in its own directory
        reference_run = pool.submit(torchrun, reference, path, env(reference, ""))
        stead_job = pool.submit(stead_run, crashed, path, env(crashed, "crash"), job)
    done, stead = reference_run.result(), stead_job.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert stead.returncode == 0, stead.stderr[-4000:]
    assert (crashed / "faulted").exists() and "succeeded after 1 restart(s)" in stead.stderr
    assert re.search(r"ckpt_restored.*tier=memory", stead.stdout + stead.stderr), stead.stderr[-4000:]
    for rank in (0, 1):
        want = final(reference, rank)
        assert want["optim"], "the reference run has no optimizer state"
        assert_same(final(crashed, rank), want, f"stead run with a crash, rank {rank}")
    return crashed
