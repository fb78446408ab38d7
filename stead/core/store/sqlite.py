"""Embedded, durable StateStore on one SQLite file (``sqlite:///path.db``): the default for local runs.

``sqlite:///run/stead.db`` is relative to the working directory and
``sqlite:////var/lib/stead.db`` is absolute (SQLAlchemy's convention); ``~`` is
expanded and missing parent directories are created.

Durability: WAL journal with ``synchronous=FULL``, so a write that returned is
on disk even after a power loss. The event log is "persist first, then act":
an event the master acted on must never vanish on a crash, and ``NORMAL`` in WAL
mode may lose the last commits on an OS crash. The cost is one fsync per
commit, which batched ``create_all`` calls amortise.

All SQL runs on one connection, one call at a time, in a thread the store owns
(the only thread that ever sees the connection), so the event loop never waits
on the disk and no caller, cancelled or not, on whatever loop or thread, can use
the connection concurrently or after it was closed. Every write gets a revision; changes go to
a ``history`` table that ``watch`` replays from any revision. Watchers of this
instance are woken at once; writes of other processes on the same file are
seen by polling every ``sqlite_watch_poll_s``. Leases live in a table with a
wall-clock expiry (several processes share it); expired leases and their keys
are deleted lazily by every call and by polling watchers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import sqlite3
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import structlog

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, StoreUnavailable
from stead.core.store._common import (
    EMBEDDED_MAX_WRITE_BYTES,
    Notifier,
    StoreLease,
    check_items,
    check_key,
    check_limit,
    check_prefix,
    check_revision,
    check_ttl,
    check_value,
    check_write,
    hold_lease,
    max_write_bytes,
    prefix_end,
)
from stead.core.store.base import KeyValue, Lease, StateStore, WatchEvent, WatchKind

__all__ = ["SqliteStore", "open_store", "parse_sqlite_url"]

log = structlog.get_logger()

T = TypeVar("T")

_SCHEMA_VERSION = 1
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS kv (
    key BLOB NOT NULL UNIQUE, value BLOB NOT NULL,
    create_rev INTEGER NOT NULL, mod_rev INTEGER NOT NULL, lease INTEGER);
CREATE INDEX IF NOT EXISTS kv_by_lease ON kv(lease) WHERE lease IS NOT NULL;
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT, rev INTEGER NOT NULL,
    kind INTEGER NOT NULL, key BLOB NOT NULL, value BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS history_by_rev ON history(rev);
CREATE TABLE IF NOT EXISTS leases (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ttl_s REAL NOT NULL, expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS leases_by_expiry ON leases(expires_at);
INSERT OR IGNORE INTO meta VALUES ('schema', {_SCHEMA_VERSION}), ('revision', 0), ('compacted', 0);
"""
_PUT, _DELETE = 0, 1
#: most history rows one watch poll reads; bounds memory when replaying a long history
_WATCH_BATCH = 1000
_URL_PREFIX = "sqlite:///"


def parse_sqlite_url(url: str) -> Path:
    """The database path of a ``sqlite:///`` URL (three slashes: relative, four: absolute)."""
    if not url.startswith(_URL_PREFIX) or len(url) == len(_URL_PREFIX):
        raise ConfigError(f"bad sqlite store URL {url!r}; use sqlite:///relative/path.db "
                          "or sqlite:////absolute/path.db")
    return Path(url[len(_URL_PREFIX):]).expanduser()


