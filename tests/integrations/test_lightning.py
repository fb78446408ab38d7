"""stead's Lightning integration: the flash checkpoint's save and resume, refusals, and the README recipe under stead.

The unit tests run Lightning in this process (one CPU device: the flash checkpoint is disk-only then).
The end-to-end test runs the README's recipe as written, twice side by side with 2 gloo workers:
uninterrupted under plain torchrun (the reference), and under ``stead run`` with rank 1 crashing
mid-epoch (resumed from the agent's memory); a ``sitecustomize`` hook (an optimizer step hook) makes the
crash and dumps each rank's final state, which must equal the reference's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from stead.cli.run_args import parse_run_args
from stead.core.runspec import worker_env
from stead.integrations import IntegrationError
from stead.integrations.lightning import (
    FLASH_PATH,
    FlashCheckpoint,
    FlashCheckpointIO,
    ResumableLoader,
    check_version,
    codec_safe,
)
from stead.plugins.ckpt.errors import UnsupportedState
from stead.plugins.ckpt.settings import CheckpointSettings
from tests.support.readme import readme_files
from tests.support.recipes import crashed_against_reference, final, recipe_env

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/lightning_fit.py"
FAULT_AT_STEP = 11  # of 24 optimizer steps; 16 batches an epoch per rank: mid-epoch 0


def _recipe() -> str:
    """The README's Lightning recipe, as written."""
    return readme_files()[RECIPE]


# -- a small model, trained in this process ---------------------------------------------------------------


class Regression(LightningModule):  # type: ignore[misc]
    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Linear(features, 1)
        self.save_hyperparameters({"features": features, "root": Path("/data"), "table": np.arange(3)})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> ResumableLoader:
        x = torch.randn(32, self.net.in_features, generator=torch.Generator().manual_seed(0))
        data = TensorDataset(x, x.sum(dim=1, keepdim=True))
        sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0)  # shuffled; a new order each epoch
        return ResumableLoader(DataLoader(data, batch_size=4, sampler=sampler), self.trainer)  # 8 batches


def _trainer(flash: FlashCheckpoint, max_steps: int, **kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[flash], use_distributed_sampler=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, logger=False,
                   **kwargs)


def _flash(tmp_path: Path, persist_every: int | None = None) -> FlashCheckpoint:
    io = FlashCheckpointIO(settings=CheckpointSettings(dir=str(tmp_path / "ckpt")), job="unit")
    return FlashCheckpoint(every_n_steps=1, persist_every_n_steps=persist_every, io=io)


def _state(trainer: Trainer, model: Regression) -> dict[str, Any]:
    optimizer = trainer.optimizers[0]
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": optimizer.state_dict()["state"], "lr": optimizer.param_groups[0]["lr"],
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],
            "step": trainer.global_step, "epoch": trainer.current_epoch}


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    else:
        assert got == want, where


@pytest.fixture
def seeded() -> Iterator[None]:
    torch.manual_seed(0)
    yield


def test_a_fit_resumed_from_a_persisted_step_ends_where_an_uninterrupted_one_does(tmp_path: Path,
                                                                                   seeded: None) -> None:
    whole_flash = _flash(tmp_path / "whole")
    whole_model = Regression()
    whole = _trainer(whole_flash, 11, plugins=[whole_flash.io])
    whole.fit(whole_model)

    torch.manual_seed(0)
    first_flash = _flash(tmp_path / "split", persist_every=3)
    first = _trainer(first_flash, 6, plugins=[first_flash.io])  # stops at step 6, mid-epoch (8 batches an epoch)
    first.fit(Regression())
    torch.manual_seed(1)  # the resumed run's own weights and generators must not matter
    again_flash = _flash(tmp_path / "split")
    again_model = Regression()
    again = _trainer(again_flash, 11, plugins=[again_flash.io])
    assert again_flash.resume_path() == FLASH_PATH
    again.fit(again_model, ckpt_path=FLASH_PATH)

    _assert_same(_state(again, again_model), _state(whole, whole_model))


def test_nothing_to_resume_gives_no_ckpt_path(tmp_path: Path) -> None:
    flash = _flash(tmp_path)
    try:
        assert flash.resume_path() is None
        assert flash.resume_path(otherwise="last") == "last"
    finally:
        flash.io.close()


