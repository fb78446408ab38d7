"""Flash checkpoints of CUDA tensors: saved from the device, restored into the device's own tensors.

Skipped without a CUDA device (the CI machine has none); run on a GPU machine with
``python -m pytest tests/plugins/ckpt/test_cuda.py``. bench/gpu.py measures the same paths.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _polling import wait_until

from stead.plugins.ckpt._mapped import MappedSlot
from stead.plugins.ckpt.worker import FlashCheckpointer

from .conftest import Cluster

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_model(seed: int = 0) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    """A model with parameters, BatchNorm buffers (changed by every forward in training mode) and Adam state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, seed)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    batch = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed)).cuda()
    model(batch).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def on_host(value: Any) -> Any:
    """A deep copy on the host: what the state was at this moment, whatever the device does next."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(on_host(v) for v in value)
    return value


def assert_same(restored: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(restored, torch.Tensor) and restored.dtype == expected.dtype
        assert torch.equal(restored.cpu(), expected), "a restored tensor differs from the saved one"
    elif isinstance(expected, dict):
        assert set(restored) == set(expected)
        for key in expected:
            assert_same(restored[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert len(restored) == len(expected)
        for a, b in zip(restored, expected, strict=True):
            assert_same(a, b)
    else:
        assert restored == expected


def committed(ckpt: FlashCheckpointer, step: int) -> bool:
    return ckpt._ctl.committed[0] >= step


def restart(cluster: Cluster, round_: int, **worker: Any) -> FlashCheckpointer:
    cluster.failure(round_=round_ - 1)
    cluster.round(round_, restart_count=round_ - 1)
    return cluster.worker(round_=round_, **worker)


def test_cuda_tensors_saved_are_restored_bit_identical_into_the_models_own_tensors(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    model, opt = cuda_model()
    expected = on_host(state_of(model, opt))
    with cluster.worker() as ckpt:
        assert ckpt.save(1, state_of(model, opt))
        wait_until(lambda: committed(ckpt, 1), "step 1 committed")
    fresh, fresh_opt = cuda_model(seed=1)
    pointer = fresh[0].weight.data_ptr()
    with restart(cluster, 2) as ckpt:
        restored = ckpt.load(state_of(fresh, fresh_opt))
    assert restored is not None and restored[0] == 1
    assert_same(restored[1], expected)
    assert fresh[0].weight.is_cuda and fresh[0].weight.data_ptr() == pointer  # in place, on the device
    assert torch.equal(fresh[1].running_mean.cpu(), expected["model"]["1.running_mean"])


def test_a_load_without_a_template_gives_tensors_on_the_device_they_were_saved_from(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    state = {"w": torch.arange(1 << 20, dtype=torch.float32, device="cuda"), "cpu": torch.ones(3)}
    with cluster.worker() as ckpt:
        assert ckpt.save(1, state)
        wait_until(lambda: committed(ckpt, 1), "step 1 committed")
    with restart(cluster, 2) as ckpt:
        restored = ckpt.load()
    assert restored is not None
    assert restored[1]["w"].is_cuda and not restored[1]["cpu"].is_cuda
    assert_same(restored[1], on_host(state))


def test_a_save_pins_its_slot_once_and_restores_from_pinned_memory(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    state = {"w": torch.randn(1 << 20, device="cuda")}
    with cluster.worker() as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, state)
            wait_until(lambda s=step: committed(ckpt, s), f"step {step} committed")
        pinned = [m for m in ckpt._slots.values() if isinstance(m, MappedSlot) and m._pinned]
        assert len(pinned) == 2, "both slots a CUDA save wrote are registered as pinned memory"


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_save_keeps_the_values_of_save_time_though_training_goes_on_at_once(cluster: Cluster, mode: str) -> None:
    """The optimizer step and the forward (BatchNorm's running statistics) right after save() change the saved
    tensors; the checkpoint still holds what they were when save() was called."""
    cluster.agent()
    cluster.round(1)
    model, opt = cuda_model()
    # big enough that the copy is still running when the next step is queued
    big = {"embedding": torch.randn(64 << 20, device="cuda")}
    with cluster.worker(copy_mode=mode) as ckpt:
        state = {**state_of(model, opt), **big}
        expected = on_host(state)
        assert ckpt.save(1, state)
        train_step(model, opt, seed=7)  # queued on the training stream while an overlapped copy runs
        big["embedding"].mul_(2)
        torch.cuda.synchronize()
        assert not torch.equal(model[0].weight.cpu(), expected["model"]["0.weight"])
        assert not torch.equal(model[1].running_mean.cpu(), expected["model"]["1.running_mean"])
        wait_until(lambda: committed(ckpt, 1), "step 1 committed")
    with restart(cluster, 2) as ckpt:
        restored = ckpt.load()
    assert restored is not None and restored[0] == 1
    assert_same(restored[1], expected)
