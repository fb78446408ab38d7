"""Hugging Face Trainer with stead's flash checkpoint (stead.integrations.transformers).

In-process: a Trainer run saves through the callback and a second Trainer resumes from it; what does not
fit (another model, another version, another output_dir, an unsupported transformers) is refused before
anything is loaded. End to end: the README's recipe under `stead run` with rank 1 crashing mid-epoch ends
where an uninterrupted torchrun run of the same script ends (weights, optimizer, scheduler, step, losses).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from stead.ckpt import FlashCheckpointer, StateMismatch
from stead.integrations import IntegrationError, require_version
from stead.integrations import transformers as integration
from tests.support.readme import readme_files
from tests.support.recipes import recipe_env, stead_run, steps_by_process, torchrun, workdir

RECIPE = "recipes/hf_trainer.py"
CRASH_AT = 7  # rank 1's optimizer steps before it dies (of 20)


def _recipe() -> str:
    return readme_files()[RECIPE]


# -- in process ------------------------------------------------------------------------------------------------


class _StopAt(TrainerCallback):  # type: ignore[misc]
    """Ends training after ``step`` steps, as a crash would (but in-process)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        control.should_training_stop = control.should_training_stop or state.global_step == self.step


def _trainer(tmp: Path, flash: integration.FlashCheckpoint, *, steps: int, width: int = 32,
             output_dir: str = "out", stop_at: int = 0) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=width, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, config.vocab_size, (32, 8))
    args = TrainingArguments(output_dir=str(tmp / output_dir), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, save_steps=4, save_strategy="steps", logging_steps=1, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True)
    return Trainer(model=GPT2LMHeadModel(config), args=args, callbacks=[flash, *([_StopAt(stop_at)] * bool(stop_at))],
                   train_dataset=[{"input_ids": t, "labels": t} for t in tokens])


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path


def _flash() -> integration.FlashCheckpoint:
    return integration.FlashCheckpoint(flash=FlashCheckpointer(job="unit"))


def _resume_folders() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("stead-hf-resume-*")} if Path("/dev/shm").is_dir() else set()


def test_a_trainer_resumes_where_the_persisted_flash_step_left_off(in_tmp: Path) -> None:
    """Under plain python (no agent) the steps persisted on save_steps are the ones a resume finds."""
    before = _resume_folders()
    _trainer(in_tmp, _flash(), steps=10, stop_at=6).train(resume_from_checkpoint=None)
    # persisted at step 4 (save_steps) and at the end of training (step 6)
    flash = _flash()
    again = _trainer(in_tmp, flash, steps=10)
    folder = flash.resume(again)
    assert folder is not None and folder.endswith("checkpoint-6")
    assert json.loads((Path(folder) / "trainer_state.json").read_text())["global_step"] == 6
    again.train(resume_from_checkpoint=folder)
    assert again.state.global_step == 10
    assert _resume_folders() == before, "the resume folder was left behind"

    # an uninterrupted run of 10 steps ends with the same weights
    reference = _trainer(in_tmp, integration.FlashCheckpoint(flash=FlashCheckpointer(job="reference")), steps=10,
                         output_dir="reference")
    reference.train()
    for (name, got), want in zip(again.model.state_dict().items(), reference.model.state_dict().values(),
                                 strict=True):
        assert torch.allclose(got, want, atol=1e-6), name


def test_nothing_saved_is_a_fresh_start(in_tmp: Path) -> None:
    flash = _flash()
    assert flash.resume(_trainer(in_tmp, flash, steps=2)) is None


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_loaded(in_tmp: Path) -> None:
    _trainer(in_tmp, _flash(), steps=4).train()
    before = _resume_folders()

    other = _flash()
    wider = _trainer(in_tmp, other, steps=8, width=48)
    weights = {k: v.clone() for k, v in wider.model.state_dict().items()}
    with pytest.raises(StateMismatch, match="another model") as err:
        other.resume(wider)
    assert "lm_head.weight [64, 32] torch.float32 (this model: [64, 48] torch.float32)" in str(err.value)
    assert all(torch.equal(v, weights[k]) for k, v in wider.model.state_dict().items())

    elsewhere = _flash()
    with pytest.raises(IntegrationError, match="output_dir"):
        elsewhere.resume(_trainer(in_tmp, elsewhere, steps=8, output_dir="elsewhere"))
    assert _resume_folders() == before


