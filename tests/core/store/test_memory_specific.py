"""memory-only behaviour: lease expiry follows the injected clock, and open_store finds every backend."""

from __future__ import annotations

import importlib.metadata

import pytest

import stead.core.entrypoints as entrypoints
import stead.core.store as store_package
from stead.core.errors import ConfigError, StoreError
from stead.core.store import known_schemes, open_store
from stead.core.store.memory import MemoryStore

pytestmark = pytest.mark.anyio


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_lease_expiry_follows_the_injected_clock() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    lease = await store.grant_lease(10)
    rev = await store.put("/members/a", b"v", lease=lease)
    clock.now += 9
    await store.refresh_lease(lease)
    clock.now += 9
    assert await store.get("/members/a") is not None
    clock.now += 1.5
    assert await store.get("/members/a") is None
    assert await store.revision() == rev + 1  # the expiry is a change watchers see
    with pytest.raises(StoreError, match="expired or was revoked"):
        await store.refresh_lease(lease)


async def test_each_memory_url_is_a_fresh_store() -> None:
    first, second = await open_store("memory://"), await open_store("memory://")
    await first.put("/k", b"v")
    assert await second.get("/k") is None


def test_every_built_in_scheme_is_known() -> None:
    assert {"memory", "sqlite", "etcd"} <= set(known_schemes())


async def test_open_store_falls_back_to_the_built_in_backends_without_entry_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(entrypoints, "entry_points", lambda group: [])
    store = await open_store("memory://")
    assert isinstance(store, MemoryStore)


async def test_a_scheme_registered_as_an_entry_point_is_opened_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    entry_point = importlib.metadata.EntryPoint(
        name="custom", value="stead.core.store.memory:open_store", group=store_package.ENTRY_POINT_GROUP)
    monkeypatch.setattr(entrypoints, "entry_points", lambda group: [entry_point] if group == entry_point.group else [])
    assert "custom" in known_schemes()
    store = await open_store("custom://x")
    assert store.url == "custom://x"


async def test_a_backend_that_fails_to_load_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    entry_point = importlib.metadata.EntryPoint(
        name="broken", value="no_such_module_for_stead:open_store", group=store_package.ENTRY_POINT_GROUP)
    monkeypatch.setattr(entrypoints, "entry_points", lambda group: [entry_point] if group == entry_point.group else [])
    with pytest.raises(ConfigError, match="failed to load"):
        await open_store("broken://x")
