"""stead.numerics.guard in one process: a non-finite gradient stops the step before anything is applied, named;
a finite one passes; bad input (an injection that does not parse, a DDP model with a hook already) is refused."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel

import stead.numerics
from stead.core.worker import progress
from stead.core.worker.fingerprint import fingerprint, flip_bit, odd_ranks, probe
from stead.core.worker.numerics import Injection, parse_injection


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


@pytest.mark.parametrize("text", ["nan", "nan:rank=1", "flip:rank=1:step=2", "nan:rank=-1:step=2",
                                  "bitflip:rank=1:step=2:host="])
def test_an_injection_that_does_not_parse_says_what_it_takes(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not KIND:rank=R:step=S\[:host=H\] with KIND nan, inf, bitflip or noise"):
        parse_injection(text)


def test_an_injection_may_name_a_host() -> None:
    assert parse_injection("bitflip:rank=2:step=7:host=h2") == Injection("bitflip", 2, 7, "h2")
    assert parse_injection(" noise:rank=0:step=1 ") == Injection("noise", 0, 1, "")


@given(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       st.integers(1, 64), st.integers(0, 10_000))
def test_a_flipped_bit_always_changes_the_fingerprint_and_equal_tensors_always_agree(
        dtype: torch.dtype, size: int, seed: int) -> None:
    values = torch.randn(size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    same = values.clone()
    assert torch.equal(fingerprint([values, values[::2]]), fingerprint([same, same[::2]]))
    flip_bit(same)
    assert not torch.equal(fingerprint([values]), fingerprint([same]))


@pytest.mark.parametrize(("prints", "odd"), [
    ([[1, 2], [1, 2], [1, 2]], []),
    ([[1, 2], [1, 9], [1, 2]], [1]),
    ([[7, 2], [1, 2], [1, 2], [1, 2]], [0]),
    ([[1, 2], [1, 9]], None),  # two replicas: no majority, the probe decides
    ([[1], [1], [2], [2]], None),  # a tie
    ([[1], [2], [3]], None),
    ([[1], [1], [1], [2], [3]], [3, 4]),
    ([[5]], []),
])
def test_the_odd_ranks_are_those_that_differ_from_a_strict_majority(prints: list[list[int]],
                                                                    odd: list[int] | None) -> None:
    assert odd_ranks(prints) == odd


def test_the_probe_gets_its_known_answer_on_this_cpu() -> None:
    assert probe(torch.device("cpu"))


def test_one_replica_compares_nothing_and_fingerprints_ask_for_ddp(group: None) -> None:
    single = stead.numerics.guard(DistributedDataParallel(_model()), fingerprint_every=1)
    single.remove()
    assert not single.fingerprinting  # a world of one: no replica to compare with
    with pytest.warns(UserWarning, match="fingerprint_every is for DDP models"):
        plain = stead.numerics.guard(_model(), fingerprint_every=5)
    plain.remove()
    with pytest.raises(ValueError, match=r"must be 0 \(no fingerprints\) or more"):
        stead.numerics.guard(_model(), fingerprint_every=-1)


def test_a_ddp_model_with_a_hook_already_is_refused_saying_what_to_do(group: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DistributedDataParallel(_model())
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="call guard before registering another"):
        stead.numerics.guard(model)


def test_the_last_agreed_step_is_where_the_run_started_until_fingerprints_are_compared(
        group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fresh = stead.numerics.guard(model, fingerprint_every=0)
    try:
        assert fresh.last_agreed().startswith("fingerprints last agreed at step -1 (the script's initial state")
        _train(model, opt, poison=False)
        assert fresh.last_agreed().startswith("fingerprints last agreed at step -1 (")  # the run's start, still
        fresh.agreed = 0
        assert fresh.last_agreed() == "fingerprints last agreed at step 0"
    finally:
        fresh.remove()
    monkeypatch.setattr(progress, "training_step", lambda: 7)  # a run that restored step 6 steps from 7 on
    model = DistributedDataParallel(_model())  # (a DDP model takes one communication hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    restored = stead.numerics.guard(model, fingerprint_every=0)
    try:
        _train(model, opt, poison=False)
        assert restored.last_agreed() == ("fingerprints last agreed at step 6 (the step this run of the workers "
                                          "restored; none compared since)")
    finally:
        restored.remove()
