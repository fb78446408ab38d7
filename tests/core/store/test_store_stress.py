"""Every backend under concurrent use from several event loops and threads, random cancellations and a close.

The SQLite store once crashed the interpreter (a segfault in COMMIT) when a
caller was cancelled natively while its call ran in a worker thread and the
store was then closed under it. This test would have caught it: writers,
readers and watchers on the test's loop and on loops of their own threads, each
call cancelled at random (``task.cancel()``, ``asyncio.timeout``, anyio scopes),
then the store closed from yet another thread in the middle of the load. It
asserts behaviour only: no crash or hang, every acknowledged write kept, a CAS
counter that never loses an increment, watch events in revision order, and
after the close nothing but StoreError.

``STEAD_STRESS_S`` sets the length of each load burst (``make stress`` runs it
shorter and hundreds of times).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import threading
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import pytest

from stead.core.errors import StoreError
from stead.core.store import StateStore

if TYPE_CHECKING:
    from conftest import Backend

pytestmark = pytest.mark.anyio

STRESS_S = float(os.environ.get("STEAD_STRESS_S", "2"))
#: threads with an event loop of their own, besides the test's loop
THREAD_LOOPS = 3
TASKS_PER_LOOP = 4
#: a thread that has not ended this long after the load stopped is hung: a failure, never a speed assertion
JOIN_S = 60.0


@dataclasses.dataclass
class Ledger:
    """What the load did, shared by every loop (under ``lock``)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    acked: dict[str, bytes] = dataclasses.field(default_factory=dict)
    cas_acked: int = 0
    cas_unknown: int = 0  # cancelled while in flight: may or may not have counted
    cancelled: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    closed: threading.Event = dataclasses.field(default_factory=threading.Event)

    def ack(self, *items: tuple[str, bytes]) -> None:
        with self.lock:
            self.acked.update(items)

    def error(self, where: str, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{where}: {exc!r}")


async def _cancellable(rng: random.Random, ledger: Ledger, call: object) -> tuple[bool, object]:
    """Await ``call`` under a random kind of cancellation; (finished, result)."""
    assert asyncio.iscoroutine(call)
    kind = rng.randrange(4)
    if kind == 0:
        return True, await call
    if kind == 1:
        try:
            async with asyncio.timeout(rng.uniform(0, 0.003)):  # native cancellation
                return True, await call
        except TimeoutError:
            with ledger.lock:
                ledger.cancelled += 1
            return False, None
    if kind == 2:
        with anyio.move_on_after(rng.uniform(0, 0.003)):  # anyio's cancel scope
            return True, await call
        with ledger.lock:
            ledger.cancelled += 1
        return False, None
    return True, await call


async def _writer(store: StateStore, ns: str, who: str, ledger: Ledger, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    counter = ns + "counter"
    n = 0
    while not stop.is_set():
        n += 1
        key = f"{ns}d/{who}/{n:06d}"
        value = f"{who}:{n}".encode()
        op = rng.random()
        try:
            if op < 0.35:
                done, _ = await _cancellable(rng, ledger, store.put(key, value))
                if done:
                    ledger.ack((key, value))
            elif op < 0.5:
                items = [(key + "/a", value), (key + "/b", value)]
                done, created = await _cancellable(rng, ledger, store.create_all(items))
                if done:
                    assert created, f"create_all of fresh keys {key}/a,b lost a race nobody ran"
                    ledger.ack(*items)
            elif op < 0.7:
                current = await store.get(counter)
                expected = 0 if current is None else current.mod_revision
                count = 0 if current is None else int(current.value)
                done, won = await _cancellable(rng, ledger, store.compare_and_put(
                    counter, str(count + 1).encode(), expected_mod_revision=expected))
                with ledger.lock:
                    if not done:
                        ledger.cas_unknown += 1
                    elif won:
                        ledger.cas_acked += 1
            elif op < 0.85:
                await _cancellable(rng, ledger, store.range(ns + "d/", limit=20))
            else:
                await _cancellable(rng, ledger, store.get(key))
        except StoreError as exc:
            if ledger.closed.is_set():
                return  # the store was closed under us: the expected end
            ledger.error(f"{who} op {op:.2f}", exc)
            return
        except Exception as exc:  # anything else is a defect of the store
            ledger.error(f"{who} op {op:.2f}", exc)
            return


async def _watcher(store: StateStore, ns: str, who: str, ledger: Ledger, stop: threading.Event) -> None:
    last = 0
    try:
        async with contextlib.aclosing(store.watch(ns + "d/")) as events:  # type: ignore[type-var]
            async for event in events:
                if event.revision < last:
                    ledger.error(who, AssertionError(f"watch went back from revision {last} to {event.revision}"))
                    return
                last = event.revision
                if stop.is_set():
                    return
    except StoreError as exc:
        if not ledger.closed.is_set():
            ledger.error(who, exc)
    except Exception as exc:
        ledger.error(who, exc)


async def _load(store: StateStore, ns: str, name: str, ledger: Ledger, stop: threading.Event, seed: int) -> None:
    """Writers, a watcher, and a chaos task that cancels writers natively at random and starts new ones."""
    rng = random.Random(seed)
    spawned = 0

    def spawn() -> asyncio.Task[None]:
        nonlocal spawned
        spawned += 1
        return asyncio.create_task(_writer(store, ns, f"{name}-{spawned}", ledger, stop, rng.randrange(1 << 30)))

    writers = [spawn() for _ in range(TASKS_PER_LOOP)]
    watcher = asyncio.create_task(_watcher(store, ns, f"{name}-watch", ledger, stop))
    try:
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0, 0.01))
            victim = rng.randrange(len(writers))
            writers[victim].cancel()  # native cancellation, wherever the writer is
            with ledger.lock:
                ledger.cancelled += 1
            writers[victim] = spawn()
    finally:
        for task in [*writers, watcher]:
            task.cancel()
        await asyncio.gather(*writers, watcher, return_exceptions=True)


