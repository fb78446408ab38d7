"""The effect journal: claims batched in writes, each effect made once across masters, what a dead master left
running made again, failures returned as events."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest
import structlog.testing

from stead.core.config import Settings
from stead.core.errors import EffectDeclined, LogConflict, PlatformRejected
from stead.core.events import EffectFailed, JobSubmitted, LaunchId, NodeRequested, StepProgress
from stead.core.events.log import EventLog
from stead.core.master.journal import CLAIMS_PER_WRITE, EffectJournal
from stead.core.master.reactor import Reactor
from stead.core.statemachine import Effect, Emit, LaunchNode, StartWorkers
from stead.core.store import StateStore, open_store
from stead.testing import FakeClock

pytestmark = pytest.mark.anyio


def _job() -> str:
    """A job of its own: the suite's etcd is shared by every test."""
    return f"t-{uuid.uuid4().hex[:8]}"


def _launches(count: int) -> list[Effect]:
    return [LaunchNode(node_id=f"node-{i}", incarnation=1) for i in range(count)]


class _Executor:
    """Records what it runs and the claim each effect had in the store at that moment; ``hold`` keeps every run
    waiting until it is set; ``fail`` is raised by every run."""

    def __init__(self, log: EventLog, *, fail: Exception | None = None,
                 hold: asyncio.Event | None = None) -> None:
        self.log, self.fail, self.hold = log, fail, hold
        self.ran: list[str] = []
        self.claims: list[bytes | None] = []
        self.entered = asyncio.Event()

    async def run(self, effect: Effect) -> None:
        self.ran.append(effect.id)
        claim = await self.log.store.get(f"/stead/jobs/{self.log.job}/effects/{effect.id}")
        self.claims.append(None if claim is None else claim.value)
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.fail is not None:
            raise self.fail


def _journal(store: StateStore, job: str, *, clock: FakeClock | None = None, settings: Settings | None = None,
             fail: Exception | None = None, hold: asyncio.Event | None = None) -> tuple[EffectJournal, _Executor]:
    """A master's journal on ``store`` (a log of its own, as a new master opens) and the executor it runs with."""
    log = EventLog(store, job)
    executor = _Executor(log, fail=fail, hold=hold)
    journal = EffectJournal(log, executor, settings=settings or Settings(), clock=clock or FakeClock())
    return journal, executor


async def _claims(store: StateStore, job: str) -> dict[str, bytes]:
    prefix = f"/stead/jobs/{job}/effects/"
    return {kv.key[len(prefix):]: kv.value for kv in await store.range(prefix)}


# -- claims: written before the effects run, batched ---------------------------------------------------------------


async def test_the_effects_of_one_record_are_claimed_before_they_run_in_one_write_per_claims_per_write(
        store: StateStore) -> None:
    job, count = _job(), CLAIMS_PER_WRITE + 36
    journal, executor = _journal(store, job)
    failures = await journal.run(_launches(count), resuming=False)
    prefix = f"/stead/jobs/{job}/effects/"
    stored = {kv.key: kv for kv in await store.range(prefix)}
    assert failures == [] and sorted(executor.ran) == sorted(e.id for e in _launches(count))
    assert executor.claims == [b"running"] * count  # each claimed before it ran
    assert {kv.value for kv in stored.values()} == {b"done"}
    created = [stored[journal.key(e)].create_revision for e in _launches(count)]
    marked = [stored[journal.key(e)].mod_revision for e in _launches(count)]
    assert len(set(created[:CLAIMS_PER_WRITE])) == 1 and len(set(created[CLAIMS_PER_WRITE:])) == 1  # two writes
    assert len(set(created)) == 2 and len(set(marked)) == 2  # and marked done in two more, not one per effect


async def test_an_emitted_event_and_its_effect_key_are_written_in_one_write_and_once(store: StateStore) -> None:
    job = _job()
    journal, _ = _journal(store, job)
    emit = Emit(key="progress/1", event=StepProgress(round=1, step=1))
    (record,) = await journal.emit(emit, resuming=False)
    again = await journal.emit(emit, resuming=False)  # the machine asked twice before the first was folded
    event_kv = await store.get(journal.log.key(record.seq))
    key_kv = await store.get(journal.key(emit))
    assert again == [] and await journal.log.read() == [record]
    assert event_kv is not None and key_kv is not None and event_kv.mod_revision == key_kv.mod_revision


# -- once across masters ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 3], ids=["one effect", "a record's many"])
async def test_an_effect_is_made_once_across_two_masters_on_the_same_store(store: StateStore, count: int) -> None:
    job, hold = _job(), asyncio.Event()
    first, first_ran = _journal(store, job, hold=hold)
    second, second_ran = _journal(store, job)
    running = asyncio.ensure_future(first.run(_launches(count), resuming=False))
    await first_ran.entered.wait()
    with structlog.testing.capture_logs() as logs:
        assert await second.run(_launches(count), resuming=False) == []  # while the first still runs them
        hold.set()
        assert await running == []
        assert await second.run(_launches(count), resuming=False) == []  # and once they are done
    assert sorted(first_ran.ran) == sorted(e.id for e in _launches(count)) and second_ran.ran == []
    assert sum(e["event"] == "effect_already_ran" for e in logs) == 2 * count
    assert set((await _claims(store, job)).values()) == {b"done"}


