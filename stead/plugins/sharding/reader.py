"""One process's stream of one dataset: the leases it holds and the thread that keeps them coming.

The training loop's thread only pops ranges from a local queue; a background thread
(its own event loop, one connection to the master) leases ahead so that
``prefetch`` shards are always waiting, reports progress every
``shard_report_interval_s`` (which renews the leases), and runs the few calls the
loop makes synchronously (register, restore, save) one at a time with the leasing,
so the stream's order is never in doubt.

A worker whose leases may have expired (no answer from the master for
``shard_lease_timeout_s``: another worker may have been given its samples) does not
hand out another range until the master renews them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import structlog

from stead.plugin import Settings, SteadError, retrying
from stead.plugins.sharding.client import ShardBackend
from stead.plugins.sharding.ledger import CursorState, DatasetSpec, Range
from stead.plugins.sharding.service import StreamId
from stead.plugins.sharding.settings import ShardingSettings
from stead.plugins.sharding.steps import StepTracker, add_tracker, remove_tracker

__all__ = ["Reader"]

log = structlog.get_logger("stead.data")

T = TypeVar("T")
Connect = Callable[[], AbstractAsyncContextManager[ShardBackend]]


class Reader:
    """The stream of (``who.round``, ``who.rank``) for ``spec``; starts its thread and registers the dataset."""

    def __init__(self, *, spec: DatasetSpec, who: StreamId, settings: Settings, sharding: ShardingSettings,
                 connect: Connect, prefetch: int, partitions: Mapping[int, tuple[int, int]] | None = None,
                 closed: bool = False) -> None:
        self.spec, self.who, self.settings, self.sharding = spec, who, settings, sharding
        self.prefetch = prefetch
        self._connect = connect
        # read and written by the iterating thread; read (atomically) by the feeder
        self.consumed = 0
        self.epoch = 0
        self.started_reading = False
        #: this stream has told the master where its round starts (restored, or cut a cursor)
        self.declared = False
        #: the range being read, the next slot of it to map, and the mapped samples being handed out
        self.entry: Range | None = None
        self.entry_pos = 0
        self.chunk: list[Any] = []
        self.chunk_index = 0
        #: which positions of the stream the training loop received, step by step (for a step that is skipped)
        self.steps = StepTracker(spec.name, lambda: self.consumed)
        # shared with the feeder thread, under _cond
        self._cond = threading.Condition()
        self._ranges: collections.deque[Range] = collections.deque()
        self._buffered = 0
        self._have = 0  # ranges of the stream received from the master
        self._handed = 0  # ranges popped by the iterating thread
        self._last_start = 0  # stream position where the last popped range starts
        self._feed_epoch: int | None = None
        self._exhausted: int | None = None
        self._error: BaseException | None = None
        self._valid_until = math.inf
        self._timeout_s = 0.0
        self._last_contact = 0.0
        self._joined = False  # the round has started at the master: reports make sense
        self._stopping = False
        self._report_now = False
        self._waiting_logged: tuple[int, ...] = ()
        # the feeder's loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._backend: ShardBackend | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name=f"stead-data-{spec.name}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        try:
            self.call(lambda b: b.register(spec, partitions or {}, closed), what="register")
        except BaseException:
            self.close()
            raise
        add_tracker(self.steps)

    @property
    def low_water(self) -> int:
        return self.prefetch * self.spec.shard_size

    # -- the iterating thread ---------------------------------------------------------------------

    def begin(self, epoch: int, *, leftovers: bool) -> None:
        """Iteration of ``epoch`` starts; ``leftovers``: the reader holds unread slots of another epoch."""
        self.started_reading = True
        with self._cond:
            same = self._feed_epoch == epoch
        if same:
            self._poke()
            return
        self.call(lambda b: self._switch(b, epoch, leftovers=leftovers), what="begin")

    def next_range(self, epoch: int) -> Range | None:
        """The next range of ``epoch`` (in stream order); None when the epoch has nothing left for this rank."""
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                if self._ranges and time.monotonic() < self._valid_until:
                    entry = self._ranges.popleft()
                    self._buffered -= entry[2] - entry[1]
                    self._handed += 1
                    self._last_start = self.consumed
                    self.steps.handed(self.consumed, entry)
                    if self._buffered < self.low_water:
                        self._poke()
                    return entry
                if not self._ranges and self._exhausted == epoch:
                    return None
                if self._ranges:  # held, but maybe not ours any more: renew first
                    self._report_now = True
                self._poke()
                self._cond.wait(timeout=self.sharding.report_interval_s)

    def call(self, fn: Callable[[ShardBackend], Awaitable[T]], *, what: str) -> T:
        """Run ``fn(backend)`` on the feeder's loop, after any call in flight, retrying while the master is away."""
        loop = self._loop
        closed = f"the sampler of dataset {self.spec.name!r} is closed"
        if loop is None or not self._thread.is_alive():
            raise self._error or RuntimeError(closed)
        try:
            future = asyncio.run_coroutine_threadsafe(self._locked(fn, what), loop)
        except RuntimeError:  # the loop closed after the check
            raise self._error or RuntimeError(closed) from None
        while True:  # a loop that stops before it runs the call never answers: watch the thread meanwhile
            try:
                return future.result(timeout=self.sharding.report_interval_s)
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    future.cancel()
                    raise self._error or RuntimeError(closed) from None

    def close(self) -> None:
        """Give back the unread leases (best effort) and stop the thread."""
        remove_tracker(self.steps)
        if not self._thread.is_alive():
            return
        with self._cond:
            self._stopping = True
        self._poke()
        self._thread.join(timeout=self.sharding.wait_s + 2 * self.settings.rpc_timeout_s)

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(wake.set)

    # -- the feeder thread -----------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # the training thread raises it
            self._fail(exc)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake, self._lock = asyncio.Event(), asyncio.Lock()
        async with self._connect() as backend:
            self._backend = backend
            self._ready.set()
            await self._feed()

    async def _feed(self) -> None:
        assert self._wake is not None
        while True:
            with self._cond:
                stopping = self._stopping
            if stopping:
                await self._goodbye()
                return
            with self._cond:
                epoch = self._feed_epoch
                want = (epoch is not None and self._exhausted != epoch and self._error is None
                        and self._buffered < self.low_water)
                report = self._joined and self._error is None and (
                    self._report_now or time.monotonic() - self._last_contact >= self.sharding.report_interval_s)
            if want:
                assert epoch is not None
                await self._lease(epoch)
            elif report:
                await self._report()
            else:
                self._wake.clear()
                idle = max(0.0, self._last_contact + self.sharding.report_interval_s - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(idle if self._joined else None):
                        await self._wake.wait()

    async def _locked(self, fn: Callable[[ShardBackend], Awaitable[T]], what: str) -> T:
        assert self._lock is not None and self._backend is not None
        backend = self._backend
        async with self._lock:
            return await retrying(lambda: fn(backend), self.settings, what=f"shards.{what}")

    async def _lease(self, epoch: int) -> None:
        sent = time.monotonic()
        try:
            reply = await self._locked(lambda b: b.lease(
                self.who, epoch=epoch, have=self._have, count=self.prefetch, consumed=self.consumed,
                wait_s=self.sharding.wait_s), "lease")
        except SteadError as exc:
            self._fail(exc)
            return
        with self._cond:
            if self._feed_epoch != epoch:  # (cannot happen: switches wait for this call) keep the order safe
                return
            self._ranges.extend(reply.ranges)
            self._have += len(reply.ranges)
            self._buffered += sum(e - s for _, s, e in reply.ranges)
            if reply.exhausted and not reply.ranges:
                self._exhausted = epoch
            if not reply.waiting_for:
                self._joined = True
                self._renewed(sent, reply.lease_timeout_s)
            self._cond.notify_all()
        if reply.waiting_for and reply.waiting_for != self._waiting_logged:
            self._waiting_logged = reply.waiting_for
            log.info("shards_waiting_for_ranks", dataset=self.spec.name, round=self.who.round,
                     ranks=list(reply.waiting_for), hint="every rank must iterate or call load_state_dict")

    async def _report(self) -> None:
        sent = time.monotonic()
        self._report_now = False
        try:
            await self._locked(lambda b: b.report(self.who, consumed=self.consumed, epoch=self.epoch,
                                                  release_rest=False), "report")
        except SteadError as exc:
            self._fail(exc)
            return
        with self._cond:
            self._renewed(sent, None)
            self._cond.notify_all()

    def _renewed(self, sent: float, timeout_s: float | None) -> None:
        if timeout_s is not None:
            self._timeout_s = timeout_s
        self._last_contact = sent
        self._valid_until = sent + self._timeout_s if self._timeout_s > 0 else math.inf

    async def _switch(self, backend: ShardBackend, epoch: int, *, leftovers: bool) -> None:
        """(Runs under the call lock.) Feed ``epoch`` from now on, giving back unread slots of the old one."""
        with self._cond:
            release = leftovers or bool(self._ranges)
        if release and self._joined:
            at = self.consumed
            await backend.report(self.who, consumed=at, epoch=self.epoch, release_rest=True)
            with self._cond:
                self._ranges.clear()
                self._buffered = 0
                self._have = self._handed - (1 if self._handed and self._last_start >= at else 0)
                self._handed = self._have
        with self._cond:
            self._feed_epoch = epoch
            self._exhausted = None
        self._poke()

    async def _goodbye(self) -> None:
        """Give back what this worker leased but will not read, so that others can (one attempt, no retry)."""
        assert self._lock is not None and self._backend is not None
        if not self._joined or self._error is not None:
            return
        with contextlib.suppress(SteadError, TimeoutError):
            async with self._lock, asyncio.timeout(self.settings.rpc_timeout_s):
                await self._backend.report(self.who, consumed=self.consumed, epoch=self.epoch, release_rest=True)

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
                log.error("shards_failed", dataset=self.spec.name, round=self.who.round, rank=self.who.rank,
                          error=str(exc))
            self._cond.notify_all()

    # -- cursors ------------------------------------------------------------------------------------

    def restore(self, cursor: CursorState) -> None:
        self.call(lambda b: b.restore(self.who, cursor), what="restore")
        self.declared = True

    def save(self, consumed: list[int], epochs: list[int]) -> CursorState:
        while True:
            reply = self.call(lambda b: b.save(self.who, consumed=consumed, epochs=epochs,
                                               wait_s=self.sharding.wait_s), what="save")
            if reply.cursor is not None:
                with self._cond:
                    self._joined = True
                self.declared = True
                return reply.cursor
            log.info("shards_waiting_for_ranks", dataset=self.spec.name, round=self.who.round,
                     ranks=list(reply.waiting_for), hint="every rank must call state_dict together")


@contextlib.asynccontextmanager
async def local_backend(sharding: ShardingSettings, *, static: bool = False) -> AsyncIterator[ShardBackend]:
    """The master's service on an in-memory store, for a script run without stead (``static``: one rank of many)."""
    from stead.core.store.memory import MemoryStore
    from stead.plugins.sharding.client import LocalBackend, StaticBackend

    store = MemoryStore()
    try:
        yield (StaticBackend if static else LocalBackend)(store, sharding)
    finally:
        await store.close()
