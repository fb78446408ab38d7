"""GPU health through NVML: XIDs, ECC rises and lost GPUs reported once each, and no GPU as a clean no-op."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml
import pytest

from stead.core.agent.gpu import GpuHealth, GpuProblem
from stead.testing.nvml import FakeNvml

#: the fake's own scripting API and counters: everything else on it must exist in pynvml
FAKE_ONLY = {"xid", "ecc", "use", "lose", "fail", "shutdowns", "initialised", "open_event_sets", "reserved"}


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml(gpus=2)


@pytest.fixture
def health(nvml: FakeNvml) -> Iterator[GpuHealth]:
    watcher = GpuHealth(nvml=nvml)
    assert watcher.open() == ""
    yield watcher
    watcher.close()


def test_healthy_gpus_report_no_problem(health: GpuHealth) -> None:
    assert health.gpus == 2
    assert health.check() == []
    assert health.check() == []


def test_an_xid_is_reported_once_with_its_gpu_and_meaning(nvml: FakeNvml, health: GpuHealth) -> None:
    nvml.xid(1, 79)
    problems = health.check()
    assert problems == [GpuProblem(1, "xid", "XID 79 (GPU has fallen off the bus)")]
    assert str(problems[0]) == "GPU 1: XID 79 (GPU has fallen off the bus)"
    assert health.check() == []


def test_an_xid_not_in_the_table_is_named_by_its_number(nvml: FakeNvml, health: GpuHealth) -> None:
    nvml.xid(0, 12345)
    assert [str(problem) for problem in health.check()] == ["GPU 0: XID 12345"]


def test_an_xid_storm_is_reported_once_per_distinct_xid(nvml: FakeNvml, health: GpuHealth) -> None:
    for _ in range(5):
        nvml.xid(0, 13)
    nvml.xid(0, 48)
    assert health.check() == [GpuProblem(0, "xid", "XID 13 (Graphics engine exception)"),
                              GpuProblem(0, "xid", "XID 48 (Double-bit ECC error)")]


def test_an_ecc_rise_is_reported_and_becomes_the_new_baseline(nvml: FakeNvml, health: GpuHealth) -> None:
    nvml.ecc(0, 3)
    assert health.check() == [GpuProblem(0, "ecc", "3 new uncorrected ECC errors (volatile count now 3)")]
    assert health.check() == []
    nvml.ecc(0, 1)
    assert [str(problem) for problem in health.check()] == ["GPU 0: 1 new uncorrected ECC error (volatile count now 4)"]


def test_ecc_errors_from_before_open_are_the_baseline_not_a_problem(nvml: FakeNvml) -> None:
    nvml.ecc(1, 7)
    health = GpuHealth(nvml=nvml)
    assert health.open() == ""
    try:
        assert health.check() == []
    finally:
        health.close()


def test_a_lost_gpu_is_reported_once_and_the_others_are_still_watched(nvml: FakeNvml, health: GpuHealth) -> None:
    nvml.lose(0)
    problems = health.check()
    assert problems == [GpuProblem(0, "lost", "GPU is lost")]
    assert str(problems[0]) == "GPU 0: GPU is lost"
    assert health.check() == []
    nvml.ecc(1, 2)
    assert health.check() == [GpuProblem(1, "ecc", "2 new uncorrected ECC errors (volatile count now 2)")]


def test_an_xid_then_the_loss_of_its_gpu_are_both_reported(nvml: FakeNvml, health: GpuHealth) -> None:
    nvml.xid(1, 79)
    nvml.lose(1)
    assert [str(problem) for problem in health.check()] == [
        "GPU 1: XID 79 (GPU has fallen off the bus)", "GPU 1: GPU is lost"]


def test_an_unknown_error_where_open_had_an_answer_means_lost(nvml: FakeNvml, health: GpuHealth) -> None:
    nvml.fail(1, pynvml.NVML_ERROR_UNKNOWN)
    assert health.check() == [GpuProblem(1, "lost", "GPU is lost (NVML: Unknown Error)")]
    assert health.check() == []


def test_other_nvml_errors_are_not_a_problem_and_the_gpu_stays_watched(nvml: FakeNvml, health: GpuHealth) -> None:
    nvml.fail(0, pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert health.check() == []
    assert health.gpus == 2


def test_a_gpu_lost_before_open_is_reported_at_the_first_check(nvml: FakeNvml) -> None:
    nvml.lose(1)
    health = GpuHealth(nvml=nvml)
    assert health.open() == ""
    try:
        assert health.check() == [GpuProblem(1, "lost", "GPU is lost")]
        assert health.check() == []
    finally:
        health.close()


def test_a_gpu_without_ecc_or_xid_events_is_still_watched_for_loss() -> None:
    nvml = FakeNvml(gpus=1, ecc=False, xid_events=False)
    health = GpuHealth(nvml=nvml)
    assert health.open() == ""
    try:
        nvml.xid(0, 79)  # nobody registered for it: NVML drops it
        assert health.check() == []
        nvml.lose(0)
        assert health.check() == [GpuProblem(0, "lost", "GPU is lost")]
    finally:
        health.close()


def test_usage_is_the_fullest_gpus_memory_and_the_mean_utilisation_of_those_that_answer(
        nvml: FakeNvml, health: GpuHealth) -> None:
    nvml.use(0, memory_bytes=10 << 30, util_percent=50)
    nvml.use(1, memory_bytes=30 << 30, util_percent=100)
    assert health.usage() == (30 << 30, 75.0)
    nvml.lose(1)
    health.check()  # reported lost: no longer asked
    assert health.usage() == (10 << 30, 50.0)
    nvml.fail(0, pynvml.NVML_ERROR_UNKNOWN)
    assert health.usage() == (None, None)  # no GPU answered: unknown, not zero


def test_memory_in_use_leaves_out_what_the_driver_reserves_as_nvidia_smi_does(
        nvml: FakeNvml, health: GpuHealth, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml.use(0, memory_bytes=2 << 30, util_percent=0)
    assert health.usage()[0] == 2 << 30
    v1_only = nvml.nvmlDeviceGetMemoryInfo

    def old_driver(handle: object, version: int | None = None) -> object:
        if version is not None:
            raise FakeNvml.NVMLError_NotSupported()  # a real old driver: NVMLError_FunctionNotFound
        return v1_only(handle)

    monkeypatch.setattr(nvml, "nvmlDeviceGetMemoryInfo", old_driver)
    assert health.usage()[0] == (2 << 30) + nvml.reserved  # a driver without version 2: its only answer


def test_without_a_driver_open_gives_the_reason_and_the_rest_does_nothing() -> None:
    nvml = FakeNvml(driver=False)
    health = GpuHealth(nvml=nvml)
    assert health.open() == "no GPU (NVML: Driver Not Loaded)"
    assert health.gpus == 0
    assert health.check() == [] and health.usage() == (None, None)
    health.close()
    assert nvml.shutdowns == 0  # nvmlInit failed: there is nothing to shut down


def test_nvml_without_devices_is_no_gpu_and_is_released_at_once() -> None:
    nvml = FakeNvml(gpus=0)
    health = GpuHealth(nvml=nvml)
    assert health.open() == "no GPU (NVML sees no device)"
    assert health.gpus == 0
    assert not nvml.initialised
    assert health.check() == []
    health.close()
    assert nvml.shutdowns == 1


def test_close_is_idempotent_and_releases_everything(nvml: FakeNvml) -> None:
    health = GpuHealth(nvml=nvml)
    assert health.open() == ""
    assert health.open() == ""  # already open: nothing more taken
    assert nvml.open_event_sets == 1
    health.close()
    health.close()
    assert nvml.shutdowns == 1
    assert not nvml.initialised
    assert nvml.open_event_sets == 0
    assert health.gpus == 0
    assert health.check() == []


def test_the_fake_offers_only_what_pynvml_has_with_the_same_values() -> None:
    fake = FakeNvml()
    for name in dir(fake):
        if name.startswith("_") or name in FAKE_ONLY:
            continue
        assert hasattr(pynvml, name), name
        value = getattr(fake, name)
        if isinstance(value, int):
            assert value == getattr(pynvml, name), name
    lost = FakeNvml.NVMLError_GpuIsLost()
    assert isinstance(lost, FakeNvml.NVMLError)
    assert lost.value == pynvml.NVML_ERROR_GPU_IS_LOST
    assert str(lost) == str(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST))


def test_the_real_nvml_without_a_gpu_is_a_clean_no_op() -> None:
    health = GpuHealth()
    reason = health.open()
    try:
        if reason:  # this machine: no driver, no library
            assert "no GPU" in reason
            assert health.gpus == 0
        else:  # a machine with healthy GPUs
            assert health.gpus > 0
        assert health.check() == []
    finally:
        health.close()
    health.close()
