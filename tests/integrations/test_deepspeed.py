"""stead.integrations.deepspeed: FlashState keeps what ``engine.save_checkpoint`` saves and DeepSpeed loads it back,
checkpoints that do not fit and engines it cannot serve are refused with nothing loaded, and the README's DeepSpeed
recipe recovers from a crash to the uninterrupted result.

The unit tests run DeepSpeed in this process, a data-parallel world of one on a gloo group that the
whole module shares (DeepSpeed keeps its process groups for the life of the process), in disk mode
(no agent: ``persist=True`` saves are written to disk). The end-to-end test runs the recipe with 2
gloo workers under ``stead run`` and plain ``torchrun`` side by side; the fault and the final-state
dump come from a ``sitecustomize`` module (an optimizer step hook: the ZeRO partition's torch optimizer).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deepspeed
import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.fp16.loss_scaler import LossScaler

from stead.ckpt import Checkpoint, FlashCheckpointer, StateMismatch, UnsupportedState
from stead.integrations import IntegrationError
from stead.integrations.deepspeed import FlashState
from tests.support.readme import readme_files
from tests.support.recipes import assert_same, crashed_against_reference, recipe_env

RECIPE = "recipes/deepspeed_zero.py"
#: rank 1 crashes after its 12th of 24 optimizer steps
FAULT_AT_STEP = 12


def _recipe() -> str:
    """The README's DeepSpeed script, exactly as written there."""
    return readme_files()[RECIPE]


# -- one process, disk mode ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo group of one for the module, and DeepSpeed's own groups made (a first engine) before any test looks
    for listening ports: neither is freed before the process ends."""
    with pytest.MonkeyPatch.context() as env:
        for name in ("RANK", "WORLD_SIZE", "STEAD_CKPT_PATH"):
            env.delenv(name, raising=False)
        env.setenv("LOCAL_RANK", "0")  # deepspeed.initialize asks for it
        # DeepSpeed's CPU shared-memory all-reduce (a JIT-compiled op it uses only when LOCAL_SIZE is the world
        # size, which neither torchrun nor stead sets) is not built: 35 s of compiling on the CI machine
        env.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
        store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        _engine(1)
        yield
        dist.destroy_process_group()


#: what each unit test runs on: the module's group (not the whole job's test: the e2e tests run first, and a group
#: made again after its teardown would not serve DeepSpeed, which keeps the first one's)
one_process = pytest.mark.usefixtures("gloo")


@pytest.fixture(autouse=True)
def in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.chdir(tmp_path)  # stead's checkpoints go under ./.stead
    return tmp_path


def _engine(stage: int, *, width: int = 2, scheduler: bool = True, bf16: bool = False, **zero: Any) -> Any:
    """A DeepSpeed engine over a small model, AdamW and (``scheduler``) WarmupLR; the same for the same arguments."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, width))
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1 << 30,
                              "zero_optimization": {"stage": stage, **zero}, "bf16": {"enabled": bf16}}
    if scheduler:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.1}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=config)
    return engine


