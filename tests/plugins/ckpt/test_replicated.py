"""Commit means replicated: the master's rule for R (replicated everywhere) and X (being copied), the slots a save
keeps, and a holder keeping R's copy while a newer one arrives. Pure tables first, then one holder over loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from hypothesis import given
from hypothesis import strategies as st

from stead.core.config import Settings
from stead.core.events import Event, Record
from stead.core.plugins import PluginContext
from stead.core.statemachine import JobState
from stead.core.store import StateStore, open_store
from stead.plugins.ckpt import proto
from stead.plugins.ckpt._book import Holding
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt._layout import SlotLayout
from stead.plugins.ckpt._replicas import ReplicaError, ReplicaMeta, ReplicaServer, fetch, push
from stead.plugins.ckpt._replicated import NONE, Replication, advance, replicated_everywhere
from stead.plugins.ckpt._shm import SegmentNames, SlotInfo, SlotState, VerifyState
from stead.plugins.ckpt.events import CheckpointReplicated, CheckpointRestored
from stead.plugins.ckpt.plugin import CheckpointPlugin, CheckpointServicer
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.worker import kept_steps, target_slot

WAIT_S = 30.0


def _advance(rep: Replication, committed: tuple[int, int], holders: dict[int, set[tuple[int, int, int]]], *,
             now: float = 0.0, world: int = 2, round_: int | None = None, placed: bool = True) -> Replication:
    return advance(rep, committed=committed, world=world, round_=committed[1] if round_ is None else round_,
                   placed=placed, holders=holders, now=now, wait_s=WAIT_S)


def test_the_first_commit_is_copied_kept_from_the_start_and_replicated_once_every_rank_s_copy_is_held() -> None:
    rep = _advance(Replication(), (1, 1), {})
    assert (rep.replicating, rep.replicated, rep.keep, rep.world) == ((1, 1), NONE, True, 2)
    half = _advance(rep, (1, 1), {0: {(1, 1, 2)}})
    assert half.replicated == NONE  # rank 1's copy is not anywhere yet
    rep = _advance(half, (1, 1), {0: {(1, 1, 2)}, 1: {(1, 1, 2), (0, 1, 2)}})
    assert (rep.replicated, rep.keep) == ((1, 1), True)


def test_a_round_whose_nodes_have_no_replicas_placed_never_keeps_slots_for_them() -> None:
    """One host (or ckpt.replicas=0): no copy can be made, and the workers must not wait for one."""
    rep = _advance(Replication(), (1, 1), {}, placed=False)
    assert (rep.replicating, rep.keep, rep.waiting) == (NONE, False, False)  # (the agents poll for nothing)
    assert _advance(rep, (2, 1), {}, now=WAIT_S * 2, placed=False) == rep
    placed = _advance(rep, (2, 1), {}, now=WAIT_S * 2)  # the nodes' replicas placed (their first reports came)
    assert (placed.replicating, placed.keep) == ((2, 1), True)


@pytest.mark.parametrize(("holders", "why"), [
    ({0: {(5, 1, 2)}, 1: {(5, 2, 2)}}, "rank 1's copy is of another round's step 5"),
    ({0: {(5, 1, 2)}, 1: {(5, 1, 3)}}, "rank 1's copy was saved by a world of 3"),
    ({0: {(5, 1, 2)}, 1: {(4, 1, 2)}}, "rank 1's copy is an older step"),
    ({0: {(5, 1, 2)}}, "rank 1 has no copy"),
])
def test_a_step_is_replicated_only_when_every_rank_of_its_world_has_a_copy_of_it(
        holders: dict[int, set[tuple[int, int, int]]], why: str) -> None:
    assert not replicated_everywhere((5, 1), 2, holders), why
    assert replicated_everywhere((5, 1), 2, {0: {(5, 1, 2)}, 1: {(5, 1, 2), (4, 1, 2)}})


def test_while_x_is_on_its_way_newer_commits_wait_and_x_moves_once_it_is_replicated() -> None:
    rep = Replication(replicated=(4, 1), replicating=(5, 1), world=2, since=0.0, placed=True)
    assert _advance(rep, (6, 1), {0: {(4, 1, 2)}, 1: {(4, 1, 2)}}, now=1.0) == rep  # X stays 5
    done = _advance(rep, (6, 1), {0: {(5, 1, 2)}, 1: {(5, 1, 2)}}, now=2.0)
    assert (done.replicated, done.replicating, done.since, done.keep) == ((5, 1), (6, 1), 2.0, True)
    # X replicated and no newer commit: nothing is being copied, R's slot is the only one kept
    idle = _advance(rep, (5, 1), {0: {(5, 1, 2)}, 1: {(5, 1, 2)}}, now=2.0)
    assert (idle.replicated, idle.replicating, idle.waiting) == ((5, 1), (5, 1), False)


def test_x_waiting_in_vain_stops_the_keeping_and_the_next_step_replicated_starts_it_again() -> None:
    rep = Replication(replicated=(4, 1), replicating=(5, 1), world=2, since=0.0, placed=True)
    late = _advance(rep, (5, 1), {}, now=WAIT_S + 1)
    assert (late.keep, late.late, late.replicating) == (False, True, (5, 1))  # the workers save on
    retarget = _advance(late, (9, 1), {}, now=WAIT_S + 2)
    assert (retarget.replicating, retarget.since, retarget.keep) == ((9, 1), WAIT_S + 2, False)
    again = _advance(retarget, (11, 1), {0: {(9, 1, 2)}, 1: {(9, 1, 2)}}, now=WAIT_S + 3)
    assert (again.replicated, again.replicating, again.keep) == ((9, 1), (11, 1), True)


def test_a_new_round_s_first_commit_replaces_an_x_of_the_round_that_ended_however_long_the_restart_took() -> None:
    rep = Replication(replicated=(4, 1), replicating=(5, 1), world=2, since=0.0, placed=True)
    restarting = _advance(rep, (5, 1), {}, now=WAIT_S * 10, round_=2)  # round 2 reported, nothing committed in it
    assert restarting == rep  # no stale X while the round it belongs to is over: the keeping goes on
    new = _advance(rep, (7, 2), {}, now=WAIT_S * 10, world=3, round_=2)
    assert (new.replicating, new.world, new.replicated, new.keep) == ((7, 2), 3, (4, 1), True)


@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.floats(0, 100)), max_size=30))
def test_r_never_goes_back_and_is_always_a_step_that_was_x(moves: list[tuple[int, bool, float]]) -> None:
    rep, step, now, xs = Replication(), 0, 0.0, {NONE}
    for more, copied, later in moves:
        step, now = step + more, now + later
        holders = {r: {(*rep.replicating, rep.world)} for r in range(2)} if copied else {}
        after = _advance(rep, (step, 1), holders, now=now)
        assert (after.replicated[1], after.replicated[0]) >= (rep.replicated[1], rep.replicated[0])
        assert after.replicated in xs
        xs.add(after.replicating)
        rep = after


# -- the slots a save keeps -------------------------------------------------------------------------------------


def _slots(*held: tuple[int, int]) -> list[SlotInfo]:
    """Slots holding these (step, round) pairs ((-1, -1): empty)."""
    return [SlotInfo(i, 2 if step >= 0 else 0, SlotState.COMPLETE if step >= 0 else SlotState.EMPTY, step, round_,
                     0, 2, 0, 0, 0, 0, 0, 0, 1, 1 << 20, 0, 0, VerifyState.NONE)
            for i, (step, round_) in enumerate(held)]


R1_3, R1_4, R1_7, R1_8, R2_9 = (3, 1), (4, 1), (7, 1), (8, 1), (9, 2)


@pytest.mark.parametrize(("round_", "slots", "committed", "restored", "pinned", "replication", "target", "why"), [
    (1, (R1_3, R1_4), R1_4, None, NONE, (NONE, NONE), 0, "the older slot; the newest commit's stays"),
    (1, (R1_3, R1_4), R1_4, None, R1_3, (NONE, NONE), None, "a persist reads step 3: skipped"),
    (1, (R1_3, R1_4), R1_4, None, NONE, (R1_3, R1_4), None, "R and X (the newest commit) kept: skipped"),
    (1, (R1_3, R1_4), R1_4, None, NONE, (R1_4, R1_4), 0, "X replicated: R is the newest commit, the other is free"),
    (1, (R1_3, R1_4), R1_3, None, NONE, (R1_4, R1_4), None, "R (4) kept even before its commit reached the worker"),
    (1, (R1_3, NONE), R1_3, None, NONE, (R1_3, R1_3), 1, "an empty slot first"),
    (2, (R1_7, R1_8), NONE, R1_8, NONE, (R1_7, R1_8), 0,
     "round 2 before its first commit: the restored step kept; round 1's R and X are not this round's"),
    (2, (R2_9, R1_8), R2_9, R1_8, NONE, (R1_7, R2_9), None,
     "round 2's first commit on its way: the restored step stays until a step of round 2 is replicated"),
    (2, (R2_9, R1_8), R2_9, R1_8, NONE, (R2_9, R2_9), 1, "round 2's first commit replicated: the restored step goes"),
    (2, (R2_9, R1_8), R2_9, R1_8, NONE, (NONE, NONE), 1,
     "not keeping for replicas: the restored step stays only until a commit of this round"),
])
def test_a_save_writes_a_slot_that_holds_no_step_it_must_keep(
        round_: int, slots: tuple[tuple[int, int], tuple[int, int]], committed: tuple[int, int],
        restored: tuple[int, int] | None, pinned: tuple[int, int],
        replication: tuple[tuple[int, int], tuple[int, int]], target: int | None, why: str) -> None:
    kept = kept_steps(round_=round_, committed=committed, restored=restored, pinned=pinned, replication=replication)
    assert target_slot(_slots(*slots), kept) == target, why


# -- a holder keeps R's copy while a newer one arrives -------------------------------------------------------


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[ReplicaServer]:
    names = SegmentNames(prefix=f"stead-ckpt-test-{tmp_path.name[-12:]}-", incarnation=1)
    server = ReplicaServer(names=names, token="t" * 43, job="j", tls=None, max_bytes=0, timeout_s=5.0,
                           changed=lambda: None)
    server.start("127.0.0.1")
    try:
        yield server
    finally:
        server.close()
    assert not names.all_mine()  # every buffer freed


def _replica(step: int, fill: int) -> tuple[ReplicaMeta, bytes]:
    """A replica of rank 1's ``step`` with no tensors (what the holder checks of it: its layout document)."""
    layout = SlotLayout(offsets=(), nbytes=(), data_bytes=0, checks_off=0, layout_off=0, tensors_json="[]")
    document = layout.document(tree={"fill": fill}, step=step, round_=1, rank=1, world=2)
    meta = ReplicaMeta(rank=1, world=2, step=step, round=1, data_bytes=0, n_tensors=0, checks_off=0, layout_off=0,
                       layout_len=len(document), layout_sum=checksum(document))
    return meta, document


