"""stead.ckpt.Checkpoint: model, optimizer (fresh or not), scheduler, sampler and extras come back together."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stead.core.worker import progress
from stead.plugins.ckpt.errors import StateMismatch
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.state import Checkpoint
from stead.plugins.ckpt.worker import FlashCheckpointer

from .conftest import Cluster

Optim = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optim] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def model_of(seed: int, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step))
    opt.zero_grad()
    model(batch).pow(2).mean().backward()
    opt.step()


class Cursor:
    """A sampler's checkpoint API, recording its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        self.calls.append("state_dict")
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls.append(f"load_state_dict {state}")
        self.position = state["position"]


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return set(a) == set(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_a_fresh_optimizer_gets_its_moments_back_and_training_ends_where_an_uninterrupted_run_does(
        cluster: Cluster, optim: str) -> None:
    make = OPTIMIZERS[optim]
    cluster.agent()
    cluster.round(1)
    model = model_of(0)
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    cursor = Cursor()
    with cluster.worker() as flash:
        ckpt = Checkpoint(model=model, optimizer=opt, scheduler=sched, sampler=cursor, flash=flash,
                          extra={"epoch": 0})
        for step in range(4):
            train_step(model, opt, step)
            sched.step()
            cursor.position += 4
            ckpt.extra["epoch"] = step // 2
            assert ckpt.save(step)
    at_crash = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), sched.state_dict())
    for step in range(4, 7):  # the uninterrupted run goes on
        train_step(model, opt, step)
        sched.step()

    fresh = model_of(1)  # a restarted worker: other initial weights, an optimizer with no state at all
    fresh_opt = make(fresh.parameters())
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    fresh_cursor = Cursor()
    cluster.failure(round_=1)
    cluster.round(2, restart_count=1)
    with cluster.worker(round_=2) as flash:
        again = Checkpoint(model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, sampler=fresh_cursor,
                           flash=flash)
        assert again.restore() == 3
    assert equal(fresh.state_dict(), at_crash[0])
    assert equal(fresh_opt.state_dict(), at_crash[1])  # momentum buffers / moments and step counts
    assert fresh_sched.state_dict() == at_crash[2]
    assert fresh_cursor.calls == ["load_state_dict {'position': 16}"]  # restored, never asked for a new cursor
    assert again.extra == {"epoch": 1}
    for step in range(4, 7):
        train_step(fresh, fresh_opt, step)
        fresh_sched.step()
    assert equal(fresh.state_dict(), model.state_dict())
    assert equal(fresh_opt.state_dict(), opt.state_dict())


def test_with_nothing_saved_restore_changes_nothing_and_takes_no_step(tmp_path: Path) -> None:
    model = model_of(0)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.Adam(model.parameters())
    with Checkpoint(model=model, optimizer=opt, settings=CheckpointSettings(dir=str(tmp_path))) as ckpt:
        assert ckpt.flash.mode == "disk"
        assert ckpt.restore() is None
    assert not opt.state and equal(model.state_dict(), before)


