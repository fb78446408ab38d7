"""The Hugging Face Trainer job of bench/frameworks.py: a small GPT-2 built from a config, 2 gloo workers.

``BENCH_MODE=stead``: stead's ``FlashCheckpoint`` callback, a flash save every step, resumed with
``flash.resume(trainer)``. ``BENCH_MODE=trainer``: the Trainer alone, its own checkpoints every
``BENCH_SAVE_STEPS`` steps and ``resume_from_checkpoint=get_last_checkpoint(...)``, as a torchrun user runs it.
Each save is timed where it stalls training (the callback's save, the Trainer's ``_save_checkpoint``), and
a plain copy of the same tensors into buffers made beforehand (the memcpy a save is measured against) is
timed at the same points; the figures go to ``stall-RANK-PID.json``. Step and crash timestamps come from
bench/frameworks.py's hook.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

MODE = os.environ["BENCH_MODE"]
RANK = int(os.environ["RANK"])
saves: list[float] = []


class TimedTrainer(Trainer):  # type: ignore[misc]
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        even = self.state.global_step % 2 == 0
        if even:
            memcpy(self)
        started = time.perf_counter()
        super()._save_checkpoint(model, trial)
        saves.append(time.perf_counter() - started)
        if not even:
            memcpy(self)


class Memcpy:
    """A copy of the model's and the optimizer's tensors into buffers allocated beforehand: the floor of a save.

    Timed at each save point, before the save on even steps and after it on odd ones, so that neither
    finds the tensors in the cache more often than the other."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.buffers: list[torch.Tensor] = []

    def __call__(self, trainer: Trainer) -> None:
        tensors = list(trainer.model.state_dict().values())
        for state in trainer.optimizer.state_dict()["state"].values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        if len(self.buffers) != len(tensors):
            self.buffers = [torch.empty_like(t) for t in tensors]
            for buffer, tensor in zip(self.buffers, tensors, strict=True):
                buffer.copy_(tensor)  # faulted in, as the flash checkpoint's slots are
        started = time.perf_counter()
        for buffer, tensor in zip(self.buffers, tensors, strict=True):
            buffer.copy_(tensor)
        self.times.append(time.perf_counter() - started)


memcpy = Memcpy()


torch.manual_seed(0)
config = GPT2Config(vocab_size=8192, n_positions=64, n_embd=512, n_layer=6, n_head=8, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
tokens = torch.randint(0, config.vocab_size, (2048, 64))
args = TrainingArguments(output_dir="out", max_steps=int(os.environ["BENCH_STEPS"]), per_device_train_batch_size=4,
                         learning_rate=1e-3, save_steps=int(os.environ["BENCH_SAVE_STEPS"]), logging_steps=1000,
                         report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
data = [{"input_ids": t, "labels": t} for t in tokens]
if MODE == "stead":
    from stead.integrations.transformers import FlashCheckpoint

    flash = FlashCheckpoint()
    timed = flash._save_due

    def _save_due(*a: Any) -> None:
        due, even = flash._due and trainer.state.global_step > 0, trainer.state.global_step % 2 == 0
        if due and even:
            memcpy(trainer)
        started = time.perf_counter()
        timed(*a)
        if due:
            saves.append(time.perf_counter() - started)
            if not even:
                memcpy(trainer)

    flash._save_due = _save_due  # type: ignore[method-assign]
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data, callbacks=[flash])
    trainer.train(resume_from_checkpoint=flash.resume(trainer))
else:
    trainer = TimedTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=get_last_checkpoint("out") if os.path.isdir("out") else None)
with open(f"stall-{RANK}-{os.getpid()}.json", "w") as out:
    json.dump({"saves_s": saves, "memcpy_s": statistics.median(memcpy.times)}, out)