def _put(server: ReplicaServer, step: int) -> None:
    meta, body = _replica(step, fill=step)
    push(server.address, token="t" * 43, job="j", tls=None, meta=meta, source=memoryview(body), intact=lambda: True,
         timeout_s=5.0)


def _get(server: ReplicaServer, step: int) -> int:
    got = bytearray(1 << 16)
    meta = fetch(server.address, token="t" * 43, job="j", tls=None, rank=1, step=step, round_=1,
                 into=lambda _meta: memoryview(got), timeout_s=5.0)
    return meta.step


def test_a_holder_keeps_the_replicated_step_s_copy_while_newer_ones_arrive_and_serves_both(
        holder: ReplicaServer) -> None:
    _put(holder, 3)
    holder.keep((3, 1))
    for newer in (4, 5):  # a newer copy arrives, and another (X moved after a late one): R's stays
        _put(holder, newer)
        assert sorted(m.step for m, _ in holder.holdings()) == [3, newer]
        assert (_get(holder, 3), _get(holder, newer)) == (3, newer)
    assert len(holder.names.all_mine()) == 3  # R's, the newest, and the spare the next one goes into
    holder.keep((5, 1))  # step 5 replicated everywhere: step 3's copy is let go (its buffer is the spare)
    assert [m.step for m, _ in holder.holdings()] == [5]
    assert len(holder.names.all_mine()) == 2
    with pytest.raises(ReplicaError, match="holds step 5"):
        _get(holder, 3)


