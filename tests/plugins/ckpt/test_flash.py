"""Flash checkpoints through a real agent extension and the master plugin behind a real RPC server."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _polling import wait_until

from stead.core.events import CheckpointCommitted
from stead.plugins.ckpt import SHM_DIR, _disk, segment_names
from stead.plugins.ckpt._mapped import MappedSlot
from stead.plugins.ckpt._recover import Restore
from stead.plugins.ckpt.errors import SharedMemoryTooSmall, StateMismatch, UnsupportedState
from stead.plugins.ckpt.events import CheckpointCorrupt, CheckpointPersisted, CheckpointRestored
from stead.plugins.ckpt.worker import FlashCheckpointer

from .conftest import Cluster


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, **extra: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), **extra}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def restart(cluster: Cluster, round_: int, **worker: Any) -> FlashCheckpointer:
    cluster.failure(round_=round_ - 1)
    cluster.round(round_, restart_count=round_ - 1)
    return cluster.worker(round_=round_, **worker)


def test_a_restarted_worker_restores_the_last_save_from_memory_without_reading_disk(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster.agent()
    cluster.round(1)
    model, opt = trained()
    with cluster.worker() as ckpt:
        assert ckpt.mode == "agent"
        for step in range(1, 4):
            assert ckpt.save(step, state_of(model, opt, epoch=step, note=("a", 1)))
    expected = state_of(model, opt, epoch=3, note=("a", 1))

    def no_disk(*args: object, **kwargs: object) -> None:
        raise AssertionError("the restore read the disk")

    # the worker's reads only: the agent in this process goes on persisting (and completing) the failed round's step
    monkeypatch.setattr(Restore, "from_tiers", no_disk)
    monkeypatch.setattr(_disk, "candidates", no_disk)
    fresh, fresh_opt = trained(seed=1)
    with restart(cluster, 2) as ckpt:
        template = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        pointer = fresh[0].weight.data_ptr()
        restored = ckpt.load(template)
    assert restored is not None
    step, state = restored
    assert step == 3
    assert_same(state, expected)
    assert fresh[0].weight.data_ptr() == pointer and torch.equal(fresh[0].weight, model[0].weight)  # in place
    fresh_opt.load_state_dict(state["optim"])
    cluster.settle()
    assert any(isinstance(e, CheckpointRestored) and e.step == 3 and e.memory_ranks == 1 for e in cluster.events)


def test_a_step_is_committed_only_once_every_rank_holds_it(cluster: Cluster) -> None:
    cluster.agent(nproc=2)
    cluster.round(1, world=2, nproc=2)
    state = {"w": torch.arange(6.0)}
    with cluster.worker(rank=0, world=2) as rank0, cluster.worker(rank=1, world=2) as rank1:
        assert rank0.save(1, state)
        cluster.settle()
        assert "checkpoint.committed" not in cluster.event_types()
        assert rank1.save(1, state)
        assert rank0._ctl.committed == (-1, -1) or rank0._ctl.committed[0] in (-1, 1)
        assert rank0.save(2, state)  # waits until step 1 is committed, then writes the other slot
        assert rank0._ctl.committed == (1, 1)
    commits = [e for e in cluster.events if isinstance(e, CheckpointCommitted)]
    assert [c.step for c in commits] == [1]
    assert commits[0].save_s is not None and commits[0].save_s > 0  # the slower rank's copy, as its worker timed it


def test_a_worker_dying_mid_copy_leaves_the_committed_step_intact(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        assert ckpt.save(1, {"a": torch.full((1000,), 1.0), "b": torch.full((1000,), 1.0)})
        assert ckpt.save(2, {"a": torch.full((1000,), 2.0), "b": torch.full((1000,), 2.0)})
        copies = 0
        original = MappedSlot.copy_in

        def dies_after_one(self: MappedSlot, *args: Any, **kwargs: Any) -> None:
            nonlocal copies
            copies += 1
            if copies == 2:
                raise KeyboardInterrupt("the worker dies here")
            original(self, *args, **kwargs)

        monkeypatch.setattr(MappedSlot, "copy_in", dies_after_one)
        with pytest.raises(KeyboardInterrupt):  # the slot of step 1 is half overwritten with step 3
            ckpt.save(3, {"a": torch.full((1000,), 3.0), "b": torch.full((1000,), 3.0)})
        monkeypatch.setattr(MappedSlot, "copy_in", original)
    with restart(cluster, 2) as ckpt:
        restored = ckpt.load()
    assert restored is not None and restored[0] == 2
    assert torch.equal(restored[1]["a"], torch.full((1000,), 2.0)) and torch.equal(restored[1]["b"], restored[1]["a"])


def test_a_state_dict_that_grows_or_changes_shape_is_laid_out_again(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        assert ckpt.save(1, {"w": torch.ones(4)})
        bigger = {"w": torch.arange(3 << 20, dtype=torch.float32), "extra": {"b": torch.ones(2, 2)}, "k": [1]}
        assert ckpt.save(2, bigger)  # needs a larger segment than the first save's
        assert ckpt.save(3, {"w": torch.ones(2, 3, dtype=torch.bfloat16)})
        assert ckpt.save(4, bigger)
    with restart(cluster, 2) as ckpt:
        restored = ckpt.load()
    assert restored is not None and restored[0] == 4
    assert_same(restored[1], bigger)


def test_load_into_a_state_dict_of_another_shape_is_refused_clearly(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        assert ckpt.save(1, {"w": torch.ones(4)})
    with restart(cluster, 2) as ckpt, pytest.raises(StateMismatch, match=r"float32\[4\].*float32\[5\]"):
        ckpt.load({"w": torch.zeros(5)})


def test_a_value_that_needs_pickle_is_refused_before_anything_is_written(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt, pytest.raises(UnsupportedState, match="cannot store without pickle"):
        ckpt.save(1, {"scheduler": object()})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_persisted_steps_load_with_plain_torch_distributed_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    cluster.agent()
    cluster.round(1)
    model, opt = trained()
    state = state_of(model, opt, epoch=7, tags=["x", "y"])
    with cluster.worker() as ckpt:
        assert ckpt.save(5, state, persist=True)
        assert ckpt.wait_persisted(timeout=30) == 5
    folder = tmp_path / "ckpt" / cluster.job / "step_5"
    assert (folder / ".metadata").is_file() and _disk.read_tracker(folder.parent) == 5
    fresh, fresh_opt = trained(seed=3)
    target = state_of(fresh, fresh_opt, epoch=0, tags=["", ""])
    dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    assert torch.equal(target["model"]["0.weight"], model[0].weight)
    assert torch.equal(target["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert target["epoch"] == 7 and target["tags"] == ["x", "y"]
    cluster.settle()
    persisted = [e for e in cluster.events if isinstance(e, CheckpointPersisted) and e.step == 5]
    assert persisted and persisted[0].persist_s is not None and persisted[0].persist_s > 0


def test_a_worker_failure_persists_the_committed_step(cluster: Cluster, tmp_path: Path) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        assert ckpt.save(1, {"w": torch.ones(3)})
        assert ckpt.save(2, {"w": torch.full((3,), 2.0)})
    root = tmp_path / "ckpt" / cluster.job
    assert not root.exists()
    cluster.failure()
    cluster.settle()
    with restart(cluster, 2) as ckpt:  # the persist runs while the new worker restores from memory
        assert ckpt.load() is not None
    for _ in range(100):
        if _disk.is_complete(root, 2):
            break
        cluster.settle()
    assert _disk.is_complete(root, 2)


def test_a_corrupt_memory_slot_falls_back_to_disk_with_a_warning_event(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        assert ckpt.save(1, {"w": torch.arange(100.0)}, persist=True)
        assert ckpt.wait_persisted(timeout=30) == 1
        _wait_checksummed(ckpt)
        slot = next(s for s in ckpt._ctl.slots() if s.holds(1, 1))
        ckpt._slots[slot.index].mm[8] ^= 0xFF  # one flipped bit pattern in a float of the committed slot
    with restart(cluster, 2) as ckpt:
        restored = ckpt.load()
    assert restored is not None and restored[0] == 1
    assert torch.equal(restored[1]["w"], torch.arange(100.0))  # from disk
    cluster.settle()
    corrupt = [e for e in cluster.events if isinstance(e, CheckpointCorrupt)]
    assert corrupt and corrupt[0].tier == "memory" and corrupt[0].step == 1
    assert any(isinstance(e, CheckpointRestored) and e.disk_ranks == 1 for e in cluster.events)


def _wait_checksummed(ckpt: FlashCheckpointer) -> None:
    wait_until(lambda: all(s.checks_seq == s.seq for s in ckpt._ctl.slots() if s.complete),
               "the agent checksummed every complete slot")


@pytest.fixture
def short_grace(tmp_path: Path, settings: Any) -> Iterator[Cluster]:
    """A cluster whose agents wait 1 s, not 30, for a lost node's step to reach the disk (it never will)."""
    import dataclasses

    from stead.core.config import Settings

    with Cluster(tmp_path, dataclasses.replace(settings, persist_grace_s=1.0), job="ckpt-test",
                 stead_settings=Settings(retry_deadline_s=5.0)) as running:
        yield running


