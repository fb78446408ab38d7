"""retrying(): exponential backoff for retryable errors, bounded by a deadline, on a fake clock."""

from __future__ import annotations

import pytest

from stead.core.config import Settings
from stead.core.errors import InvalidRequest, RpcUnavailable, StoreUnavailable
from stead.core.rpc import retrying

pytestmark = pytest.mark.anyio

SETTINGS = Settings(retry_initial_s=0.2, retry_max_s=1.0, retry_deadline_s=5.0)


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky:
    """Fails with ``error`` ``failures`` times, then answers ``"ok"``."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


async def test_retries_with_doubling_delays_capped_at_the_maximum() -> None:
    time = FakeTime()
    call = Flaky(5, RpcUnavailable("master down"))
    assert await retrying(call, SETTINGS, sleep=time.sleep, clock=time.clock) == "ok"
    assert call.calls == 6
    delays = [0.2, 0.4, 0.8, 1.0, 1.0]  # each wait jittered between half the delay and the delay
    assert all(d / 2 <= w <= d for w, d in zip(time.sleeps, delays, strict=True)), time.sleeps


async def test_a_shedding_master_s_retry_after_is_waited_at_least() -> None:
    time = FakeTime()
    busy = RpcUnavailable("master busy")
    busy.retry_after_s = 1.5
    call = Flaky(2, busy)
    assert await retrying(call, SETTINGS, sleep=time.sleep, clock=time.clock) == "ok"
    assert time.sleeps == [1.5, 1.5]  # more than the jittered 0.2 s and 0.4 s it would have waited


async def test_any_retryable_error_is_retried() -> None:
    time = FakeTime()
    call = Flaky(1, StoreUnavailable("etcd down"))
    assert await retrying(call, SETTINGS, sleep=time.sleep, clock=time.clock) == "ok"


async def test_gives_up_after_the_deadline_with_the_last_error() -> None:
    time = FakeTime()
    call = Flaky(1000, RpcUnavailable("master down"))
    with pytest.raises(RpcUnavailable, match="master down") as caught:
        await retrying(call, SETTINGS, sleep=time.sleep, clock=time.clock)
    assert sum(time.sleeps) == pytest.approx(SETTINGS.retry_deadline_s)
    assert max(time.sleeps) <= SETTINGS.retry_max_s
    assert any("gave up after" in note for note in caught.value.__notes__)


async def test_permanent_errors_are_raised_at_once() -> None:
    time = FakeTime()
    call = Flaky(1, InvalidRequest("bad node id"))
    with pytest.raises(InvalidRequest):
        await retrying(call, SETTINGS, sleep=time.sleep, clock=time.clock)
    assert call.calls == 1
    assert time.sleeps == []


async def test_real_sleep_by_default() -> None:
    call = Flaky(2, RpcUnavailable("master down"))
    fast = Settings(retry_initial_s=0.001, retry_max_s=0.002, retry_deadline_s=30.0)
    assert await retrying(call, fast) == "ok"


async def test_backoff_waits_are_jittered_within_half_of_a_doubling_capped_delay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    from stead.core import retry

    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(retry.anyio, "sleep", record)
    backoff = retry.Backoff(SETTINGS, rng=random.Random(7))
    for _ in range(6):
        await backoff.wait()
    delays = [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert all(d / 2 <= w <= d for w, d in zip(waits, delays, strict=True)), waits
    assert len(set(waits[3:])) == 3  # not in step with another agent's
    backoff.reset()
    await backoff.wait()
    assert waits[-1] <= 0.2