class _Tx:
    """One write transaction: every change in it shares the next revision."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.base = int(conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])
        self.written = False

    @property
    def revision(self) -> int:
        return self.base + 1 if self.written else self.base

    def put(self, key: bytes, value: bytes, lease: int | None) -> None:
        self.put_many([(key, value)], lease)

    def put_many(self, items: Sequence[tuple[bytes, bytes]], lease: int | None) -> None:
        rev = self.base + 1
        self.written = True
        self.conn.executemany(
            "INSERT INTO kv (key, value, create_rev, mod_rev, lease) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value, mod_rev = excluded.mod_rev, "
            "lease = excluded.lease", [(k, v, rev, rev, lease) for k, v in items])
        self.conn.executemany("INSERT INTO history (rev, kind, key, value) VALUES (?, ?, ?, ?)",
                              [(rev, _PUT, k, v) for k, v in items])

    def deleted(self, keys: list[bytes]) -> int:
        """Record the deletion of ``keys`` (already removed from ``kv``)."""
        if keys:
            self.written = True
            self.conn.executemany("INSERT INTO history (rev, kind, key, value) VALUES (?, ?, ?, ?)",
                                  [(self.base + 1, _DELETE, k, b"") for k in sorted(keys)])
        return len(keys)

    def drop_lease(self, lease_id: int) -> None:
        rows = self.conn.execute("DELETE FROM kv WHERE lease = ? RETURNING key", (lease_id,)).fetchall()
        self.deleted([r[0] for r in rows])
        self.conn.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    def live_lease(self, lease: Lease | None) -> int | None:
        if lease is None:
            return None
        if self.conn.execute("SELECT 1 FROM leases WHERE id = ?", (lease.id,)).fetchone() is None:
            raise StoreError(f"lease {lease.id} expired or was revoked; take a new lease with store.lease()")
        return lease.id

    def finish(self) -> None:
        if self.written:
            self.conn.execute("UPDATE meta SET value = ? WHERE name = 'revision'", (self.base + 1,))


class _Job:
    """One call handed to the connection's thread, answered on the caller's event loop."""

    __slots__ = ("args", "fn", "future", "loop", "state")

    QUEUED, RUNNING, CANCELLED = 0, 1, 2

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.args, self.loop = fn, args, loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.state = _Job.QUEUED


class _Connection:
    """The thread that owns the SQLite connection: it opens it, runs every call on it in order, and closes it.

    No other thread ever sees the connection object, so nothing can use it
    concurrently or after it was closed, whatever happens to the callers: a caller
    cancelled before its call starts takes it back (it never runs); one cancelled
    while it runs leaves it to finish (a transaction commits or rolls back whole).
    ``stop`` lets every call queued before it finish, then closes the connection.
    """

    def __init__(self, url: str, path: Path, timeout_s: float, changed: Notifier) -> None:
        self.url = url
        self.changed = changed
        #: the newest store revision this client has seen (written by the thread only)
        self.known_revision = 0
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against stop() and a job's start against its cancel
        self._stopping = False
        self._stopped_from = 0
        self.stopped = Notifier()
        self._thread = threading.Thread(target=self._main, args=(path, timeout_s), name="stead-sqlite",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], args: tuple[Any, ...]) -> _Job:
        job = _Job(fn, args, asyncio.get_running_loop())
        with self._lock:
            if self._stopping:
                raise StoreError(f"store {self.url} is closed; open a new one with open_store()")
            self._queue.put(job)
        return job

    def cancel(self, job: _Job) -> None:
        with self._lock:
            if job.state == _Job.QUEUED:
                job.state = _Job.CANCELLED

    def stop(self) -> int:
        """Refuse new calls and have the thread close the connection after the queued ones; the stopped count
        before the first stop, which the thread moves past once the connection is closed (the same for every
        later stop: a second close must not wait for a notification the first one already had)."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._stopped_from = self.stopped.count
                self._queue.put(None)
            return self._stopped_from

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _main(self, path: Path, timeout_s: float) -> None:
        conn: sqlite3.Connection | BaseException
        try:
            conn = _connect(self.url, path, timeout_s)
        except BaseException as exc:
            conn = exc  # every call gets this error until the store is closed
        try:
            while (job := self._queue.get()) is not None:
                self._serve(conn, job)
                del job  # a finished call must not keep its store alive while this thread waits
        finally:
            if isinstance(conn, sqlite3.Connection):
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self.changed.notify()  # open watches wake up and find the store closed
            self.stopped.notify()  # last: a close() that sees it joins a thread with nothing left to do

    def join(self) -> None:
        self._thread.join()

    def _serve(self, conn: sqlite3.Connection | BaseException, job: _Job) -> None:
        with self._lock:
            if job.state == _Job.CANCELLED:
                return
            job.state = _Job.RUNNING
        if not isinstance(conn, sqlite3.Connection):
            self._answer(job, None, conn)
            return
        before = self.known_revision
        try:
            result = job.fn(conn, *job.args)
        except sqlite3.Error as exc:
            error = _map_error(self.url, exc)
            error.__cause__ = exc
            self._answer(job, None, error)
        except BaseException as exc:
            self._answer(job, None, exc)
        else:
            self._answer(job, result, None)
        if self.known_revision != before:
            self.changed.notify()

    @staticmethod
    def _answer(job: _Job, result: object, error: BaseException | None) -> None:
        def settle() -> None:
            if job.future.done():
                return  # the caller was cancelled and went away
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the caller's loop has closed: nobody is waiting
            job.loop.call_soon_threadsafe(settle)


