"""The one contract every StateStore backend passes (memory, sqlite, a real etcd)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

import anyio
import pytest

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, WriteTooLarge
from stead.core.store import (
    EMBEDDED_MAX_WRITE_BYTES,
    MAX_TXN_ITEMS,
    MIN_MAX_WRITE_BYTES,
    KeyValue,
    StateStore,
    WatchEvent,
    WatchKind,
    open_store,
    write_size,
)
from stead.core.store.etcd import ETCD_MAX_REQUEST_BYTES

if TYPE_CHECKING:
    from conftest import Backend

pytestmark = pytest.mark.anyio

#: generous bound on waiting for an event that must come; never an assertion on speed
WAIT_S = 10.0
#: the smallest max_write_bytes a store takes: what the size tests set
LIMIT = MIN_MAX_WRITE_BYTES


async def take(events: AsyncIterator[WatchEvent], n: int) -> list[WatchEvent]:
    got: list[WatchEvent] = []
    with anyio.fail_after(WAIT_S):
        while len(got) < n:
            got.append(await anext(events))
    return got


async def nothing_more(events: AsyncIterator[WatchEvent], wait_s: float = 0.2) -> None:
    with anyio.move_on_after(wait_s):
        event = await anext(events)
        raise AssertionError(f"unexpected watch event {event}")


class TestStoreContract:
    async def test_open_store_returns_a_state_store(self, backend: Backend) -> None:
        assert isinstance(backend.store, StateStore)
        assert backend.store.url == backend.url

    async def test_get_of_a_missing_key_is_none(self, backend: Backend) -> None:
        assert await backend.store.get(backend.key("missing")) is None

    async def test_put_then_get_returns_value_and_revisions(self, backend: Backend) -> None:
        store, key = backend.store, backend.key("a")
        rev1 = await store.put(key, b"one")
        rev2 = await store.put(key, b"two")
        kv = await store.get(key)
        assert kv == KeyValue(key=key, value=b"two", create_revision=rev1, mod_revision=rev2, lease=None)

    async def test_revisions_increase_with_every_write(self, backend: Backend) -> None:
        store = backend.store
        before = await store.revision()
        revs = [await store.put(backend.key(f"k{i}"), b"v") for i in range(5)]
        assert before < revs[0]
        assert revs == sorted(set(revs))
        assert await store.revision() >= revs[-1]

    async def test_put_accepts_empty_and_binary_values(self, backend: Backend) -> None:
        store = backend.store
        await store.put(backend.key("empty"), b"")
        await store.put(backend.key("bin"), bytes(range(256)))
        assert (await store.get(backend.key("empty"))) is not None
        assert (await store.get(backend.key("empty"))).value == b""  # type: ignore[union-attr]
        assert (await store.get(backend.key("bin"))).value == bytes(range(256))  # type: ignore[union-attr]

    async def test_compare_and_put_with_zero_creates_only_a_missing_key(self, backend: Backend) -> None:
        store, key = backend.store, backend.key("cas")
        assert await store.compare_and_put(key, b"first", expected_mod_revision=0)
        before = await store.get(key)
        assert not await store.compare_and_put(key, b"second", expected_mod_revision=0)
        assert await store.get(key) == before

    async def test_compare_and_put_lost_race_returns_false_and_writes_nothing(self, backend: Backend) -> None:
        store, key = backend.store, backend.key("cas")
        rev = await store.put(key, b"v1")
        assert await store.compare_and_put(key, b"v2", expected_mod_revision=rev)
        after_win = await store.get(key)
        assert after_win is not None and after_win.value == b"v2"
        assert not await store.compare_and_put(key, b"v3", expected_mod_revision=rev)  # stale revision
        assert await store.get(key) == after_win
        assert not await store.compare_and_put(backend.key("absent"), b"x", expected_mod_revision=rev)
        assert await store.get(backend.key("absent")) is None

    async def test_two_concurrent_cas_writers_exactly_one_wins(self, backend: Backend) -> None:
        # What keeps two masters from both writing event seq N.
        first, second = backend.store, await backend.open_another()
        for round_no in range(10):
            key = backend.key(f"seq/{round_no}")
            results: dict[str, bool] = {}

            async def write(name: str, store: StateStore, key: str = key, results: dict[str, bool] = results) -> None:
                results[name] = await store.compare_and_put(key, name.encode(), expected_mod_revision=0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(write, "a", first)
                tg.start_soon(write, "b", second)
            winners = [name for name, won in results.items() if won]
            assert len(winners) == 1, results
            stored = await first.get(key)
            assert stored is not None and stored.value == winners[0].encode()

    async def test_concurrent_cas_on_an_existing_key_has_one_winner(self, backend: Backend) -> None:
        first, second = backend.store, await backend.open_another()
        key = backend.key("leader")
        rev = await first.put(key, b"old")
        results = []

        async def write(store: StateStore, value: bytes) -> None:
            results.append(await store.compare_and_put(key, value, expected_mod_revision=rev))

        async with anyio.create_task_group() as tg:
            tg.start_soon(write, first, b"a")
            tg.start_soon(write, second, b"b")
        assert sorted(results) == [False, True]

    async def test_create_all_creates_every_key_at_one_revision(self, backend: Backend) -> None:
        store = backend.store
        items = [(backend.key(f"ev/{i:04d}"), f"e{i}".encode()) for i in range(64)]
        assert await store.create_all(items)
        kvs = await store.range(backend.key("ev/"))
        assert [(kv.key, kv.value) for kv in kvs] == items
        assert len({kv.mod_revision for kv in kvs}) == 1

    async def test_put_all_writes_new_and_existing_keys_at_one_revision(self, backend: Backend) -> None:
        store = backend.store
        await store.put(backend.key("done/0001"), b"running")
        items = [(backend.key(f"done/{i:04d}"), b"done") for i in range(64)]
        revision = await store.put_all(items)
        kvs = await store.range(backend.key("done/"))
        assert [(kv.key, kv.value) for kv in kvs] == items
        assert {kv.mod_revision for kv in kvs} == {revision}
        assert await store.put_all([]) == revision  # nothing to write: the revision stays
        with pytest.raises(StoreError, match=r"put_all got .* twice"):
            await store.put_all([(backend.key("done/x"), b"1"), (backend.key("done/x"), b"2")])
        with pytest.raises(StoreError, match="split the batch"):
            await store.put_all([(backend.key(f"many/{i}"), b"v") for i in range(MAX_TXN_ITEMS + 1)])

    async def test_create_all_is_all_or_nothing(self, backend: Backend) -> None:
        store = backend.store
        await store.put(backend.key("ev/0002"), b"taken")
        items = [(backend.key(f"ev/{i:04d}"), b"new") for i in range(5)]
        revision = await store.revision()
        assert not await store.create_all(items)
        kvs = await store.range(backend.key("ev/"))
        assert [(kv.key, kv.value) for kv in kvs] == [(backend.key("ev/0002"), b"taken")]
        assert await store.revision() == revision

    async def test_create_all_of_nothing_succeeds(self, backend: Backend) -> None:
        assert await backend.store.create_all([])

    async def test_create_all_rejects_duplicates_and_oversized_batches(self, backend: Backend) -> None:
        store = backend.store
        with pytest.raises(StoreError, match="twice"):
            await store.create_all([(backend.key("d"), b"1"), (backend.key("d"), b"2")])
        too_many = [(backend.key(f"big/{i}"), b"") for i in range(MAX_TXN_ITEMS + 1)]
        with pytest.raises(StoreError, match="smaller"):
            await store.create_all(too_many)
        assert await store.create_all(too_many[:MAX_TXN_ITEMS])
        assert len(await store.range(backend.key("big/"))) == MAX_TXN_ITEMS

    async def test_max_write_bytes_is_the_setting_or_else_the_backends_own(self, backend: Backend,
                                                                           settings: Settings) -> None:
        own = ETCD_MAX_REQUEST_BYTES if backend.name.startswith("etcd") else EMBEDDED_MAX_WRITE_BYTES
        assert backend.store.max_write_bytes == own
        limited = dataclasses.replace(backend.settings, store_max_write_bytes=LIMIT)
        small = await open_store(backend.url, settings=limited)
        try:
            assert small.max_write_bytes == LIMIT
        finally:
            await small.close()
        with pytest.raises(ConfigError, match=r"store_max_write_bytes=1000 .* too small"):
            await open_store(backend.url, settings=dataclasses.replace(backend.settings, store_max_write_bytes=1000))

    async def test_a_write_larger_than_the_store_takes_is_refused_before_it_and_writes_nothing(
            self, backend: Backend, settings: Settings) -> None:
        limited = dataclasses.replace(backend.settings, store_max_write_bytes=LIMIT)
        store = await open_store(backend.url, settings=limited)
        try:
            key = backend.key("big")
            fits = b"x" * (LIMIT - write_size([(key, 0)]))
            over = fits + b"x"
            writes = {"put": lambda: store.put(key, over),
                      "compare_and_put": lambda: store.compare_and_put(key, over, expected_mod_revision=0),
                      "create_all": lambda: store.create_all([(key, over)]),
                      "put_all": lambda: store.put_all([(key, over)])}
            for name, write in writes.items():
                with pytest.raises(WriteTooLarge, match=f"^{name} of key '{key}' is {LIMIT + 1} bytes, more than "
                                                        f"the {LIMIT} bytes one write"):
                    await write()
            halves = [(backend.key(f"half/{i}"), fits[:len(fits) // 2]) for i in range(2)]
            with pytest.raises(WriteTooLarge, match="create_all of 2 keys"):
                await store.create_all(halves)
            assert await store.get(key) is None and await store.range(backend.key("half/")) == []
            await store.put(key, fits)  # exactly what one write takes
            assert (await store.get(key)).value == fits  # type: ignore[union-attr]
        finally:
            await store.close()

    async def test_delete_reports_whether_the_key_existed(self, backend: Backend) -> None:
        store, key = backend.store, backend.key("gone")
        await store.put(key, b"v")
        assert await store.delete(key)
        assert await store.get(key) is None
        assert not await store.delete(key)

    async def test_delete_prefix_deletes_only_under_the_prefix(self, backend: Backend) -> None:
        store = backend.store
        for name in ("job/a", "job/b", "job/c/d", "jobs", "other"):
            await store.put(backend.key(name), b"v")
        assert await store.delete_prefix(backend.key("job/")) == 3
        assert [kv.key for kv in await store.range(backend.ns)] == [backend.key("jobs"), backend.key("other")]
        assert await store.delete_prefix(backend.key("job/")) == 0

    async def test_range_is_in_key_order(self, backend: Backend) -> None:
        store = backend.store
        names = [f"r/{i:03d}" for i in range(30)]
        for name in random.Random(7).sample(names, len(names)):
            await store.put(backend.key(name), name.encode())
        kvs = await store.range(backend.key("r/"))
        assert [kv.key for kv in kvs] == [backend.key(n) for n in names]
        assert [kv.value for kv in kvs] == [n.encode() for n in names]

    async def test_range_start_is_inclusive_and_limit_bounds_the_result(self, backend: Backend) -> None:
        store = backend.store
        for i in range(10):
            await store.put(backend.key(f"r/{i}"), b"v")
        page = await store.range(backend.key("r/"), start=backend.key("r/3"), limit=4)
        assert [kv.key for kv in page] == [backend.key(f"r/{i}") for i in range(3, 7)]
        assert [kv.key for kv in await store.range(backend.key("r/"), start=backend.key("r/8"))] == [
            backend.key("r/8"), backend.key("r/9")]
        assert await store.range(backend.key("r/"), start=backend.key("r/99")) == []
        assert await store.range(backend.key("r/"), start=backend.key("s")) == []
        assert len(await store.range(backend.key("r/"), start=backend.key("a"))) == 10  # before the prefix
        assert await store.range(backend.key("r/"), limit=0) == []
        assert await store.range(backend.key("nothing/")) == []

    async def test_range_pages_through_a_prefix(self, backend: Backend) -> None:
        store = backend.store
        assert await store.create_all([(backend.key(f"p/{i:02d}"), b"v") for i in range(25)])
        seen: list[str] = []
        start: str | None = None
        while True:
            page = await store.range(backend.key("p/"), start=start, limit=10)
            seen += [kv.key for kv in page]
            if len(page) < 10:
                break
            start = page[-1].key + "\x01"
        assert seen == [backend.key(f"p/{i:02d}") for i in range(25)]

    async def test_range_prefix_is_a_string_prefix(self, backend: Backend) -> None:
        store = backend.store
        for name in ("a", "a/x", "ab", "b"):
            await store.put(backend.key(name), b"v")
        assert [kv.key for kv in await store.range(backend.key("a"))] == [
            backend.key("a"), backend.key("a/x"), backend.key("ab")]

    async def test_keys_with_non_ascii_characters_sort_by_utf8(self, backend: Backend) -> None:
        store = backend.store
        names = ["u/z", "u/é", "u/日本", "u/\U0001f600"]
        for name in reversed(names):
            await store.put(backend.key(name), name.encode())
        kvs = await store.range(backend.key("u/"))
        assert [kv.key for kv in kvs] == sorted(backend.key(n) for n in names)
        assert (await store.get(backend.key("u/日本"))) is not None

    async def test_watch_from_a_past_revision_replays_then_follows(self, backend: Backend) -> None:
        store = backend.store
        rev_a = await store.put(backend.key("w/a"), b"1")
        rev_b = await store.put(backend.key("w/b"), b"2")
        async with aclosing(store.watch(backend.key("w/"), start_revision=rev_a)) as events:
            replay = await take(events, 2)
            assert [(e.kind, e.key, e.value, e.revision) for e in replay] == [
                (WatchKind.PUT, backend.key("w/a"), b"1", rev_a), (WatchKind.PUT, backend.key("w/b"), b"2", rev_b)]
            rev_c = await store.put(backend.key("w/c"), b"3")
            assert await take(events, 1) == [WatchEvent(WatchKind.PUT, backend.key("w/c"), b"3", rev_c)]

    async def test_watch_start_revision_is_inclusive(self, backend: Backend) -> None:
        store = backend.store
        await store.put(backend.key("w/a"), b"1")
        rev_b = await store.put(backend.key("w/b"), b"2")
        async with aclosing(store.watch(backend.key("w/"), start_revision=rev_b)) as events:
            assert [e.key for e in await take(events, 1)] == [backend.key("w/b")]

    async def test_watch_without_start_revision_sees_only_later_changes(self, backend: Backend) -> None:
        store = backend.store
        await store.put(backend.key("w/old"), b"old")
        async with aclosing(store.watch(backend.key("w/"))) as events:
            rev = await store.put(backend.key("w/new"), b"new")
            assert await take(events, 1) == [WatchEvent(WatchKind.PUT, backend.key("w/new"), b"new", rev)]

    async def test_watch_sees_deletes(self, backend: Backend) -> None:
        store = backend.store
        start = await store.put(backend.key("w/a"), b"1")
        await store.put(backend.key("w/b"), b"2")
        async with aclosing(store.watch(backend.key("w/"), start_revision=start)) as events:
            await take(events, 2)
            rev = await store.delete_prefix(backend.key("w/")) and await store.revision()
            deletes = await take(events, 2)
            assert [(e.kind, e.key, e.revision) for e in deletes] == [
                (WatchKind.DELETE, backend.key("w/a"), rev), (WatchKind.DELETE, backend.key("w/b"), rev)]
            await store.put(backend.key("w/c"), b"3")
            assert await store.delete(backend.key("w/c"))
            assert [e.kind for e in await take(events, 2)] == [WatchKind.PUT, WatchKind.DELETE]

    async def test_watch_filters_by_prefix(self, backend: Backend) -> None:
        store = backend.store
        async with aclosing(store.watch(backend.key("mine/"))) as events:
            await store.put(backend.key("other/x"), b"no")
            await store.put(backend.key("mine/x"), b"yes")
            assert [e.value for e in await take(events, 1)] == [b"yes"]
            await nothing_more(events)

    async def test_watch_replays_create_all_at_one_revision(self, backend: Backend) -> None:
        store = backend.store
        start = await store.revision() + 1
        items = [(backend.key(f"ev/{i:02d}"), b"e") for i in range(20)]
        assert await store.create_all(items)
        async with aclosing(store.watch(backend.key("ev/"), start_revision=start)) as events:
            got = await take(events, 20)
        assert [e.key for e in got] == [k for k, _ in items]
        assert len({e.revision for e in got}) == 1

    async def test_watch_sees_writes_of_another_client(self, backend: Backend) -> None:
        # For sqlite this is the polling path: `stead events --follow` in another process.
        other = await backend.open_another()
        async with aclosing(backend.store.watch(backend.key("x/"))) as events:
            rev = await other.put(backend.key("x/1"), b"from the other client")
            assert await take(events, 1) == [WatchEvent(WatchKind.PUT, backend.key("x/1"), b"from the other client",
                                                        rev)]

    async def test_watch_after_compaction_cannot_start_before_it(self, backend: Backend) -> None:
        store = backend.store
        old = await store.put(backend.key("c/a"), b"1")
        await store.put(backend.key("c/a"), b"2")
        new = await store.put(backend.key("c/a"), b"3")
        await store.compact(new)  # type: ignore[attr-defined]
        with pytest.raises(StoreError, match="compacted"):
            async with aclosing(store.watch(backend.key("c/"), start_revision=old)) as events:
                await take(events, 1)
        async with aclosing(store.watch(backend.key("c/"), start_revision=new)) as events:
            assert [e.value for e in await take(events, 1)] == [b"3"]

    async def test_compacting_twice_or_beyond_the_current_revision_is_harmless(self, backend: Backend) -> None:
        store = backend.store
        rev = await store.put(backend.key("c/a"), b"1")
        await store.compact(rev)  # type: ignore[attr-defined]
        await store.compact(rev)  # type: ignore[attr-defined]
        await store.compact(rev - 1)  # type: ignore[attr-defined]
        await store.compact(rev + 1000)  # type: ignore[attr-defined]
        assert (await store.get(backend.key("c/a"))) is not None

    async def test_closing_the_store_ends_its_watches_with_a_store_error(self, backend: Backend) -> None:
        store = await backend.open_another() if backend.name != "memory" else await open_store("memory://")
        ended: list[StoreError] = []
        async with aclosing(store.watch(backend.key("w/"))) as events:
            await store.put(backend.key("w/a"), b"1")
            await take(events, 1)

            async def consume() -> None:
                try:
                    await anext(events)
                except StoreError as exc:
                    ended.append(exc)

            with anyio.fail_after(WAIT_S):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    await anyio.wait_all_tasks_blocked()  # the consumer waits on the watch
                    await store.close()
        assert len(ended) == 1 and "closed" in str(ended[0])

    async def test_lease_keys_vanish_when_the_lease_is_revoked(self, backend: Backend) -> None:
        store = backend.store
        async with aclosing(store.watch(backend.key("l/"))) as events:
            async with store.lease(backend.short_ttl_s) as lease:
                await store.put(backend.key("l/member"), b"me", lease=lease)
                kv = await store.get(backend.key("l/member"))
                assert kv is not None and kv.lease == lease.id
                assert await store.compare_and_put(backend.key("l/cas"), b"me", expected_mod_revision=0, lease=lease)
            assert await store.get(backend.key("l/member")) is None
            assert await store.get(backend.key("l/cas")) is None
            kinds = [(e.kind, e.key) for e in await take(events, 4)]
            assert kinds[2:] == [(WatchKind.DELETE, backend.key("l/cas")), (WatchKind.DELETE, backend.key("l/member"))]

    async def test_lease_keeps_its_keys_alive_beyond_its_ttl(self, backend: Backend) -> None:
        store = backend.store
        async with store.lease(backend.short_ttl_s) as lease:
            await store.put(backend.key("l/alive"), b"v", lease=lease)
            await anyio.sleep(lease.ttl_s * 2.5)
            assert await store.get(backend.key("l/alive")) is not None

    async def test_lease_keys_vanish_after_expiry_without_keep_alive(self, backend: Backend) -> None:
        store = backend.store
        lease = await store.grant_lease(backend.short_ttl_s)  # type: ignore[attr-defined]
        async with aclosing(store.watch(backend.key("l/"))) as events:
            await store.put(backend.key("l/orphan"), b"v", lease=lease)
            await store.put(backend.key("l/plain"), b"v")
            await take(events, 2)
            gone = await take(events, 1)  # nobody refreshes: the store itself deletes the key
            assert [(e.kind, e.key) for e in gone] == [(WatchKind.DELETE, backend.key("l/orphan"))]
        assert await store.get(backend.key("l/orphan")) is None
        assert await store.get(backend.key("l/plain")) is not None
        with pytest.raises(StoreError, match="lease"):
            await store.put(backend.key("l/late"), b"v", lease=lease)

    async def test_losing_the_lease_cancels_the_body_and_is_raised_from_the_context(self, backend: Backend) -> None:
        store, other = backend.store, await backend.open_another()
        finished = False
        with anyio.fail_after(WAIT_S), pytest.raises(StoreError, match="expired or was revoked"):
            async with store.lease(backend.short_ttl_s) as lease:
                await store.put(backend.key("l/leader"), b"me", lease=lease)
                await other.revoke_lease(lease)  # type: ignore[attr-defined]  # e.g. an operator, or a long pause
                await anyio.sleep(WAIT_S)
                finished = True
        assert not finished
        assert await store.get(backend.key("l/leader")) is None

    async def test_put_with_a_revoked_lease_is_refused(self, backend: Backend) -> None:
        store = backend.store
        async with store.lease(backend.short_ttl_s) as lease:
            pass
        with pytest.raises(StoreError, match="lease"):
            await store.put(backend.key("l/x"), b"v", lease=lease)
        assert await store.get(backend.key("l/x")) is None

    async def test_lease_context_reraises_the_body_error_unwrapped(self, backend: Backend) -> None:
        store = backend.store
        with pytest.raises(KeyError):
            async with store.lease(backend.short_ttl_s) as lease:
                await store.put(backend.key("l/x"), b"v", lease=lease)
                raise KeyError("boom")
        assert await store.get(backend.key("l/x")) is None

    @pytest.mark.parametrize("bad_key", ["", "no-slash", "/nul\x00", "/bad\udc80surrogate", 42, b"/bytes"])
    async def test_bad_keys_are_refused_with_a_clear_error(self, backend: Backend, bad_key: object) -> None:
        store = backend.store
        with pytest.raises(StoreError, match="key"):
            await store.get(bad_key)  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="key"):
            await store.put(bad_key, b"v")  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="key"):
            await store.compare_and_put(bad_key, b"v", expected_mod_revision=0)  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="key"):
            await store.create_all([(backend.key("fine"), b"v"), (bad_key, b"v")])  # type: ignore[list-item]
        assert await store.get(backend.key("fine")) is None
        with pytest.raises(StoreError, match="key"):
            await store.delete(bad_key)  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="prefix"):
            await store.range(bad_key)  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="prefix"):
            await store.delete_prefix(bad_key)  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="prefix"):
            store.watch(bad_key)  # type: ignore[arg-type]

    async def test_bad_arguments_are_refused(self, backend: Backend) -> None:
        store = backend.store
        with pytest.raises(StoreError, match="bytes"):
            await store.put(backend.key("v"), "text")  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="expected_mod_revision"):
            await store.compare_and_put(backend.key("v"), b"v", expected_mod_revision=-1)
        with pytest.raises(StoreError, match="limit"):
            await store.range(backend.ns, limit=-1)
        with pytest.raises(StoreError, match="ttl"):
            store.lease(0)
        with pytest.raises(StoreError, match="start_revision"):
            store.watch(backend.ns, start_revision=-5)

    async def test_close_is_idempotent_and_later_calls_fail_clearly(self, backend: Backend) -> None:
        store = await backend.open_another() if backend.name != "memory" else await open_store("memory://")
        await store.put(backend.key("c"), b"v")
        await store.close()
        await store.close()
        with pytest.raises(StoreError, match="closed"):
            await store.get(backend.key("c"))


async def test_unknown_scheme_is_a_config_error_naming_the_known_ones(settings: Settings) -> None:
    with pytest.raises(ConfigError, match=r"etcd.*memory.*sqlite.*etcd://127\.0\.0\.1:2379"):
        await open_store("redis://localhost:6379", settings=settings)
    with pytest.raises(ConfigError, match="scheme"):
        await open_store("/just/a/path.db")


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///", "sqlite:/x.db", "etcd://", "etcd://host:notaport",
                                 "etcd://host:99999", "etcd://:2379"])
async def test_malformed_urls_are_config_errors(url: str, settings: Settings) -> None:
    with pytest.raises(ConfigError, match="URL"):
        await open_store(url, settings=settings)