async def test_a_second_master_that_emits_what_the_first_emitted_is_fenced_by_a_log_conflict(
        store: StateStore) -> None:
    job = _job()
    first, _ = _journal(store, job)
    second, _ = _journal(store, job)
    emit = Emit(key="request/node-0/1", event=NodeRequested(node_id="node-0", incarnation=1))
    (record,) = await first.emit(emit, resuming=False)
    with pytest.raises(LogConflict, match=re.escape(f"{second.key(emit)} already exists); only one master may run")):
        await second.emit(emit, resuming=False)
    assert await EventLog(store, job).read() == [record]  # nothing of the second's was appended


async def test_two_reactors_on_one_store_launch_a_node_once_and_the_second_is_fenced_by_a_log_conflict() -> None:
    store, job = await open_store("memory://"), _job()
    spec = JobSubmitted(job=job, min_nodes=1, max_nodes=1, nproc_per_node=1)
    first_ran, second_ran = _Executor(EventLog(store, job)), _Executor(EventLog(store, job))
    try:
        async with Reactor(EventLog(store, job), first_ran, settings=Settings()) as first:
            await first.resume()
            with pytest.raises(ExceptionGroup) as stopped:
                async with Reactor(EventLog(store, job), second_ran, settings=Settings()) as second:
                    await second.resume()  # both replayed the empty log
                    await first.submit(spec)
                    await second.submit(spec)  # its machine asks for node-0 again: that emission's key exists
    finally:
        await store.close()
    assert stopped.group_contains(LogConflict, match=re.escape(
        f"/stead/jobs/{job}/effects/emit/request/node-0/1 already exists"))
    assert first_ran.ran == ["launch/node-0/1"] and second_ran.ran == []


# -- after a restart ---------------------------------------------------------------------------------------------------


async def test_an_effect_a_master_died_running_is_run_again_after_a_restart_and_a_finished_one_is_not(
        store: StateStore) -> None:
    job, effect = _job(), LaunchNode(node_id="node-0", incarnation=1)
    dying, dying_ran = _journal(store, job, hold=asyncio.Event())  # never let go: the master dies meanwhile
    running = asyncio.ensure_future(dying.run([effect], resuming=False))
    await dying_ran.entered.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert await _claims(store, job) == {effect.id: b"running"}
    not_resuming, not_resuming_ran = _journal(store, job)
    assert await not_resuming.run([effect], resuming=False) == []  # only a resumed master runs it again
    with structlog.testing.capture_logs() as logs:
        resumed, resumed_ran = _journal(store, job)
        assert await resumed.run([effect], resuming=True) == []
    again, again_ran = _journal(store, job)
    assert await again.run([effect], resuming=True) == []
    assert not_resuming_ran.ran == [] and resumed_ran.ran == [effect.id] and again_ran.ran == []
    assert [e["event"] for e in logs] == ["effect_rerun"]
    assert await _claims(store, job) == {effect.id: b"done"}


async def test_an_emission_a_previous_master_made_is_not_made_again_by_a_resumed_one(store: StateStore) -> None:
    job = _job()
    emit = Emit(key="request/node-0/1", event=NodeRequested(node_id="node-0", incarnation=1))
    first, _ = _journal(store, job)
    made = await first.emit(emit, resuming=False)
    resumed, _ = _journal(store, job)
    assert await resumed.emit(emit, resuming=True) == []
    assert await EventLog(store, job).read() == made


# -- failures ---------------------------------------------------------------------------------------------------------


async def test_an_effect_that_outlasts_its_timeout_on_the_fake_clock_fails_and_is_not_run_again() -> None:
    store, job, clock = await open_store("memory://"), _job(), FakeClock()
    effect = StartWorkers(node_id="node-1", incarnation=2, round=3, node_rank=1, nnodes=2, nproc_per_node=1,
                          restart_count=0)
    try:
        journal, _ = _journal(store, job, clock=clock, settings=Settings(effect_timeout_s=60),
                              hold=asyncio.Event())
        running = asyncio.ensure_future(journal.run([effect], resuming=False))
        await clock.advance(59.9)
        assert not running.done()
        await clock.advance(0.1)
        (failed,) = await running
        resumed, resumed_ran = _journal(store, job)
        assert await resumed.run([effect], resuming=True) == []
        claims = await _claims(store, job)
    finally:
        await store.close()
    assert failed == EffectFailed(effect_id=effect.ref, kind="start-workers", error=(
        "did not finish within effect_timeout_s=60 s"), node_id="node-1", incarnation=2, round=3)
    assert claims == {effect.id: b"failed"} and resumed_ran.ran == []


async def test_a_refused_launch_fails_for_good_and_a_declined_one_leaves_no_claim() -> None:
    store, job = await open_store("memory://"), _job()
    refused, declined = LaunchNode(node_id="node-0", incarnation=1), LaunchNode(node_id="node-1", incarnation=1)
    try:
        refusing, _ = _journal(store, job, fail=PlatformRejected("the pod spec asks for 3 GPUs of a 2-GPU node"))
        (failed,) = await refusing.run([refused], resuming=False)
        declining, _ = _journal(store, job, fail=EffectDeclined("no platform launches nodes here"))
        assert await declining.run([declined], resuming=False) == []
        claims = await _claims(store, job)
        able, able_ran = _journal(store, job)
        await able.run([declined], resuming=False)
    finally:
        await store.close()
    assert failed.effect_id == LaunchId(node_id="node-0", incarnation=1) and failed.permanent
    assert failed.error == "PlatformRejected: the pod spec asks for 3 GPUs of a 2-GPU node"
    assert claims == {refused.id: b"failed"} and able_ran.ran == [declined.id]