def test_after_a_node_loss_the_new_agent_restores_from_disk_and_skips_a_corrupt_step(
        short_grace: Cluster, tmp_path: Path) -> None:
    cluster = short_grace
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, {"w": torch.full((64,), float(step))}, persist=step < 3)
            if step < 3:
                assert ckpt.wait_persisted(timeout=30) == step
    cluster.kill_agent()
    names = segment_names(cluster.job, "node-0", 1, cluster.settings.shm_namespace)
    assert names.all_mine()  # the killed agent's segments are still there...
    cluster.agent(incarnation=2)
    assert not names.all_mine()  # ...until the relaunched agent removes them
    root = tmp_path / "ckpt" / cluster.job
    data = root / "step_2" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    offset = json.loads((root / "step_2" / "rank_0.json").read_bytes())["tensors"][0]["file_offset"]
    raw[offset] ^= 0x01
    data.write_bytes(bytes(raw))
    cluster.round(2, restart_count=0)
    with cluster.worker(round_=2) as ckpt:
        restored = ckpt.load()
    assert restored is not None and restored[0] == 1  # step 3 was only in the lost memory, step 2 is corrupt
    assert torch.equal(restored[1]["w"], torch.full((64,), 1.0))
    cluster.settle()
    assert any(isinstance(e, CheckpointCorrupt) and e.tier == "disk" and e.step == 2 for e in cluster.events)


