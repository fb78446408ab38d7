"""etcd-only behaviour: outages map to StoreUnavailable, the client recovers, URLs and TTL rounding, request sizes."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import aclosing

import anyio
import anyio.to_thread
import pytest

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, StoreUnavailable, WriteTooLarge
from stead.core.store import MAX_TXN_ITEMS, open_store, write_size
from stead.core.store.etcd import ETCD_MAX_REQUEST_BYTES, EtcdStore, parse_etcd_url
from stead.testing.etcd import EtcdServer

pytestmark = pytest.mark.anyio


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """An etcd of this test alone, which it may stop and start."""
    with EtcdServer() as server:
        yield server


def dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def eventually_works(store: EtcdStore, key: str, settings: Settings) -> bytes:
    """Retry a get the way callers do (with backoff) until the restarted etcd answers."""
    with anyio.fail_after(20):
        while True:
            try:
                kv = await store.get(key)
            except StoreUnavailable:
                await anyio.sleep(settings.retry_initial_s)
                continue
            assert kv is not None
            return kv.value


async def test_store_down_is_store_unavailable_and_the_store_works_again_after_restart(
    own_etcd: EtcdServer, settings: Settings
) -> None:
    store = await open_store(own_etcd.url, settings=settings)
    assert isinstance(store, EtcdStore)
    try:
        await store.put("/k", b"before")
        await anyio.to_thread.run_sync(own_etcd.stop)
        with pytest.raises(StoreUnavailable, match=r"is etcd running at 127\.0\.0\.1:\d+\? start it or pass --store"):
            await store.get("/k")
        with pytest.raises(StoreUnavailable, match=own_etcd.url):
            await store.put("/k", b"during")
        with pytest.raises(StoreUnavailable):
            await store.create_all([("/a", b"1")])
        await anyio.to_thread.run_sync(own_etcd.start)
        assert await eventually_works(store, "/k", settings) == b"before"
        assert await store.compare_and_put("/k", b"after", expected_mod_revision=(await store.get("/k")).mod_revision)  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_a_watch_raises_store_unavailable_when_etcd_stops(own_etcd: EtcdServer, settings: Settings) -> None:
    store = await open_store(own_etcd.url, settings=settings)
    try:
        async with aclosing(store.watch("/w/")) as events:
            await store.put("/w/1", b"v")
            with anyio.fail_after(10):
                assert (await anext(events)).key == "/w/1"
            await anyio.to_thread.run_sync(own_etcd.stop)
            with anyio.fail_after(10), pytest.raises(StoreUnavailable, match="watch"):
                await anext(events)
    finally:
        await store.close()


async def test_opening_an_etcd_that_is_not_running_is_store_unavailable(settings: Settings) -> None:
    url = f"etcd://127.0.0.1:{dead_port()}"
    with pytest.raises(StoreUnavailable, match=r"is etcd running at .*start it or pass --store"):
        await open_store(url, settings=settings)


async def test_a_url_with_several_endpoints_uses_the_one_that_answers(etcd: str, settings: Settings) -> None:
    store = await open_store(f"etcd://127.0.0.1:{dead_port()},{etcd.removeprefix('etcd://')}", settings=settings)
    try:
        rev = await store.put("/multi/k", b"v")
        kv = await store.get("/multi/k")
        assert kv is not None and kv.mod_revision == rev
        await store.delete_prefix("/multi/")
    finally:
        await store.close()


async def test_lease_ttl_is_rounded_up_to_whole_seconds(etcd: str, settings: Settings) -> None:
    store = await open_store(etcd, settings=settings)
    try:
        async with store.lease(0.2) as lease:
            assert lease.ttl_s >= 1.0
    finally:
        await store.close()


async def test_an_unknown_lease_is_a_store_error_with_advice(etcd: str, settings: Settings) -> None:
    store = await open_store(etcd, settings=settings)
    try:
        lease = await store.grant_lease(1)  # type: ignore[attr-defined]
        await store.revoke_lease(lease)  # type: ignore[attr-defined]
        await store.revoke_lease(lease)  # type: ignore[attr-defined]  # idempotent
        with pytest.raises(StoreError, match="take a new lease"):
            await store.put("/x", b"v", lease=lease)
        with pytest.raises(StoreError, match="take a new lease"):
            await store.refresh_lease(lease)  # type: ignore[attr-defined]
    finally:
        await store.close()


@pytest.mark.parametrize(("url", "endpoints"), [
    ("etcd://127.0.0.1:2379", [("127.0.0.1", 2379)]),
    ("etcd://etcd-0", [("etcd-0", 2379)]),
    ("etcd://a:1,b:2/", [("a", 1), ("b", 2)]),
    ("etcd://[::1]:2380", [("::1", 2380)]),
])
def test_etcd_urls_parse_into_endpoints(url: str, endpoints: list[tuple[str, int]]) -> None:
    assert parse_etcd_url(url) == endpoints


def test_a_malformed_etcd_url_names_an_example() -> None:
    with pytest.raises(ConfigError, match=r"etcd://127\.0\.0\.1:2379"):
        parse_etcd_url("etcd://a:1,:2")


async def test_a_value_over_etcd_s_request_limit_is_refused_clearly_not_blamed_on_an_outage(etcd_url: str) -> None:
    store = await open_store(etcd_url)
    # told a larger limit than this etcd's (its default --max-request-bytes): etcd itself refuses
    trusting = await open_store(etcd_url, settings=Settings(store_max_write_bytes=4 << 20))
    try:
        assert store.max_write_bytes == ETCD_MAX_REQUEST_BYTES
        with pytest.raises(WriteTooLarge, match=r"one write to etcd://.* may take \(store_max_write_bytes"):
            await store.put("/stead-test/too-large", b"x" * (2 << 20))  # refused before etcd is asked
        with pytest.raises(WriteTooLarge, match=r"larger than this etcd accepts \(its --max-request-bytes") as caught:
            await trusting.put("/stead-test/too-large", b"x" * (2 << 20))
        assert not isinstance(caught.value, StoreUnavailable)
        assert await store.get("/stead-test/too-large") is None
    finally:
        await trusting.close()
        await store.close()


async def test_the_largest_writes_stead_measures_as_fitting_are_ones_etcd_takes(etcd_url: str) -> None:
    """write_size is an upper bound of etcd's request size: a put and a full transaction of 128 keys, each exactly
    at etcd's default limit by that measure, are accepted by a real etcd."""
    store = await open_store(etcd_url)
    try:
        key = "/stead-test/largest/" + "k" * 200
        value = b"v" * (store.max_write_bytes - write_size([(key, 0)]))
        await store.put(key, value)
        assert (await store.get(key)).value == value  # type: ignore[union-attr]
        keys = [f"/stead-test/largest-txn/{i:04d}" for i in range(MAX_TXN_ITEMS)]
        each = (store.max_write_bytes - write_size((k, 0) for k in keys)) // len(keys)
        assert await store.create_all([(k, b"v" * each) for k in keys])
        assert len(await store.range("/stead-test/largest-txn/")) == MAX_TXN_ITEMS
    finally:
        await store.close()
