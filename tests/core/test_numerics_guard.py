"""stead.numerics.guard in one process: a non-finite gradient stops the step before anything is applied, named;
a finite one passes; bad input (an injection that does not parse, a DDP model with a hook already) is refused."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stead.numerics
from stead.core.worker.numerics import parse_injection


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-process gloo group for the module, made before any test looks for listening ports (gloo's listener
    is not freed before the process ends)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, *, poison: bool) -> None:
    loss = model(torch.ones(2, 4)).sum() * (math.inf if poison else 1.0)
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("ddp", [True, False], ids=["ddp", "plain"])
def test_a_non_finite_gradient_stops_the_step_before_the_optimizer_applies_it(group: None, ddp: bool) -> None:
    model = DistributedDataParallel(_model()) if ddp else _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = stead.numerics.guard(model)
    try:
        _train(model, opt, poison=False)  # a finite step passes
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(stead.numerics.NonFiniteGradientError) as err:
            _train(model, opt, poison=True)
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))  # nothing applied
        said = str(err.value)
        assert "non-finite gradient (NaN or Inf) on rank 0" in said and "the step was not applied" in said
        assert ("before the all-reduce" in said) if ddp else ("the gradients of" in said)
    finally:
        guard.remove()


def test_an_injected_nan_comes_at_its_rank_and_step_in_the_first_run_only(
        group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stead.numerics.INJECT_ENV, "nan:rank=0:step=1")
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="fault injection is for tests and demos"):
        guard = stead.numerics.guard(model)
    try:
        _train(model, opt, poison=False)  # step 0
        with pytest.raises(stead.numerics.NonFiniteGradientError, match="at step 1"):
            _train(model, opt, poison=False)
        opt.zero_grad()
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        guard.taken = 1
        _train(model, opt, poison=False)  # restarted: step 1 again, no fault
    finally:
        guard.remove()


@pytest.mark.parametrize("text", ["nan", "nan:rank=1", "bitflip:rank=1:step=2", "nan:rank=-1:step=2"])
def test_an_injection_that_does_not_parse_says_what_it_takes(text: str) -> None:
    with pytest.raises(ValueError, match="is not KIND:rank=R:step=S with KIND nan or inf"):
        parse_injection(text)


def test_a_ddp_model_with_a_hook_already_is_refused_saying_what_to_do(group: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DistributedDataParallel(_model())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="call guard before registering another"):
        stead.numerics.guard(model)