def test_without_a_step_to_keep_a_holder_keeps_the_newest_copy_only(holder: ReplicaServer) -> None:
    for step in (1, 2, 3):
        _put(holder, step)
    assert [m.step for m, _ in holder.holdings()] == [3]
    assert len(holder.names.all_mine()) == 2  # double-buffered, as before


# -- the master: R from the holders' reports, kept across a restart, said in the restore's record ----------------


async def _plugin(store: StateStore, events: list[Event],
                  settings: CheckpointSettings | None = None) -> CheckpointPlugin:
    async def emit(event: Event) -> Record:
        events.append(event)
        return Record(seq=len(events), at=0.0, event=event)

    settings = settings or CheckpointSettings()
    plugin = CheckpointPlugin(settings=settings)
    await plugin.start(ctx=PluginContext(plugin="ckpt", job="j", settings=settings,
                                         stead_settings=Settings(), store=store, state=JobState, emit=emit,
                                         add_rpc_handler=lambda _handler: None))
    return plugin


def _report(plugin: CheckpointPlugin, node: str, host: str, rank: int,
            held: dict[int, tuple[tuple[int, int, int], ...]]) -> None:
    plugin.replica_report(node_id=node, incarnation=1, round_=1, host=host, address=f"10.0.0.{rank + 1}:5000",
                          ranks=[rank], held=held)