def test_a_checkpoint_of_another_transformers_version_is_refused(in_tmp: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(integration.transformers, "__version__", "5.0.0")
        _trainer(in_tmp, _flash(), steps=4).train()
    flash = _flash()
    with pytest.raises(IntegrationError, match=r"saved with transformers 5\.0\.0"):
        flash.resume(_trainer(in_tmp, flash, steps=8))


def test_an_unsupported_transformers_is_refused_with_what_to_install() -> None:
    with pytest.raises(IntegrationError, match=r"supports transformers >=5\.0,<6.*4\.57\.1.*stead\[transformers\]"):
        require_version("transformers", "4.57.1", at_least="5.0", below="6", extra="transformers")
    require_version("transformers", "5.24.0.dev0", at_least="5.0", below="6", extra="transformers")


def test_a_sharded_trainer_is_refused_with_what_to_do_instead(in_tmp: Path) -> None:
    flash = _flash()
    trainer = _trainer(in_tmp, flash, steps=2)
    trainer.args.fsdp = ["full_shard"]  # what TrainingArguments(fsdp=...) leaves there
    with pytest.raises(IntegrationError, match="with FSDP or DeepSpeed, leave FlashCheckpoint out"):
        flash.resume(trainer)


def test_every_must_be_a_whole_number_of_steps() -> None:
    with pytest.raises(ValueError, match="every=0"):
        integration.FlashCheckpoint(every=0, flash=FlashCheckpointer(job="unit"))


# -- end to end ------------------------------------------------------------------------------------------------

def _final(cwd: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    folder = cwd / "out" / "checkpoint-20"
    return {
        "model": load_file(folder / "model.safetensors"),
        "optimizer": torch.load(folder / "optimizer.pt", weights_only=True)["state"],
        "scheduler": torch.load(folder / "scheduler.pt", weights_only=True),
        "trainer": json.loads((folder / "trainer_state.json").read_text()),
    }


@pytest.mark.e2e
@pytest.mark.long(50)
def test_the_readme_trainer_recipe_resumes_from_memory_to_the_uninterrupted_result(tmp_path: Path) -> None:
    reference, crashed = (workdir(tmp_path, name, RECIPE, _recipe()) for name in ("torchrun", "stead"))
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(torchrun, reference, RECIPE, recipe_env(reference, "", CRASH_AT, **offline))
        job = pool.submit(stead_run, crashed, RECIPE, recipe_env(crashed, "crash", CRASH_AT, **offline), "hf")
    done, steady = plain.result(), job.result()
    assert done.returncode == 0, done.stderr[-4000:]
    assert steady.returncode == 0, steady.stderr[-4000:]
    assert (crashed / "faulted").exists() and "succeeded after 1 restart(s)" in steady.stderr
    assert re.search(r"ckpt_restored\s.*tier=memory", steady.stderr), "not restored from memory"

    # rank 1 died after its 7th step, before saving it: the 7th is done again, no other
    runs = steps_by_process(crashed, 1)
    assert runs[0] == CRASH_AT and sum(runs) - 20 <= 1, runs

    want, got = _final(reference), _final(crashed)
    assert got["trainer"]["global_step"] == want["trainer"]["global_step"] == 20
    assert got["trainer"]["epoch"] == want["trainer"]["epoch"]
    losses = [[entry["loss"] for entry in run["trainer"]["log_history"] if "loss" in entry] for run in (got, want)]
    assert len(losses[0]) == 20 and losses[0] == pytest.approx(losses[1], rel=1e-4)
    for name, tensor in want["model"].items():
        assert torch.allclose(got["model"][name], tensor, rtol=1e-4, atol=1e-6), name
    for index, state in want["optimizer"].items():
        for key, tensor in state.items():
            assert torch.allclose(got["optimizer"][index][key], tensor, rtol=1e-4, atol=1e-7), (index, key)
    assert got["scheduler"]["last_epoch"] == want["scheduler"]["last_epoch"] == 20
    assert got["scheduler"]["_last_lr"] == pytest.approx(want["scheduler"]["_last_lr"])
