"""sqlite-only behaviour: durability across reopen, other processes, file handling and locking."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import sqlite3
import sys
import textwrap
import threading
from contextlib import aclosing
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, StoreUnavailable
from stead.core.store import WatchKind, open_store
from stead.core.store.sqlite import SqliteStore, parse_sqlite_url

pytestmark = pytest.mark.anyio


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


async def test_data_revisions_and_history_survive_close_and_reopen(sqlite_dir: Path, settings: Settings) -> None:
    url = url_of(sqlite_dir / "state.db")
    store = await open_store(url, settings=settings)
    first = await store.put("/job/a", b"1")
    assert await store.create_all([("/job/e/1", b"x"), ("/job/e/2", b"y")])
    last = await store.put("/job/a", b"2")
    await store.close()

    store = await open_store(url, settings=settings)
    try:
        kv = await store.get("/job/a")
        assert kv is not None and (kv.value, kv.create_revision, kv.mod_revision) == (b"2", first, last)
        assert [k.key for k in await store.range("/job/e/")] == ["/job/e/1", "/job/e/2"]
        assert await store.revision() == last
        assert await store.put("/job/b", b"3") == last + 1
        async with aclosing(store.watch("/job/", start_revision=first)) as events:
            with anyio.fail_after(10):
                replay = [await anext(events) for _ in range(5)]
        assert [e.key for e in replay] == ["/job/a", "/job/e/1", "/job/e/2", "/job/a", "/job/b"]
    finally:
        await store.close()


async def test_the_database_uses_wal_is_private_and_parent_directories_are_created(sqlite_dir: Path,
                                                                                   settings: Settings) -> None:
    path = sqlite_dir / "deep" / "er" / "state.db"
    store = await open_store(url_of(path), settings=settings)
    try:
        await store.put("/k", b"v")
        assert isinstance(store, SqliteStore)
        conn = sqlite3.connect(path)
        try:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            conn.close()
        files = [path, path.with_name("state.db-wal"), path.with_name("state.db-shm")]
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o600" for p in files}
    finally:
        await store.close()


async def test_another_process_watching_the_file_sees_the_writes(sqlite_dir: Path, settings: Settings) -> None:
    # `stead events --follow` in another terminal while the master writes.
    url = url_of(sqlite_dir / "state.db")
    store = await open_store(url, settings=settings)
    try:
        start = await store.revision() + 1
        follower = textwrap.dedent(f"""
            import anyio
            from stead.core.config import Settings
            from stead.core.store import open_store

            async def main():
                store = await open_store({url!r}, settings=Settings(sqlite_watch_poll_s=0.02))
                events = store.watch("/events/", start_revision={start})
                for _ in range(3):
                    event = await anext(events)
                    print(event.key, event.value.decode(), flush=True)
                await events.aclose()
                await store.close()

            anyio.run(main)
        """)
        async with await anyio.open_process([sys.executable, "-c", follower]) as proc:
            try:
                await store.put("/events/1", b"one")
                await store.put("/other", b"ignored")
                assert proc.stdout is not None
                shown = b""
                with anyio.fail_after(30):
                    while b"/events/1 one\n" not in shown:  # the follower polls: the rest arrives while it does
                        shown += await proc.stdout.receive()
                assert await store.create_all([("/events/2", b"two"), ("/events/3", b"three")])
                with anyio.fail_after(30):
                    out = (shown + b"".join([chunk async for chunk in proc.stdout])).decode()
                    await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
        assert proc.returncode == 0
        seen = [line for line in out.splitlines() if line.startswith("/")]  # skip the follower's log lines
        assert seen == ["/events/1 one", "/events/2 two", "/events/3 three"]
    finally:
        await store.close()


async def test_an_expired_lease_is_swept_by_another_instance_polling(sqlite_dir: Path, settings: Settings) -> None:
    url = url_of(sqlite_dir / "state.db")
    holder, watcher = await open_store(url, settings=settings), await open_store(url, settings=settings)
    try:
        assert isinstance(holder, SqliteStore)
        lease = await holder.grant_lease(0.2)
        async with aclosing(watcher.watch("/members/")) as events:
            await holder.put("/members/a", b"alive", lease=lease)
            with anyio.fail_after(10):
                assert (await anext(events)).kind is WatchKind.PUT
                gone = await anext(events)  # the holder is silent: the watcher's poll deletes the key
        assert (gone.kind, gone.key) == (WatchKind.DELETE, "/members/a")
    finally:
        await watcher.close()
        await holder.close()


async def test_a_file_that_is_not_a_database_is_a_store_error(sqlite_dir: Path, settings: Settings) -> None:
    path = sqlite_dir / "junk.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not a database"):
        await open_store(url_of(path), settings=settings)


async def test_a_database_locked_too_long_is_store_unavailable(sqlite_dir: Path, settings: Settings) -> None:
    path = sqlite_dir / "state.db"
    store = await open_store(url_of(path), settings=dataclasses.replace(settings, store_timeout_s=0.1))
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailable, match="locked"):
            await store.put("/k", b"v")
        blocker.execute("ROLLBACK")
        await store.put("/k", b"v")
    finally:
        blocker.close()
        await store.close()


def test_sqlite_urls_follow_the_three_and_four_slash_convention() -> None:
    assert parse_sqlite_url("sqlite:///state.db") == Path("state.db")
    assert parse_sqlite_url("sqlite:///.stead/run/state.db") == Path(".stead/run/state.db")
    assert parse_sqlite_url("sqlite:////var/lib/stead.db") == Path("/var/lib/stead.db")
    assert parse_sqlite_url("sqlite:///~/stead.db") == Path("~/stead.db").expanduser()
    with pytest.raises(ConfigError, match=r"sqlite:///relative/path\.db"):
        parse_sqlite_url("sqlite://state.db")


def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "stead-sqlite"}


async def test_close_waits_for_the_write_in_flight_and_keeps_it(sqlite_dir: Path, settings: Settings) -> None:
    url = url_of(sqlite_dir / "state.db")
    before = _store_threads()
    store = await open_store(url, settings=settings)
    big = b"x" * (8 << 20)  # a write long enough to still be running when close() is called
    write = asyncio.ensure_future(store.put("/big", big))
    await asyncio.sleep(0)
    closer = threading.Thread(target=lambda: asyncio.run(store.close()))  # from another thread and loop
    closer.start()
    revision = await write
    await anyio.to_thread.run_sync(closer.join)
    with pytest.raises(StoreError, match="is closed; open a new one"):
        await store.get("/big")
    await store.close()
    assert _store_threads() == before  # the store's thread is gone
    again = await open_store(url, settings=settings)
    try:
        kv = await again.get("/big")
        assert kv is not None and kv.value == big and kv.mod_revision == revision
    finally:
        await again.close()


async def test_a_caller_cancelled_natively_mid_write_neither_crashes_nor_corrupts(sqlite_dir: Path,
                                                                                  settings: Settings) -> None:
    """The old crash: a task.cancel() freed the store for the next call while the first still ran."""
    store = await open_store(url_of(sqlite_dir / "state.db"), settings=settings)
    try:
        for round_ in range(50):
            tasks = [asyncio.ensure_future(store.put(f"/r{round_}/{i}", b"v" * 4096)) for i in range(4)]
            await asyncio.sleep(0.0005 * (round_ % 4))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        keys = [kv.key for kv in await store.range("/r")]
        assert len(keys) == len(set(keys)) and await store.revision() >= len(keys)
    finally:
        await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.put("/late", b"x")


async def test_a_store_dropped_without_close_stops_its_thread(sqlite_dir: Path, settings: Settings) -> None:
    before = _store_threads()
    store = await open_store(url_of(sqlite_dir / "state.db"), settings=settings)
    await store.put("/k", b"v")
    (thread,) = _store_threads() - before
    del store
    gc.collect()
    await anyio.to_thread.run_sync(thread.join, 10)
    assert not thread.is_alive()


def test_a_store_opened_on_one_loop_serves_another_loop(sqlite_dir: Path, settings: Settings) -> None:
    async def opened() -> SqliteStore:
        return await SqliteStore.open(url_of(sqlite_dir / "state.db"), settings)

    store = asyncio.run(opened())  # that loop is gone now
    try:
        assert asyncio.run(store.put("/k", b"v")) > 0
        kv = asyncio.run(store.get("/k"))
        assert kv is not None and kv.value == b"v"
    finally:
        asyncio.run(store.close())


async def test_a_close_while_the_closing_thread_is_still_on_its_way_out_returns(sqlite_dir: Path,
                                                                               settings: Settings) -> None:
    # the connection's thread announces that it closed, then exits: a second close() in between must return once
    # the thread is gone, not wait for an announcement that already came (it waited forever, seen under load)
    store = await open_store(url_of(sqlite_dir / "late.db"), settings=settings)
    assert isinstance(store, SqliteStore)
    await store.put("/k", b"v")
    before = _store_threads()
    leaving, release = threading.Event(), threading.Event()
    announce = store._conn.stopped.notify

    def held_announce() -> None:
        announce()
        leaving.set()
        release.wait(30)  # the thread is alive, its close announced, until the test lets it go

    store._conn.stopped.notify = held_announce  # type: ignore[method-assign]
    first = threading.Thread(target=lambda: asyncio.run(store.close()))
    first.start()
    await anyio.to_thread.run_sync(leaving.wait)
    letting_go = threading.Timer(0.2, release.set)
    letting_go.start()
    try:
        await store.close()
        assert release.is_set() and not (_store_threads() & before)  # returned once the thread had gone
    finally:
        release.set()
        letting_go.cancel()
        await anyio.to_thread.run_sync(first.join)