def _thread_load(store: StateStore, ns: str, name: str, ledger: Ledger, stop: threading.Event, seed: int) -> None:
    try:
        asyncio.run(_load(store, ns, name, ledger, stop, seed))
    except BaseException as exc:
        ledger.error(name, exc)


async def _burst(store: StateStore, ns: str, ledger: Ledger, seed: int, *, close_after_s: float | None) -> None:
    """Load from the test's loop and THREAD_LOOPS threads for STRESS_S; close the store from a thread midway."""
    stop = threading.Event()
    threads = [threading.Thread(target=_thread_load, args=(store, ns, f"t{seed}-{i}", ledger, stop, seed * 10 + i),
                                name=f"stress-{i}", daemon=True) for i in range(THREAD_LOOPS)]
    closer: threading.Thread | None = None
    if close_after_s is not None:

        def close_from_another_thread() -> None:
            stop.wait(close_after_s)
            ledger.closed.set()
            asyncio.run(store.close())

        closer = threading.Thread(target=close_from_another_thread, name="stress-closer", daemon=True)
    for thread in threads:
        thread.start()
    if closer is not None:
        closer.start()
    local = asyncio.create_task(_load(store, ns, f"main{seed}", ledger, stop, seed))
    await anyio.sleep(STRESS_S)
    stop.set()
    with anyio.fail_after(JOIN_S):
        await local
    for thread in [*threads, *([closer] if closer else [])]:
        await anyio.to_thread.run_sync(thread.join, JOIN_S)
        assert not thread.is_alive(), f"{thread.name} hung"


async def _verify(store: StateStore, ns: str, ledger: Ledger) -> None:
    stored = {kv.key: kv.value for kv in await store.range(ns + "d/")}
    lost = {k for k, v in ledger.acked.items() if stored.get(k) != v}
    assert not lost, f"{len(lost)} acknowledged writes are missing, e.g. {sorted(lost)[:3]}"
    counter = await store.get(ns + "counter")
    count = 0 if counter is None else int(counter.value)
    assert ledger.cas_acked <= count <= ledger.cas_acked + ledger.cas_unknown, (
        f"counter {count}: {ledger.cas_acked} acknowledged increments, {ledger.cas_unknown} unknown")


async def test_concurrent_loops_threads_cancellations_and_a_close_lose_nothing(backend: Backend) -> None:
    store, ns = backend.store, backend.ns
    ledger = Ledger()
    await _burst(store, ns, ledger, 1, close_after_s=None)
    assert not ledger.errors, ledger.errors[:5]
    await _verify(store, ns, ledger)
    assert ledger.cancelled > 0 and ledger.acked and ledger.cas_acked > 0  # the load really ran and was cut

    await _burst(store, ns, ledger, 2, close_after_s=random.uniform(0.2, 0.8) * STRESS_S)
    assert not ledger.errors, ledger.errors[:5]
    with pytest.raises(StoreError, match="closed"):
        await store.put(ns + "after", b"x")
    with pytest.raises(StoreError, match="closed"):
        await anext(aiter(store.watch(ns)))
    await store.close()  # closing again is harmless
    if backend.name != "memory":  # a memory store is gone once closed; the others are reopened and checked
        await _verify(await backend.open_another(), ns, ledger)
