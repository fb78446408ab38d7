"""stead.integrations.accelerate: FlashState saves and restores what ``Accelerator.save_state`` would, refuses what
does not fit with nothing loaded, and the README's Accelerate recipe recovers from a crash to the uninterrupted result.

The unit tests run one process in disk mode (no agent: ``persist=True`` saves are written to
disk). The end-to-end tests run 2 gloo workers under ``stead run`` and plain ``torchrun``
side by side; faults and the final-state dump come from a ``sitecustomize`` module (an
optimizer step hook), so the recipe runs as the README shows it.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import accelerate
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader, TensorDataset

from stead.ckpt import Checkpoint, FlashCheckpointer, StateMismatch
from stead.integrations import IntegrationError
from stead.integrations.accelerate import FlashState
from tests.support.readme import readme_files
from tests.support.recipes import assert_same, crashed_against_reference, recipe_env, stead_run, workdir

RECIPE = "recipes/accelerate_loop.py"
#: optimizer steps of a process: 2 epochs of 256 samples, 2 ranks, batches of 8 = 16 a rank an epoch; 24 is in epoch 1
FAULT_AT_STEP = 24


def _recipe() -> str:
    """The README's Accelerate script, exactly as written there."""
    return readme_files()[RECIPE]


# -- one process, disk mode ------------------------------------------------------------------------


class Counter:
    """A registered custom object, as ``accelerator.register_for_checkpointing`` takes one."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


@pytest.fixture(autouse=True)
def fresh_accelerate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Each test its own Accelerate singletons, one process, checkpoints under its tmp_path."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "STEAD_CKPT_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _setup(width: int = 2) -> tuple[Accelerator, Any, Any, Any, Counter]:
    """A prepared model, AdamW, StepLR, shuffled dataloader and registered counter; the same for the same width."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, width)), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, counter


def _train(accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, counter: Counter,
           steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 4)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.seen += 1


def _snapshot(model: Any, optimizer: Any, scheduler: Any, counter: Counter) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "optim": {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()},
            "lr": [g["lr"] for g in optimizer.param_groups], "scheduler": scheduler.state_dict(),
            "seen": counter.seen}


def test_a_persisted_save_comes_back_whole_into_fresh_objects() -> None:
    accelerator, model, optimizer, scheduler, counter = _setup()
    _train(accelerator, model, optimizer, scheduler, counter, 3)
    accelerator.step, accelerator.project_configuration.iteration = 7, 2
    accelerator._dataloaders[0].set_epoch(3)
    with FlashState(accelerator, flash=FlashCheckpointer(job="unit")) as flash:
        assert flash.flash.mode == "disk"
        assert not flash.save(2)  # without an agent only persisted saves are kept
        assert flash.save(3, persist=True)
    saved, draw = _snapshot(model, optimizer, scheduler, counter), torch.rand(3)
    _train(accelerator, model, optimizer, scheduler, counter, 2)  # moves on: the restore must undo all of it
    AcceleratorState._reset_state(True)

    accelerator, model, optimizer, scheduler, counter = _setup()  # a restarted process: fresh optimizer, no state
    with FlashState(accelerator, flash=FlashCheckpointer(job="unit")) as flash:
        assert flash.load() == 3
    assert_same(_snapshot(model, optimizer, scheduler, counter), saved, "state")
    assert torch.equal(torch.rand(3), draw)  # the random generators too
    assert (accelerator.step, accelerator.project_configuration.iteration) == (7, 2)
    assert accelerator._dataloaders[0].iteration == 3


def test_nothing_saved_loads_nothing() -> None:
    accelerator, model, optimizer, scheduler, counter = _setup()
    before = _snapshot(model, optimizer, scheduler, counter)
    with FlashState(accelerator, flash=FlashCheckpointer(job="unit")) as flash:
        assert flash.load() is None
    assert_same(_snapshot(model, optimizer, scheduler, counter), before, "state")


def _assert_refused_with_nothing_loaded(accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any,
                                        counter: Counter, *expected: str) -> None:
    before, rng = _snapshot(model, optimizer, scheduler, counter), torch.get_rng_state()
    with FlashState(accelerator, flash=FlashCheckpointer(job="unit")) as flash, \
            pytest.raises(StateMismatch) as refused:
        flash.load()
    for words in expected:
        assert words in str(refused.value)
    assert "nothing was loaded" in str(refused.value)
    assert_same(_snapshot(model, optimizer, scheduler, counter), before, "state")
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_checkpoint_of_another_model_is_refused_naming_its_keys() -> None:
    accelerator, model, optimizer, scheduler, counter = _setup(width=2)
    _train(accelerator, model, optimizer, scheduler, counter, 2)
    with FlashState(accelerator, flash=FlashCheckpointer(job="unit")) as flash:
        flash.save(1, persist=True)
    AcceleratorState._reset_state(True)

    accelerator, model, optimizer, scheduler, counter = _setup(width=3)
    _assert_refused_with_nothing_loaded(accelerator, model, optimizer, scheduler, counter,
                                        "['model']['weight'] is float32[2, 4] in the checkpoint and float32[3, 4]")