def test_a_stopping_agent_writes_the_newest_committed_step_to_disk_first(cluster: Cluster, tmp_path: Path) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, {"w": torch.full((8,), float(step))})  # memory only
        assert ckpt.save(4, {"w": torch.full((8,), 4.0)})
    root = tmp_path / "ckpt" / cluster.job
    assert not list(root.glob("step_*"))
    cluster.stop_agent()  # the job was stopped (Ctrl-C, SIGTERM, preemption)
    assert _disk.read_tracker(root) == 4  # reported at the stop, committed, written
    cluster.agent(incarnation=2)
    cluster.round(2)
    with cluster.worker(round_=2) as ckpt:
        restored = ckpt.load()
    assert restored is not None and restored[0] == _disk.read_tracker(root)
    assert torch.equal(restored[1]["w"], torch.full((8,), float(restored[0])))


def test_only_the_newest_persisted_steps_are_kept(cluster: Cluster, tmp_path: Path) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        for step in range(1, 5):
            assert ckpt.save(step, {"w": torch.ones(2)}, persist=True)
            assert ckpt.wait_persisted(timeout=30) == step
    root = tmp_path / "ckpt" / cluster.job
    assert sorted(p.name for p in root.glob("step_*")) == ["step_3", "step_4"]
    assert _disk.read_tracker(root) == 4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("copy", [True, False])