def test_a_checkpoint_of_another_model_is_refused_naming_keys_and_nothing_is_loaded(tmp_path: Path,
                                                                                     seeded: None) -> None:
    saving = _flash(tmp_path, persist_every=2)
    _trainer(saving, 2, plugins=[saving.io]).fit(Regression(features=4))
    loading = _flash(tmp_path)
    other = Regression(features=3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    trainer = _trainer(loading, 4, plugins=[loading.io])
    with pytest.raises(IntegrationError, match=r"not a checkpoint of this Regression.*net\.weight \(1, 4\) != "
                                               r"\(1, 3\).*nothing was loaded"):
        trainer.fit(other, ckpt_path=loading.resume_path())
    _assert_same(other.state_dict(), before)
    assert trainer.global_step == 0


class TwoGroups(Regression):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([{"params": [self.net.weight]}, {"params": [self.net.bias]}], lr=0.1)


def test_a_checkpoint_of_other_optimizers_is_refused_before_their_state_is_loaded(tmp_path: Path,
                                                                                   seeded: None) -> None:
    saving = _flash(tmp_path, persist_every=2)
    _trainer(saving, 2, plugins=[saving.io]).fit(Regression())
    loading = _flash(tmp_path)
    trainer = _trainer(loading, 4, plugins=[loading.io])
    with pytest.raises(IntegrationError, match=r"sizes \[\[2\]\] and 1 scheduler.*gave \[\[1, 1\]\] and 0.*"
                                               r"its optimizers not"):
        trainer.fit(TwoGroups(), ckpt_path=loading.resume_path())
    assert not trainer.optimizers[0].state


def test_a_checkpoint_file_from_a_newer_lightning_is_refused_before_loading(tmp_path: Path) -> None:
    io = FlashCheckpointIO()
    io.module = Regression()
    path = tmp_path / "future.ckpt"
    torch.save({"pytorch-lightning_version": "9.1.0", "state_dict": io.module.state_dict()}, path)
    with pytest.raises(IntegrationError, match=r"saved by Lightning 9\.1\.0, newer than .*install Lightning >=9\.1"):
        io.load_checkpoint(path)


def test_a_trainer_that_saves_through_another_checkpoint_io_is_refused(tmp_path: Path) -> None:
    flash = _flash(tmp_path)
    with pytest.raises(IntegrationError, match=r"through TorchCheckpointIO.*plugins=\[flash\.io\]"):
        _trainer(flash, 2).fit(Regression())


def test_a_lightning_outside_the_supported_range_is_refused() -> None:
    check_version("2.6.6")
    for version in ("2.4.0", "3.0.0rc1"):
        with pytest.raises(IntegrationError, match=r"lightning >=2\.5,<3.*" + re.escape(version)
                                                   + r".*stead\[lightning\]"):
            check_version(version)


def test_codec_safe_converts_what_the_codec_refuses_and_names_what_it_cannot() -> None:
    safe = codec_safe({"state_dict": {"w": torch.ones(2)}, "n": np.int64(3), "a": np.arange(2),
                       "hyper_parameters": {"root": Path("/data"), "fn": len}, "where": Path("/ckpt")})
    assert safe["n"] == 3 and torch.equal(safe["a"], torch.arange(2)) and safe["where"] == "/ckpt"
    assert safe["hyper_parameters"] == {"root": "/data", "fn": repr(len)}
    with pytest.raises(UnsupportedState, match=r"checkpoint's \['callbacks'\]\['cb'\] is a builtins\.object"):
        codec_safe({"callbacks": {"cb": object()}})


def test_fabric_saves_on_every_rank_and_loads_from_the_flash_checkpoint(tmp_path: Path, seeded: None) -> None:
    io = FlashCheckpointIO(settings=CheckpointSettings(dir=str(tmp_path / "ckpt")), job="fabric")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model.weight.grad = torch.ones_like(model.weight)
    optimizer.step()
    assert io.save_fabric(fabric, 1, {"model": model, "optimizer": optimizer, "epoch": 4}, persist=True)
    io.close()

    fresh, fresh_optimizer = torch.nn.Linear(3, 2), None
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    reader = FlashCheckpointIO(settings=CheckpointSettings(dir=str(tmp_path / "ckpt")), job="fabric")
    try:
        assert reader.resume_path() == FLASH_PATH
        rest = Fabric(accelerator="cpu", devices=1, plugins=[reader]).load(
            FLASH_PATH, {"model": fresh, "optimizer": fresh_optimizer})
    finally:
        reader.close()
    assert rest["epoch"] == 4
    _assert_same(fresh.state_dict(), model.state_dict())
    _assert_same(fresh_optimizer.state_dict()["state"], optimizer.state_dict()["state"])


def test_lightning_sees_a_stead_worker_as_launched_by_torchelastic(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("")
    config = parse_run_args(["--nproc-per-node", "2", "train.py"], environ={}, cwd=str(tmp_path))
    env = worker_env(config, local_rank=1, node_rank=0, nnodes=1, restart_count=0, master_addr="127.0.0.1",
                     master_port=29400, world_size=2, run_id="job", environ={})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert TorchElasticEnvironment.detect()
    elastic = TorchElasticEnvironment()
    assert (elastic.world_size(), elastic.global_rank(), elastic.local_rank(), elastic.node_rank()) == (2, 1, 1, 0)
    assert (elastic.main_address, elastic.main_port) == ("127.0.0.1", 29400)


# -- the README recipe, under stead with a crash, against torchrun uninterrupted --------------------------

@pytest.mark.e2e
@pytest.mark.long(50)
def test_the_readme_recipe_resumes_a_crashed_worker_to_the_uninterrupted_state(tmp_path: Path) -> None:
    crashed = crashed_against_reference(tmp_path, RECIPE, _recipe(), "lightning",
                                        lambda cwd, fault: recipe_env(cwd, fault, FAULT_AT_STEP))
    for rank in (0, 1):  # parameters, AdamW's state, the learning rate: the reference's, which ran its 24 steps
        assert int(final(crashed, rank)["optim"][0]["step"]) == 24