def test_without_an_agent_persisted_saves_are_restored_from_disk(tmp_path: Path) -> None:
    settings = CheckpointSettings(dir=str(tmp_path))
    model = model_of(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Checkpoint(model=model, optimizer=opt, settings=settings) as ckpt:
        for step in range(3):
            train_step(model, opt, step)
            ckpt.save(step, persist=step == 1)
            if step == 1:
                expected = copy.deepcopy(opt.state_dict())
    fresh = model_of(5)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with Checkpoint(model=fresh, optimizer=fresh_opt, settings=settings) as again:
        assert again.restore() == 1
    assert equal(fresh_opt.state_dict(), expected)


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys_and_nothing_is_loaded(tmp_path: Path) -> None:
    settings = CheckpointSettings(dir=str(tmp_path))
    model = model_of(0)
    opt = torch.optim.Adam(model.parameters())
    train_step(model, opt, 0)
    with Checkpoint(model=model, optimizer=opt, settings=settings) as ckpt:
        ckpt.save(0, persist=True)
    wider = model_of(1, hidden=32)
    untouched = copy.deepcopy(wider.state_dict())
    with Checkpoint(model=wider, optimizer=torch.optim.Adam(wider.parameters()), settings=settings) as other, \
            pytest.raises(StateMismatch) as caught:
        other.restore()
    message = str(caught.value)
    assert "['model']['0.weight'] is float32[16, 8] in the checkpoint and float32[32, 8] in the state" in message
    assert "nothing was loaded" in message
    assert equal(wider.state_dict(), untouched)
    deeper = torch.nn.Sequential(*model_of(0), torch.nn.Linear(1, 1))
    with Checkpoint(model=deeper, optimizer=torch.optim.Adam(deeper.parameters()), settings=settings) as other, \
            pytest.raises(StateMismatch, match=r"\['model'\]\['3.weight'\] is in the state but not in the checkpoint"):
        other.restore()


def test_automatic_step_detection_counts_real_steps_from_the_restored_one(cluster: Cluster) -> None:
    reported: list[int] = []
    progress._auto = progress._AutoStep()
    original = progress._write
    progress._write = reported.append  # type: ignore[assignment]
    hook = progress.install_step_hook()
    try:
        assert hook is not None
        model = model_of(0)
        opt = torch.optim.Adam(model.parameters())
        for step in range(3):
            train_step(model, opt, step)
        with Checkpoint(model=model, optimizer=opt, flash=FlashCheckpointer(settings=CheckpointSettings(
                dir=str(cluster.tmp / "auto")))) as ckpt:
            ckpt.save(2, persist=True)
            fresh = model_of(1)
            fresh_opt = torch.optim.Adam(fresh.parameters())
            with Checkpoint(model=fresh, optimizer=fresh_opt, flash=ckpt.flash) as again:
                assert again.restore() == 2  # builds the fresh optimizer's state with a step: not counted
                train_step(fresh, fresh_opt, 3)
    finally:
        hook.remove()
        progress._write = original  # type: ignore[assignment]
        progress._auto = progress._AutoStep()
    assert reported == [0, 1, 2, 3]


@pytest.mark.parametrize(("optimizer", "loaded", "last_step", "first"), [
    ("adam", False, -1, 0),  # a fresh optimizer: the script starts over
    ("adam", True, -1, 3),  # loaded from the script's own checkpoint: Adam counts its steps
    ("adam", True, 7, 3),  # ...and its count wins over the node's last step
    ("sgd-momentum", True, 7, 8),  # loaded, no step count: it goes on from the node's last step
    ("sgd-momentum", False, 7, 0),  # fresh (its state is empty before it steps): it starts over
    ("sgd-momentum", True, -1, 0),  # loaded on a node that never stepped: nothing to go on from
])
def test_a_script_that_restores_its_own_checkpoint_goes_on_counting_where_it_resumed(
        monkeypatch: pytest.MonkeyPatch, optimizer: str, loaded: bool, last_step: int, first: int) -> None:
    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        if optimizer == "adam":
            return torch.optim.Adam(model.parameters())
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    saved_model = model_of(0)
    saved_opt = make(saved_model)
    for step in range(3):  # what the script saved with torch.save before it crashed: 3 steps
        train_step(saved_model, saved_opt, step)
    monkeypatch.setenv(progress.LAST_STEP_ENV, str(last_step))
    reported: list[int] = []
    monkeypatch.setattr(progress, "_auto", progress._AutoStep())
    monkeypatch.setattr(progress, "_write", reported.append)
    hook = progress.install_step_hook()
    try:
        model = model_of(1)
        opt = make(model)
        if loaded:
            model.load_state_dict(saved_model.state_dict())
            opt.load_state_dict(saved_opt.state_dict())
        for step in range(2):
            train_step(model, opt, step)
    finally:
        hook.remove()
    assert reported == [first, first + 1]
