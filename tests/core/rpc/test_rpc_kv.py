"""KvService: set, get (with waiting), add and delete, served by the master."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from stead.core.errors import InvalidRequest
from stead.core.rpc import KvClient, KvServicer, RpcServer
from stead.core.rpc._proto.stead.v1 import KvGetRequest, KvSetRequest

pytestmark = pytest.mark.anyio


@pytest.fixture
async def kv(server: RpcServer, token: str, call_timeout_s: float) -> AsyncIterator[KvClient]:
    async with KvClient(server.address, token, call_timeout_s=call_timeout_s) as client:
        yield client


async def test_set_get_and_delete(kv: KvClient) -> None:
    assert await kv.get("absent") is None
    await kv.set("a", b"\x00binary\xff")
    assert await kv.get("a") == b"\x00binary\xff"
    await kv.set("a", b"")
    assert await kv.get("a") == b""  # an empty value is still a value
    assert await kv.delete("a") is True
    assert await kv.delete("a") is False
    assert await kv.get("a") is None


async def test_get_waits_for_a_key_set_later(kv: KvClient) -> None:
    results: list[bytes | None] = []

    async def wait_for_key() -> None:
        results.append(await kv.get("late", wait_s=30))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_key)
            await anyio.wait_all_tasks_blocked()
            await kv.set("late", b"here")
    assert results == [b"here"]


async def test_get_gives_up_waiting_with_none(kv: KvClient) -> None:
    assert await kv.get("never", wait_s=0.01) is None


async def test_a_waiting_get_wakes_on_its_key_only() -> None:
    servicer = KvServicer()
    results: list[bytes] = []

    async def wait_for_key() -> None:
        results.append((await servicer.get(KvGetRequest(key="mine", wait_timeout_s=30))).value)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_key)
            await anyio.wait_all_tasks_blocked()
            await servicer.set(KvSetRequest(key="other", value=b"x"))
            await anyio.wait_all_tasks_blocked()
            assert results == []
            await servicer.set(KvSetRequest(key="mine", value=b"y"))
    assert results == [b"y"]


async def test_add_counts_like_torchs_stores(kv: KvClient) -> None:
    assert await kv.add("counter", 2) == 2
    assert await kv.add("counter", 3) == 5
    assert await kv.add("counter", -6) == -1
    assert await kv.get("counter") == b"-1"  # decimal ASCII, as torch's TCPStore keeps counters
    await kv.set("text", b"hello")
    with pytest.raises(InvalidRequest, match="not an integer"):
        await kv.add("text", 1)


async def test_add_refuses_to_overflow(kv: KvClient) -> None:
    await kv.add("big", 2**63 - 1)
    with pytest.raises(InvalidRequest, match="overflow"):
        await kv.add("big", 1)
    assert await kv.get("big") == str(2**63 - 1).encode()


async def test_bad_keys_and_waits_are_rejected(kv: KvClient) -> None:
    with pytest.raises(InvalidRequest, match=r"KvSetRequest\.key is empty"):
        await kv.set("", b"v")
    with pytest.raises(InvalidRequest, match=r"KvGetRequest\.key"):
        await kv.get("k" * 5000)
    with pytest.raises(InvalidRequest, match=r"KvGetRequest\.wait_timeout_s"):
        await kv.get("k", wait_s=-1)