def test_a_checkpoint_with_other_registered_objects_is_refused() -> None:
    accelerator, model, optimizer, scheduler, counter = _setup()
    with FlashState(accelerator, flash=FlashCheckpointer(job="unit")) as flash:
        flash.save(0, persist=True)
    AcceleratorState._reset_state(True)

    accelerator, model, optimizer, scheduler, counter = _setup()
    accelerator.register_for_checkpointing(Counter())
    _assert_refused_with_nothing_loaded(accelerator, model, optimizer, scheduler, counter,
                                        "1 custom in the checkpoint, 2 prepared here")


def test_a_checkpoint_of_an_unsupported_accelerate_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, model, optimizer, scheduler, counter = _setup()
    with monkeypatch.context() as old, FlashState(accelerator, flash=FlashCheckpointer(job="unit")) as flash:
        old.setattr(accelerate, "__version__", "0.34.2")
        flash.save(0, persist=True)
    _assert_refused_with_nothing_loaded(accelerator, model, optimizer, scheduler, counter,
                                        "saved with accelerate 0.34.2, outside the supported >=1.10,<2")


def test_a_checkpoint_of_another_framework_is_refused() -> None:
    accelerator, model, optimizer, scheduler, counter = _setup()
    with Checkpoint(model=model, flash=FlashCheckpointer(job="unit")) as ckpt:  # stead.ckpt's own layout
        ckpt.save(0, persist=True)
    _assert_refused_with_nothing_loaded(accelerator, model, optimizer, scheduler, counter,
                                        "not saved by stead.integrations.accelerate.FlashState")


def test_an_accelerate_outside_the_supported_range_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accelerate, "__version__", "2.0.0")
    monkeypatch.delitem(sys.modules, "stead.integrations.accelerate")  # put back as it was after the test
    with pytest.raises(IntegrationError) as refused:
        importlib.import_module("stead.integrations.accelerate")
    assert "supports accelerate >=1.10,<2; this environment has accelerate 2.0.0" in str(refused.value)
    assert "pip install 'stead[accelerate]'" in str(refused.value)


def test_an_engine_with_checkpoints_of_its_own_is_refused() -> None:
    with pytest.raises(IntegrationError, match=r"use accelerator\.save_state"):
        FlashState(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))


# -- whole jobs: 2 gloo workers under stead run and torchrun ----------------------------------------------

PLAIN_SCRIPT = """
import json
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batches = 0
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    batches += 1
seen = {"processes": accelerator.num_processes, "index": accelerator.process_index,
        "local": accelerator.local_process_index, "main": accelerator.is_main_process,
        "type": str(accelerator.distributed_type), "batches": batches, "rank": int(os.environ["RANK"]),
        "weights": [round(v, 6) for v in model.module.weight.flatten().tolist()]}
with open(f"seen-{accelerator.process_index}.json", "w") as out:
    json.dump(seen, out)
accelerator.end_training()
"""


def _env(cwd: Path, fault: str) -> dict[str, str]:
    # what `accelerate launch --cpu` sets: without a GPU, Accelerate starts its gloo group only then
    return recipe_env(cwd, fault, FAULT_AT_STEP, ACCELERATE_USE_CPU="1")


@pytest.mark.e2e
def test_a_plain_accelerator_script_runs_under_stead_as_under_torchrun(tmp_path: Path) -> None:
    """What torchrun gives an Accelerate script, stead gives it: two processes of one group, each its own ranks and
    half the batches, the main process on rank 0, and weights kept equal by DDP."""
    job = workdir(tmp_path, "stead", "train.py", textwrap.dedent(PLAIN_SCRIPT))
    done = stead_run(job, "train.py", _env(job, ""), "accel")
    assert done.returncode == 0, done.stderr[-3000:]

    seen = [json.loads((job / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, facts in enumerate(seen):
        assert facts["processes"] == 2 and facts["index"] == facts["local"] == facts["rank"] == rank
        assert facts["main"] == (rank == 0) and facts["type"] == "DistributedType.MULTI_CPU"
        assert facts["batches"] == 4  # 32 samples, batches of 4, shared by 2 processes
    assert seen[0]["weights"] == seen[1]["weights"]


@pytest.mark.e2e
@pytest.mark.long(25)
def test_the_readme_recipe_recovers_to_the_uninterrupted_state(tmp_path: Path) -> None:
    """Under `stead run` rank 1 crashes in epoch 1 and resumes from memory; the disk path (what torchrun resumes
    from) is the unit tests' round trip."""
    crashed_against_reference(tmp_path, RECIPE, _recipe(), "accel", _env)