@pytest.mark.anyio
async def test_the_master_moves_r_from_the_holders_reports_keeps_it_across_a_restart_and_says_it_at_a_restore(
        ) -> None:
    store = await open_store("memory://")
    events: list[Event] = []
    plugin = await _plugin(store, events)
    await plugin.memory_report(round_=1, world_size=2, ranks={0: Holding(passed=5, steps=frozenset({5}))})
    _report(plugin, "node-0", "a", 0, {})
    _report(plugin, "node-1", "b", 1, {})  # the replicas are placed: each node's on the other host
    await plugin.memory_report(round_=1, world_size=2, ranks={1: Holding(passed=5, steps=frozenset({5}))})
    assert plugin.replication.replicating == (5, 1) and plugin.replication.replicated == NONE
    assert plugin.replication.keep
    _report(plugin, "node-0", "a", 0, {1: ((5, 1, 2),)})
    await plugin.advance_replication()
    assert plugin.replication.replicated == NONE  # rank 0's copy is not in place yet
    _report(plugin, "node-1", "b", 1, {0: ((5, 1, 2),), 1: ((4, 1, 2),)})  # (and a copy of its own rank: a stray)
    await plugin.advance_replication()
    assert (plugin.replication.replicated, plugin.replication.keep) == ((5, 1), True)
    assert [(e.step, e.round) for e in events if isinstance(e, CheckpointReplicated)] == [(5, 1)]
    # step 4 was never committed: its replica is never handed out for a restore
    assert [(s[0], s[2], s[3]) for s in plugin.replica_sources("node-2", [0, 1])] == [
        ("node-1", 0, 5), ("node-0", 1, 5)]
    await plugin.publish_replicas(0.0)
    assert plugin._status[0].startswith("replicated: step 5 (every rank's copy in another host's memory")

    restarted = await _plugin(store, events)
    assert (restarted.replication.replicated, restarted.replication.late) == ((5, 1), False)
    for rank, tier in ((0, "memory"), (1, "peer")):
        await restarted.restored(round_=2, world_size=2, rank=rank, step=5, tier=tier)
    [restored] = [e for e in events if isinstance(e, CheckpointRestored)]
    assert (restored.step, restored.replicated_step, restored.committed_step, restored.peer_ranks) == (5, 5, 5, 1)
    await store.close()


@pytest.mark.anyio
async def test_a_node_saying_it_holds_more_copies_of_a_rank_than_r_s_and_the_newest_is_refused_saying_why() -> None:
    store = await open_store("memory://")
    servicer = CheckpointServicer(await _plugin(store, []))
    copies = [proto.ReplicaHeld(rank=1, step=step, round=1, world=2) for step in (1, 2, 3)]
    message = proto.ReportSavedRequest(node_id="node-0", incarnation=1, round=1, world_size=2, tier="memory",
                                       ranks=[proto.RankSaved(rank=0, step=3, held_steps=[3])], host="a",
                                       replicas=copies)
    with pytest.raises(GRPCError, match="3 replicas of rank 1; a node holds 2 at most") as caught:
        await servicer.report_saved(message)
    assert caught.value.status == Status.INVALID_ARGUMENT
    await store.close()


@pytest.mark.anyio
async def test_an_agent_s_long_poll_returns_when_the_replicated_step_moves() -> None:
    """The workers wait for it (both slots kept): their agent hears of it at once, not at the poll's end."""
    store = await open_store("memory://")
    plugin = await _plugin(store, [], CheckpointSettings(commit_poll_s=3600.0))  # no answer but the one awaited
    _report(plugin, "node-0", "a", 0, {})
    _report(plugin, "node-1", "b", 1, {})
    await plugin.memory_report(round_=1, world_size=2,
                               ranks={r: Holding(passed=5, steps=frozenset({5})) for r in (0, 1)})
    known = (plugin.replication.replicated, plugin.replication.keep)
    got: list[tuple[int, int]] = []

    async def poll() -> None:
        await plugin.committed(round_=1, after_step=5, wait_s=3600, ranks=[], replicated=known)
        got.append(plugin.replication.replicated)

    with anyio.fail_after(60):  # (a bound on a hang: the poll would otherwise wait an hour)
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll)
            await anyio.sleep(0.05)
            assert got == []
            _report(plugin, "node-0", "a", 0, {1: ((5, 1, 2),)})
            _report(plugin, "node-1", "b", 1, {0: ((5, 1, 2),)})
            await plugin.advance_replication()
    assert got == [(5, 1)]
    await store.close()