def test_while_a_step_is_written_to_disk_the_next_saves_go_on_into_both_slots(
        copy: bool, tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ckpt.persist_copy the persist holds its slot for a memory copy, not for the disk write: the steps saved
    while it writes are all kept. Without, the slot stays pinned and a save that would need it is skipped."""
    import dataclasses
    import threading

    writing, finish = threading.Event(), threading.Event()
    write_rank = _disk.write_rank

    def slow_write(*args: Any, **kwargs: Any) -> None:
        writing.set()
        assert finish.wait(30), "the test never let the write finish"
        write_rank(*args, **kwargs)

    monkeypatch.setattr(_disk, "write_rank", slow_write)
    with Cluster(tmp_path / "c", dataclasses.replace(settings, persist_copy=copy), job="ckpt-copy") as cluster:
        cluster.agent()
        cluster.round(1)
        with cluster.worker() as ckpt:
            assert ckpt.save(1, {"w": torch.full((4,), 1.0)}, persist=True)
            assert writing.wait(30)
            saved = [ckpt.save(step, {"w": torch.full((4,), float(step))}) for step in (2, 3, 4)]
            finish.set()
            assert ckpt.wait_persisted(timeout=30) == 1
        assert saved == ([True, True, True] if copy else [True, False, False])
    loaded = {"w": torch.zeros(4)}  # what was written is step 1's bytes, not those of a step saved meanwhile
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt" / "ckpt-copy" / "step_1"), no_dist=True)
    assert torch.equal(loaded["w"], torch.full((4,), 1.0))


def test_too_small_dev_shm_is_a_clear_error_naming_the_size_and_the_fix(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker(size_hint=1 << 50) as ckpt, pytest.raises(SharedMemoryTooSmall) as caught:
        ckpt.save(1, {"w": torch.ones(2)})
    message = str(caught.value)
    assert "needs 2.02 PiB of /dev/shm" in message and "--shm-size=" in message and "emptyDir" in message


def test_a_size_hint_allocates_and_prefaults_both_slots_before_the_first_save(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    state = {"w": torch.ones(1 << 20)}
    with cluster.worker(size_hint=state) as ckpt:
        ckpt._wait_reserved()
        assert ckpt._reserving is not None
        ckpt._reserving.join()  # the pages are faulted in by then
        slots = ckpt._ctl.slots()
        assert all(s.capacity >= 4 << 20 for s in slots)
        assert ckpt.save(1, state)
        assert all(ckpt._mapped(s.index) is not None for s in slots)
        assert {s.gen for s in ckpt._ctl.slots()} == {s.gen for s in slots}  # no reallocation at save time


def test_agent_segments_are_named_stead_and_removed_when_the_agent_stops(cluster: Cluster) -> None:
    cluster.agent()
    cluster.round(1)
    with cluster.worker() as ckpt:
        assert ckpt.save(1, {"w": torch.ones(2)})
        mine = segment_names(cluster.job, "node-0", 1, cluster.settings.shm_namespace).all_mine()
        assert mine and all(n.startswith("stead") for n in mine)
        assert all((SHM_DIR / n).exists() for n in mine)
    cluster.stop_agent()
    assert not segment_names(cluster.job, "node-0", 1, cluster.settings.shm_namespace).all_mine()


def test_without_an_agent_only_persisted_saves_are_kept_on_disk(tmp_path: Path, settings: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEAD_CKPT_SOCKET", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a-random-uuid")  # torchrun --standalone's: not a key
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "plain.py")])  # named after the script
    monkeypatch.chdir(tmp_path)
    model, opt = trained()
    with FlashCheckpointer(settings=settings) as ckpt:
        assert ckpt.mode == "disk"
        assert ckpt.load() is None
        assert not ckpt.save(1, state_of(model, opt))
        assert ckpt.save(2, state_of(model, opt), persist=True)
        assert ckpt.wait_persisted() == 2
    with FlashCheckpointer(settings=settings) as ckpt:
        restored = ckpt.load()
    assert restored is not None and restored[0] == 2
    assert_same(restored[1], state_of(model, opt))
    assert os.path.isdir(Path(settings.dir) / "plain" / "step_2")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_nodes_commit_together_and_a_step_is_on_disk_once_every_rank_wrote_it(cluster: Cluster,
                                                                                 tmp_path: Path) -> None:
    for node, rank in (("node-0", 0), ("node-1", 1)):
        cluster.agent(node)
        cluster.round(1, node_id=node, world=2, node_rank=rank)
    rank0 = cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0)
    rank1 = cluster.worker(node_id="node-1", rank=1, world=2, local_rank=0)
    root = tmp_path / "ckpt" / cluster.job
    with rank0, rank1:
        assert rank0.save(1, {"w": torch.full((4,), 10.0)}, persist=True)
        cluster.settle()
        assert "checkpoint.committed" not in cluster.event_types() and not root.exists()  # rank 1 lacks step 1
        assert rank1.save(1, {"w": torch.full((4,), 11.0)}, persist=True)
        assert rank0.wait_persisted(timeout=30) == 1 and rank1.wait_persisted(timeout=30) == 1
    cluster.settle()
    assert _disk.is_complete(root, 1)
    assert [e.step for e in cluster.events if isinstance(e, CheckpointPersisted)] == [1]
    target = {"w": torch.zeros(4)}
    dcp.load(target, checkpoint_id=str(root / "step_1"), no_dist=True)
    assert torch.equal(target["w"], torch.full((4,), 10.0))  # a replicated tensor: rank 0's copy, as dcp.save does
    cluster.failure("node-1")
    for node, rank in (("node-0", 0), ("node-1", 1)):
        cluster.round(2, node_id=node, world=2, node_rank=rank, restart_count=1)
    for node, rank in (("node-0", 0), ("node-1", 1)):
        with cluster.worker(node_id=node, rank=rank, world=2, local_rank=0, round_=2) as ckpt:
            restored = ckpt.load()
        assert restored is not None and torch.equal(restored[1]["w"], torch.full((4,), 10.0 + rank))


def _two_nodes_persist(cluster: Cluster, values: tuple[float, float]) -> None:
    """Round 1: node-0 and node-1 (one rank each) save step 1 (rank r: ``values[r]``) and write it to disk."""
    for node, rank in (("node-0", 0), ("node-1", 1)):
        cluster.agent(node)
        cluster.round(1, node_id=node, world=2, node_rank=rank)
    with cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0) as rank0, \
            cluster.worker(node_id="node-1", rank=1, world=2, local_rank=0) as rank1:
        assert rank0.save(1, {"w": torch.full((4,), values[0]), "epoch": 3}, persist=True)
        assert rank1.save(1, {"w": torch.full((4,), values[1]), "epoch": 3}, persist=True)
        assert rank0.wait_persisted(timeout=30) == 1 and rank1.wait_persisted(timeout=30) == 1


def _grown_to_three(cluster: Cluster) -> list[tuple[int, dict[str, Any]] | None]:
    """Round 2 on three nodes (a resize): what each rank's load() gives."""
    cluster.agent("node-2")
    for rank, node in enumerate(("node-0", "node-1", "node-2")):
        cluster.round(2, node_id=node, world=3, node_rank=rank, restart_count=0)
    got = []
    for rank, node in enumerate(("node-0", "node-1", "node-2")):
        with cluster.worker(node_id=node, rank=rank, world=3, local_rank=0, round_=2) as ckpt:
            got.append(ckpt.load())
    return got


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_after_a_resize_every_rank_restores_a_replicated_state_saved_by_the_old_world(cluster: Cluster) -> None:
    _two_nodes_persist(cluster, (7.0, 7.0))  # DDP: every rank saved the same state
    for restored in _grown_to_three(cluster):
        assert restored is not None and restored[0] == 1 and restored[1]["epoch"] == 3
        assert torch.equal(restored[1]["w"], torch.full((4,), 7.0))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_after_a_resize_a_state_that_differs_between_ranks_is_never_taken_from_another_rank(
        cluster: Cluster) -> None:
    _two_nodes_persist(cluster, (7.0, 8.0))  # per-rank state (not sharded, not replicated): no rank's copy fits
    assert _grown_to_three(cluster) == [None, None, None]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_persist_whose_round_ended_uncommitted_frees_its_slot_for_the_next_round(cluster: Cluster) -> None:
    for node, rank in (("node-0", 0), ("node-1", 1)):
        cluster.agent(node)
        cluster.round(1, node_id=node, world=2, node_rank=rank)
    with cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0) as rank0, \
            cluster.worker(node_id="node-1", rank=1, world=2, local_rank=0) as rank1:
        assert rank0.save(1, {"w": torch.full((4,), 1.0)}) and rank1.save(1, {"w": torch.full((4,), 1.0)})
        assert rank0.save(2, {"w": torch.full((4,), 2.0)}, persist=True)  # pinned; rank 1 never saves step 2
    cluster.settle()
    cluster.failure("node-1")
    for node, rank in (("node-0", 0), ("node-1", 1)):
        cluster.round(2, node_id=node, world=2, node_rank=rank, restart_count=1)
    with cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0, round_=2) as ckpt:
        restored = ckpt.load()
        assert restored is not None and restored[0] == 1
        assert ckpt.save(2, {"w": torch.full((4,), 3.0)})  # one slot holds step 1; the other is free again
    cluster.settle()