class SqliteStore:
    """A StateStore on one SQLite file; several instances and processes may share it.

    Any thread and any event loop may call it at once (see :class:`_Connection`).
    """

    def __init__(self, url: str, path: Path, settings: Settings) -> None:
        self._url = url
        self._settings = settings
        self._max_write_bytes = max_write_bytes(settings, EMBEDDED_MAX_WRITE_BYTES, url)
        self._changed = Notifier()
        self._conn = _Connection(url, path, settings.store_timeout_s, self._changed)
        # a store dropped without close() still stops its thread and closes the file
        self._finalizer = weakref.finalize(self, self._conn.stop)

    @classmethod
    async def open(cls, url: str, settings: Settings | None = None) -> SqliteStore:
        """Open (creating if needed) the database of ``url``."""
        settings = settings or Settings()
        path = parse_sqlite_url(url)
        store = cls(url, path, settings)
        try:
            await store.revision()
        except BaseException:
            await store.close()
            raise
        log.info("store_opened", url=url, backend="sqlite", path=str(path))
        return store

    @property
    def url(self) -> str:
        return self._url

    @property
    def max_write_bytes(self) -> int:
        return self._max_write_bytes

    def _check_write(self, what: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        check_write(self._url, what, items, self._max_write_bytes)

    @property
    def _known_revision(self) -> int:
        return self._conn.known_revision

    # -- running SQL on the connection's thread --------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(connection, *args)`` on the connection's thread, after every call submitted before it."""
        job = self._conn.submit(fn, args)
        try:
            return cast(T, await job.future)
        except asyncio.CancelledError:
            self._conn.cancel(job)
            raise

    def _write(self, conn: sqlite3.Connection, body: Callable[[_Tx], T]) -> T:
        """Run ``body`` in one IMMEDIATE transaction, after deleting expired leases (connection thread)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            sweep = _Tx(conn)
            for (lease_id,) in conn.execute("SELECT id FROM leases WHERE expires_at <= ?", (time.time(),)).fetchall():
                sweep.drop_lease(lease_id)
            sweep.finish()
            tx = _Tx(conn)
            result = body(tx)
            tx.finish()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._conn.known_revision = max(self._conn.known_revision, tx.revision)
        return result

    def _sweep_if_due(self, conn: sqlite3.Connection) -> None:
        """Delete expired leases before a read, taking the write lock only when there is something to do."""
        if conn.execute("SELECT 1 FROM leases WHERE expires_at <= ? LIMIT 1", (time.time(),)).fetchone():
            self._write(conn, lambda tx: None)

    def _read(self, conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], T]) -> T:
        self._sweep_if_due(conn)
        return body(conn)

    # -- StateStore ---------------------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        raw = check_key(key)

        def body(conn: sqlite3.Connection) -> KeyValue | None:
            row = conn.execute("SELECT key, value, create_rev, mod_rev, lease FROM kv WHERE key = ?",
                               (raw,)).fetchone()
            return None if row is None else _key_value(row)

        return await self._run(self._read, body)

    async def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        raw, data = check_key(key), check_value(key, value)
        self._check_write("put", [(raw, data)])

        def body(tx: _Tx) -> int:
            tx.put(raw, data, tx.live_lease(lease))
            return tx.revision

        return await self._run(self._write, body)

    async def compare_and_put(
        self, key: str, value: bytes, *, expected_mod_revision: int, lease: Lease | None = None
    ) -> bool:
        raw, data = check_key(key), check_value(key, value)
        self._check_write("compare_and_put", [(raw, data)])
        check_revision("expected_mod_revision", expected_mod_revision)

        def body(tx: _Tx) -> bool:
            lease_id = tx.live_lease(lease)
            row = tx.conn.execute("SELECT mod_rev FROM kv WHERE key = ?", (raw,)).fetchone()
            if (0 if row is None else row[0]) != expected_mod_revision:
                return False
            tx.put(raw, data, lease_id)
            return True

        return await self._run(self._write, body)

    async def put_all(self, items: Sequence[tuple[str, bytes]]) -> int:
        raws = [(raw, value) for _, raw, value in check_items(items, what="put_all")]
        self._check_write("put_all", raws)

        def body(tx: _Tx) -> int:
            if raws:
                tx.put_many(raws, None)
            return tx.revision

        return await self._run(self._write, body)

    async def create_all(self, items: Sequence[tuple[str, bytes]]) -> bool:
        checked = check_items(items)
        if not checked:
            return True
        raws = [(raw, value) for _, raw, value in checked]
        self._check_write("create_all", raws)

        def body(tx: _Tx) -> bool:
            marks = ",".join("?" * len(raws))
            if tx.conn.execute(f"SELECT 1 FROM kv WHERE key IN ({marks}) LIMIT 1", [r for r, _ in raws]).fetchone():
                return False
            tx.put_many(raws, None)
            return True

        return await self._run(self._write, body)

    async def delete(self, key: str) -> bool:
        raw = check_key(key)

        def body(tx: _Tx) -> bool:
            rows = tx.conn.execute("DELETE FROM kv WHERE key = ? RETURNING key", (raw,)).fetchall()
            return tx.deleted([r[0] for r in rows]) > 0

        return await self._run(self._write, body)

    async def delete_prefix(self, prefix: str) -> int:
        low = check_prefix(prefix)
        high = prefix_end(low)

        def body(tx: _Tx) -> int:
            rows = tx.conn.execute("DELETE FROM kv WHERE key >= ? AND key < ? RETURNING key", (low, high)).fetchall()
            return tx.deleted([r[0] for r in rows])

        return await self._run(self._write, body)

    async def range(self, prefix: str, *, start: str | None = None, limit: int | None = None) -> list[KeyValue]:
        low = check_prefix(prefix)
        high = prefix_end(low)
        if start is not None:
            low = max(low, check_key(start))
        check_limit(limit)

        def body(conn: sqlite3.Connection) -> list[KeyValue]:
            rows = conn.execute("SELECT key, value, create_rev, mod_rev, lease FROM kv WHERE key >= ? AND key < ? "
                                "ORDER BY key LIMIT ?", (low, high, -1 if limit is None else limit)).fetchall()
            return [_key_value(r) for r in rows]

        return await self._run(self._read, body)

    def watch(self, prefix: str, *, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        low = check_prefix(prefix)
        if start_revision is not None:
            check_revision("start_revision", start_revision)
        start = self._known_revision + 1 if start_revision is None else start_revision
        return self._watch(low, prefix_end(low), start)

    async def _watch(self, low: bytes, high: bytes, start: int) -> AsyncIterator[WatchEvent]:
        cursor: int | None = None
        seen = start - 1
        while True:
            changed = self._changed.count
            rows, cursor, seen = await self._run(self._read_changes, low, high, start, cursor, seen)
            for _, rev, kind, key, value in rows:
                yield WatchEvent(kind=WatchKind.PUT if kind == _PUT else WatchKind.DELETE, key=key.decode(),
                                 value=value, revision=rev)
            if len(rows) < _WATCH_BATCH:
                await self._changed.wait_past(changed, self._settings.sqlite_watch_poll_s)

    def _read_changes(self, conn: sqlite3.Connection, low: bytes, high: bytes, start: int, cursor: int | None,
                      seen: int) -> tuple[list[tuple[int, int, int, bytes, bytes]], int, int]:
        """History rows under ``[low, high)`` after ``cursor``, the new cursor and the revision fully seen."""
        self._sweep_if_due(conn)
        conn.execute("BEGIN")  # one snapshot for the revision, the cursor and the rows
        try:
            revision, compacted = conn.execute(
                "SELECT (SELECT value FROM meta WHERE name = 'revision'), "
                "(SELECT value FROM meta WHERE name = 'compacted')").fetchone()
            if compacted > seen + 1:
                raise StoreError(f"watch of {self._url} needs revision {seen + 1} but history before {compacted} "
                                 "was compacted; re-read with range() and watch from revision()+1")
            if cursor is None:
                first = conn.execute("SELECT id FROM history WHERE rev >= ? ORDER BY rev, id LIMIT 1",
                                     (start,)).fetchone()
                cursor = first[0] - 1 if first else conn.execute(
                    "SELECT coalesce(max(id), 0) FROM history").fetchone()[0]
            rows = conn.execute("SELECT id, rev, kind, key, value FROM history WHERE id > ? AND rev >= ? "
                                "AND key >= ? AND key < ? ORDER BY id LIMIT ?",
                                (cursor, start, low, high, _WATCH_BATCH)).fetchall()
            if len(rows) < _WATCH_BATCH:
                cursor = max(cursor, conn.execute("SELECT coalesce(max(id), 0) FROM history").fetchone()[0])
                seen = max(seen, revision)
            else:
                cursor, seen = rows[-1][0], rows[-1][1] - 1
        finally:
            conn.execute("COMMIT")
        self._conn.known_revision = max(self._conn.known_revision, revision)
        return rows, cursor, seen

    def lease(self, ttl_s: float) -> AbstractAsyncContextManager[Lease]:
        check_ttl(ttl_s)
        return hold_lease(url=self._url, grant=lambda: self.grant_lease(ttl_s), refresh=self.refresh_lease,
                          revoke=self.revoke_lease, revoke_timeout_s=self._settings.store_timeout_s)

    async def revision(self) -> int:
        def body(conn: sqlite3.Connection) -> int:
            revision = int(conn.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()[0])
            self._conn.known_revision = max(self._conn.known_revision, revision)
            return revision

        return await self._run(self._read, body)

    async def close(self) -> None:
        """Wait for the calls already submitted, then close the connection; later calls raise StoreError.

        Safe from any thread or event loop, and more than once (the later closes wait too).
        """
        stopped = self._conn.stop()
        self._finalizer.detach()
        if self._conn.alive:
            with anyio.CancelScope(shield=True):
                await self._conn.stopped.wait_past(stopped)
                await anyio.to_thread.run_sync(self._conn.join)  # its last act was that notification
        log.info("store_closed", url=self._url, backend="sqlite")

    # -- beyond the protocol: raw leases (no keep-alive) and history compaction --------------------------------

    async def grant_lease(self, ttl_s: float) -> Lease:
        """A lease nobody keeps alive: it expires ``ttl_s`` from now unless refreshed."""
        check_ttl(ttl_s)

        def body(tx: _Tx) -> Lease:
            cur = tx.conn.execute("INSERT INTO leases (ttl_s, expires_at) VALUES (?, ?)", (ttl_s, time.time() + ttl_s))
            assert cur.lastrowid is not None
            return StoreLease(id=cur.lastrowid, ttl_s=ttl_s)

        return await self._run(self._write, body)

    async def refresh_lease(self, lease: Lease) -> None:
        """Push the lease's expiry ``ttl_s`` into the future; StoreError if it is already gone."""
        def body(tx: _Tx) -> None:
            cur = tx.conn.execute("UPDATE leases SET expires_at = ? + ttl_s WHERE id = ?", (time.time(), lease.id))
            if cur.rowcount == 0:
                raise StoreError(f"lease {lease.id} on {self._url} expired or was revoked; take a new lease")

        await self._run(self._write, body)

    async def revoke_lease(self, lease: Lease) -> None:
        """Delete the lease and its keys now; a lease already gone is not an error."""
        await self._run(self._write, lambda tx: tx.drop_lease(lease.id))

    async def compact(self, revision: int) -> None:
        """Forget the change history before ``revision``; watches cannot start before it any more."""
        check_revision("revision", revision)

        def body(tx: _Tx) -> None:
            upto = min(revision, tx.base)
            tx.conn.execute("DELETE FROM history WHERE rev < ?", (upto,))
            tx.conn.execute("UPDATE meta SET value = max(value, ?) WHERE name = 'compacted'", (upto,))

        await self._run(self._write, body)


def _key_value(row: tuple[bytes, bytes, int, int, int | None]) -> KeyValue:
    key, value, create_rev, mod_rev, lease = row
    return KeyValue(key=key.decode(), value=value, create_revision=create_rev, mod_revision=mod_rev, lease=lease)


def _connect(url: str, path: Path, timeout_s: float) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create directory {path.parent} for store {url}: {exc}; "
                         "pick a writable path or create it") from exc
    try:
        # the event log holds the job's whole history: readable by its owner only (0600); sqlite gives its
        # -wal and -shm files the database file's mode
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))  # (an existing file is left as it is)
        conn = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)  # used by this thread only
    except OSError as exc:
        raise StoreError(f"cannot open {path} for store {url}: {exc}; pick a path this user can write") from exc
    except sqlite3.Error as exc:
        raise _map_error(url, exc) from exc
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(f"store {url} could not switch {path} to WAL mode (got {mode!r}); "
                             "put the database on a local file system")
        conn.execute("PRAGMA synchronous = FULL")
        conn.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} COMMIT;")  # concurrent first opens create it once
        version = conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()[0]
        if version != _SCHEMA_VERSION:
            raise StoreError(f"store {url} has schema version {version}, this stead reads {_SCHEMA_VERSION}; "
                             "use the stead version that wrote it or start a new database file")
    except sqlite3.Error as exc:
        conn.close()
        raise _map_error(url, exc) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _map_error(url: str, exc: sqlite3.Error) -> StoreError | StoreUnavailable:
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text):
        return StoreUnavailable(f"store {url} stayed locked by another writer ({text}); retry later, or stop the "
                                "other process holding the database, or raise store_timeout_s")
    return StoreError(f"store {url} failed: {text}; check the file's path, permissions and free disk space, "
                      "or move the damaged file away and start a new one")


async def open_store(url: str, settings: Settings) -> StateStore:
    """Entry point of the ``sqlite`` scheme."""
    return await SqliteStore.open(url, settings)