def _train(engine: Any, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 4, dtype=next(engine.module.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()


def _snapshot(engine: Any) -> dict[str, Any]:
    """What training goes on from: the torch optimizer's parameters (ZeRO's fp32 partition) and state, the weights,
    the learning rate and DeepSpeed's counters."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    params = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3 keeps them out of param_groups
    if params is None:
        params = [p for group in base.param_groups for p in group["params"]]
    return {"params": [p.detach().clone() for p in params],
            "optim": [{n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in state.items()}
                      for state in base.state.values()],
            "weights": {n: t.clone() for n, t in engine.module.state_dict().items()}, "lr": engine.get_lr(),
            "counters": [engine.global_steps, engine.global_samples, engine.skipped_steps]}


def _flash(engine: Any) -> FlashState:
    return FlashState(engine, flash=FlashCheckpointer(job="unit"))


@one_process
@pytest.mark.parametrize(("stage", "bf16"), [(0, False), (1, False), (2, False), (3, False), (1, True)])
def test_a_persisted_save_comes_back_whole_into_a_fresh_engine(stage: int, bf16: bool, in_tmp: Path) -> None:
    engine = _engine(stage, bf16=bf16)
    _train(engine, 3)
    with _flash(engine) as flash:
        assert flash.flash.mode == "disk"
        assert not flash.save(2)  # without an agent only persisted saves are kept
        assert flash.save(3, client_state={"epoch": 1, "seen": torch.arange(3)}, persist=True)
    saved, draw = _snapshot(engine), torch.rand(3)
    _train(engine, 2)  # moves on: the restore must undo all of it

    engine = _engine(stage, bf16=bf16)  # a restarted process: a fresh engine
    with _flash(engine) as flash:
        restored = flash.load()
    assert restored is not None and restored.step == 3
    assert restored.client_state["epoch"] == 1 and torch.equal(restored.client_state["seen"], torch.arange(3))
    assert_same(_snapshot(engine), saved, "state")
    assert torch.equal(torch.rand(3), draw)  # the random generators too
    if stage in (1, 2) and not bf16:  # ZeRO's loss scaler went through plain data and back
        assert type(engine.optimizer.loss_scaler) is LossScaler and engine.optimizer.loss_scaler.cur_scale == 1.0
    _train(engine, 1)  # and training goes on
    assert sorted(p.name for p in in_tmp.iterdir()) == [".stead"]  # no DeepSpeed folder, no `latest`


@one_process
def test_nothing_saved_loads_nothing() -> None:
    engine = _engine(1)
    before = _snapshot(engine)
    with _flash(engine) as flash:
        assert flash.load() is None
    assert_same(_snapshot(engine), before, "state")


@one_process
def test_deepspeeds_own_save_checkpoint_still_writes_its_folder(in_tmp: Path) -> None:
    engine = _engine(2)
    _train(engine, 1)
    with _flash(engine) as flash:
        flash.save(1, persist=True)
    engine.save_checkpoint(str(in_tmp / "ds"), tag="one")
    assert (in_tmp / "ds" / "latest").read_text() == "one"
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= {
        p.name for p in (in_tmp / "ds" / "one").iterdir()}
    assert (in_tmp / "ds" / "zero_to_fp32.py").exists()


def _assert_refused_with_nothing_loaded(engine: Any, *expected: str) -> None:
    before, rng = _snapshot(engine), torch.get_rng_state()
    with _flash(engine) as flash, pytest.raises(StateMismatch) as refused:
        flash.load()
    for words in expected:
        assert words in str(refused.value)
    assert "nothing was loaded" in str(refused.value)
    assert_same(_snapshot(engine), before, "state")
    assert torch.equal(torch.get_rng_state(), rng)


def _save_trained(engine: Any) -> None:
    _train(engine, 2)
    with _flash(engine) as flash:
        flash.save(1, persist=True)


@one_process
def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor() -> None:
    _save_trained(_engine(2, width=2))
    engine = _engine(2, width=3)
    _train(engine, 1)
    _assert_refused_with_nothing_loaded(engine, "['module']['2.weight'] is float32[2, 8] in the checkpoint and "
                                                "float32[3, 8] here")


@one_process
def test_a_checkpoint_of_another_zero_stage_is_refused() -> None:
    _save_trained(_engine(1))
    _assert_refused_with_nothing_loaded(_engine(2), "ZeRO stage 1 in the checkpoint, 2 here")


@one_process
def test_a_checkpoint_of_another_precision_is_refused() -> None:
    _save_trained(_engine(1))
    _assert_refused_with_nothing_loaded(_engine(1, bf16=True), "precision 'fp32' in the checkpoint, 'bf16' here")


@one_process
def test_a_checkpoint_without_the_scheduler_is_refused() -> None:
    _save_trained(_engine(1, scheduler=False))
    _assert_refused_with_nothing_loaded(_engine(1), "no learning-rate scheduler's state in the checkpoint, a scheduler")


@one_process
def test_a_checkpoint_of_an_unsupported_deepspeed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(1)
    with monkeypatch.context() as old:
        old.setattr(deepspeed, "__version__", "0.17.6")
        _save_trained(engine)
    _assert_refused_with_nothing_loaded(_engine(1), "saved with deepspeed 0.17.6, outside the supported >=0.18,<0.20")


@one_process
def test_a_checkpoint_of_another_framework_is_refused() -> None:
    engine = _engine(1)
    with Checkpoint(model=engine.module, flash=FlashCheckpointer(job="unit")) as ckpt:  # stead.ckpt's own layout
        ckpt.save(0, persist=True)
    _assert_refused_with_nothing_loaded(engine, "not saved by stead.integrations.deepspeed.FlashState")


@one_process
def test_a_client_state_the_checkpoint_cannot_hold_is_refused_naming_its_place() -> None:
    with _flash(_engine(1)) as flash, pytest.raises(UnsupportedState, match=r"\['when'\] is a builtins.object"):
        flash.save(0, client_state={"when": object()}, persist=True)


@one_process
def test_a_deepspeed_outside_the_supported_range_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    monkeypatch.delitem(sys.modules, "stead.integrations.deepspeed")  # put back as it was after the test
    with pytest.raises(IntegrationError) as refused:
        importlib.import_module("stead.integrations.deepspeed")
    assert "supports deepspeed >=0.18,<0.20; this environment has deepspeed 0.20.0" in str(refused.value)
    assert "pip install 'stead[deepspeed]'" in str(refused.value)


@one_process
def test_an_engine_whose_files_deepspeed_reads_itself_is_refused() -> None:
    with pytest.raises(IntegrationError, match=r"elastic_checkpoint .*Use engine\.save_checkpoint\(dir\)"):
        FlashState(_engine(1, elastic_checkpoint=True))
    with pytest.raises(IntegrationError, match=r"takes the engine that deepspeed\.initialize returns"):
        FlashState(torch.nn.Linear(2, 2))


# -- a whole job: 2 gloo workers under stead run and torchrun -------------------------------------------------


@pytest.mark.e2e
@pytest.mark.long(40)
def test_the_readme_recipe_recovers_to_the_uninterrupted_state(tmp_path: Path) -> None:
    """Under `stead run` rank 1 crashes mid-run and resumes from memory; the disk path (what torchrun resumes from) is
    the unit tests' round trip."""
    crashed_against_reference(tmp_path, RECIPE, _recipe(), "zero",
                              lambda cwd, fault: recipe_env(cwd, fault, FAULT_AT_STEP, RECIPE_NO_DEEPSPEED_SHM_OP="1"))
