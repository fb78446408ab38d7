"""Resharding a step from the old ranks' slots in memory (_memreshard): the same state as the reshard from disk,
every chunk checked before any byte reaches the caller's tensors, and only one slot per old rank of one step taken.
Real FSDP2 over gloo: saved by three ranks, resharded into two from their slots, equal to what DCP's own load of
the same step gives, each new rank fetching only the shards it needs, also when each node lacks a slot the other holds
(read over that node's replica port); and a job resized on its node (2 ranks, then 1, then 3) restoring through
load() from its agent's slots with nothing on disk, the record saying so."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stead.core.config import Settings
from stead.core.events import CheckpointRestored
from stead.core.views.recovery import restored_from
from stead.plugins.ckpt import SHM_DIR, _disk, _fromdisk, segment_names
from stead.plugins.ckpt._layout import parse_document
from stead.plugins.ckpt._memreshard import stage_from_memory
from stead.plugins.ckpt.errors import CheckpointError
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.testing import SlotImage, slot_image
from stead.testing.steps import free_port

from .conftest import Cluster
from .test_fsdp import _run_ranks
from .test_no_unpickle import COLS, ROWS, weight, write_step
from .test_restore_faults import blank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def slots(step: int, *, world: int = 2) -> list[SlotImage]:
    """``step`` as write_step's ``world`` ranks hold it in their slots (model.w sharded by rows)."""
    images = []
    for rank in range(world):
        rows = ROWS // world
        state = {"model": {"w": weight(step)[rank * rows:(rank + 1) * rows].clone(), "b": torch.full((COLS,), 0.5)},
                 "pair": (torch.full((2,), float(step)), "tag"), "epoch": step, "lrs": [0.1, 0.2]}
        image = slot_image(state, step=step, rank=rank, world=world)
        image.doc.tensors[0].update(global_shape=[ROWS, COLS], offsets=[rank * rows, 0])  # model.w: a shard
        images.append(image)
    return images


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}{i}.").items()}
    return {prefix: value}


def test_a_step_resharded_from_the_slots_equals_the_same_step_resharded_from_disk(tmp_path: Path) -> None:
    write_step(tmp_path, 3)
    from_disk = _fromdisk.stage_resharded(_disk.read_manifest(tmp_path, 3, 0), blank(), world=1).copy_in()
    from_memory = stage_from_memory([s.part(where=f"slot of rank {s.doc.rank}") for s in slots(3)], blank(),
                                    rank=0, world=1).copy_in()
    assert torch.equal(from_memory["model"]["w"], weight(3))  # both shards, one under the other
    got, expected = flat(from_memory), flat(from_disk)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert (torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value), key


def test_a_corrupt_shard_in_memory_is_caught_before_any_byte_reaches_the_state() -> None:
    images = slots(3)
    offset = int(images[1].doc.tensors[0]["offset"])
    images[1].data[offset] ^= 0xFF  # a flipped byte in the second rank's shard of model.w
    state = blank()
    with pytest.raises(CheckpointError, match="slot of rank 1: tensor 0 of step 3 fails its checksum"):
        stage_from_memory([s.part(where=f"slot of rank {s.doc.rank}") for s in images], state, rank=0, world=1)
    assert not state["model"]["w"].any() and not state["model"]["b"].any() and not state["pair"][0].any()


@pytest.mark.parametrize("which", ["a-rank-missing", "another-step", "another-round"])
def test_slots_that_are_not_one_step_of_every_old_rank_are_refused(which: str) -> None:
    images = slots(3)
    if which == "a-rank-missing":
        images = images[:1]
    elif which == "another-step":
        images[1] = slots(4)[1]
    else:
        images[1] = slot_image({"x": torch.ones(1)}, step=3, rank=1, world=2, round_=2)
    with pytest.raises(CheckpointError, match="not one slot of each of its 2 ranks from one round; the step is "
                                              "read from disk"):
        stage_from_memory([s.part(where=f"slot of rank {s.doc.rank}") for s in images], blank(), rank=0, world=1)


#: the model both scripts train and how they read it whole (the same seed: the same state)
MODEL = textwrap.dedent("""
    def trained(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))  # 5 rows: uneven shards
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.full((3, 4), float(seed + 1))).sum().backward()
        opt.step()  # Adam's state (DTensors) exists: the optimizer's shards are restored too
        return model, opt

    def full(model, opt):
        model_sd, optim_sd = get_state_dict(model, opt)
        tensors = {"model." + k: v for k, v in model_sd.items()}
        for param, values in optim_sd["state"].items():
            tensors.update({f"optim.{param}.{k}": v for k, v in values.items()})
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in sorted(tensors.items())}
""")

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from stead.plugins.ckpt._layout import parse_document
    from stead.plugins.ckpt._memreshard import stage_from_memory
    from stead.plugins.ckpt.testing import SlotImage, slot_image

    phase, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    MODEL

    if phase == "save":
        model, opt = trained(0)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "epoch": 4}
        image = slot_image(state, step=2, rank=rank, world=world)
        with open(f"{out}/slot_{rank}.bin", "wb") as f:
            f.write(image.data)
        with open(f"{out}/slot_{rank}.json", "w") as f:
            json.dump({"sums": image.sums}, f)
        dcp.save(state, checkpoint_id=f"{out}/dcp")
        expected = full(model, opt)  # (a collective: every rank gathers)
        if rank == 0:
            torch.save(expected, f"{out}/expected.pt")
    else:
        saved = int(sys.argv[3])
        images = []
        for old in range(saved):
            data = bytearray(open(f"{out}/slot_{old}.bin", "rb").read())
            sums = tuple(json.load(open(f"{out}/slot_{old}.json"))["sums"])
            layout_off = data.rindex(b'{"format"')
            doc = parse_document(bytes(data[layout_off:]), expected_sum=None, where=f"slot of rank {old}")
            images.append(SlotImage(data=data, doc=doc, sums=sums))
        fetched = []
        model, opt = trained(1)
        model_sd, optim_sd = get_state_dict(model, opt)
        parts = [image.part(where=f"slot of rank {image.doc.rank}", fetched=fetched) for image in images]
        state = stage_from_memory(parts, {"model": model_sd, "optim": optim_sd}, rank=rank, world=world).copy_in()
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        from_memory = full(model, opt)
        model, opt = trained(2)
        model_sd, optim_sd = get_state_dict(model, opt)
        target = {"model": model_sd, "optim": optim_sd, "epoch": 0}
        dcp.load(target, checkpoint_id=f"{out}/dcp")  # torch's own reshard of the same step, from its files
        set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        from_dcp = full(model, opt)
        expected = torch.load(f"{out}/expected.pt", weights_only=True)
        assert state["epoch"] == 4 and target["epoch"] == 4, (state["epoch"], target["epoch"])
        assert from_memory.keys() == from_dcp.keys() == expected.keys(), (from_memory.keys(), expected.keys())
        differ = [k for k in expected if not torch.equal(from_memory[k], from_dcp[k])]
        assert not differ, differ
        assert all(torch.equal(from_memory[k], expected[k]) for k in expected), "not the saved state"
        sharded = sorted({(old, int(t["offset"])) for old, image in enumerate(images)
                          for t in image.doc.tensors if "global_shape" in t and int(t["nbytes"]) > 0})
        print("FETCHED", json.dumps({"rank": rank, "sharded": sorted({f for f in fetched if tuple(f) in
                                     set(sharded)}), "all_sharded": sharded}), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as test_fsdp.py's workers do: fully_shard keeps the process group alive past destroy
""").replace("MODEL\n", MODEL)


def _run(script: Path, phase: str, out: Path, world: int, *extra: str) -> list[str]:
    return _ranks([[str(script), phase, str(out), *extra]] * world, cwd=script.parent, local_ranks=True)


def _ranks(argvs: list[list[str]], *, cwd: Path, local_ranks: bool) -> list[str]:
    """One Python process a rank (``argvs[rank]``), joined over gloo on a free port; their outputs once all ended
    well (``local_ranks``: each rank is its own local rank, else every one is local rank 0: one a node)."""
    port = free_port()
    procs = []
    for rank, argv in enumerate(argvs):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank if local_ranks else 0), "WORLD_SIZE": str(len(argvs)),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, output[-3000:]
        outputs.append(output)
    return outputs


@pytest.fixture(scope="module")
def saved_by_three(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An FSDP2 state saved by three ranks (once for the tests below): each rank's slot (slot_R.bin and its
    checksums), the same step through torch.distributed.checkpoint (dcp/), and the whole weights (expected.pt)."""
    out = tmp_path_factory.mktemp("saved_by_three")
    script = out / "reshard_worker.py"
    script.write_text(SCRIPT)
    _run(script, "save", out, 3)
    return out


def test_fsdp2_saved_by_three_ranks_is_resharded_into_two_from_their_slots_as_dcp_reshards_it(
        saved_by_three: Path) -> None:
    outputs = _run(saved_by_three / "reshard_worker.py", "restore", saved_by_three, 2, "3")
    fetched = {}
    for output in outputs:
        [line] = [line for line in output.splitlines() if line.startswith("FETCHED ")]
        report = json.loads(line.removeprefix("FETCHED "))
        fetched[report["rank"]] = {tuple(f) for f in report["sharded"]}
        every = {tuple(f) for f in report["all_sharded"]}
    # the old shards: rows 0-1, 2-3 and 4 of the first layer (rows 0, 1 and none of the second); new rank 0 restores
    # rows 0-2, rank 1 rows 3-4: neither fetches every shard, and together they fetch each one at least once
    assert fetched[0] and fetched[1] and fetched[0] != every and fetched[1] != every, (fetched, every)
    assert not any(old == 2 for old, _ in fetched[0]), fetched[0]  # new rank 0 needs nothing of old rank 2's rows
    assert not any(old == 0 for old, _ in fetched[1]), fetched[1]  # nor new rank 1 of old rank 0's
    assert fetched[0] | fetched[1] == every


RESTORE = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from pathlib import Path
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from stead.plugins.ckpt._group import Group
    from stead.plugins.ckpt._layout import parse_document
    from stead.plugins.ckpt._memparts import MappedParts
    from stead.plugins.ckpt._recover import Restore
    from stead.plugins.ckpt._remoteparts import PeerAccess
    from stead.plugins.ckpt.settings import CheckpointSettings
    from stead.plugins.ckpt.testing import SlotImage

    out, node = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    MODEL

    def image(old):
        data = bytearray((out / f"slot_{old}.bin").read_bytes())
        sums = tuple(json.loads((out / f"slot_{old}.json").read_text())["sums"])
        doc = parse_document(bytes(data[data.rindex(b'{"format"'):]), expected_sum=None, where=f"slot {old}")
        return SlotImage(data=data, doc=doc, sums=sums)

    def parts_of(step, round_):  # what this rank's agent holds: its node's own slots and replicas
        held = sorted(node["own"] + node["replicas"])
        return MappedParts(parts=[image(old).part(where=f"rank {old} here") for old in held], own=len(node["own"]),
                           peer=len(node["replicas"]), _maps=[],
                           access=PeerAccess(address=node["address"], token=node["token"], job=node["job"],
                                             tls=None, timeout_s=10.0))

    reports = []
    restore = Restore(rank=rank, world=world, root=out / "no-disk-tier", settings=CheckpointSettings(),
                      group=Group(rank=rank, world=world), control=None, mapped=lambda _i: None,
                      report_corrupt=lambda *args: reports.append(args))
    model, opt = trained(1)
    model_sd, optim_sd = get_state_dict(model, opt)
    resharded = restore.reshard_from_memory({"model": model_sd, "optim": optim_sd}, (2, 1), parts_of)
    assert resharded is not None and not reports, reports
    (step, state), own, peer, other_nodes = resharded
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    from_memory = full(model, opt)
    model, opt = trained(2)
    model_sd, optim_sd = get_state_dict(model, opt)
    target = {"model": model_sd, "optim": optim_sd, "epoch": 0}
    dcp.load(target, checkpoint_id=str(out / "dcp"))  # torch's own reshard of the same step, from its files
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    from_dcp = full(model, opt)
    assert step == 2 and state["epoch"] == 4 == target["epoch"], (step, state["epoch"])
    differ = [k for k in from_dcp if not torch.equal(from_memory[k], from_dcp[k])]
    assert from_memory.keys() == from_dcp.keys() and not differ, differ
    print("RESHARDED", json.dumps([own, peer, other_nodes]), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as test_fsdp.py's workers do: fully_shard keeps the process group alive past destroy
""").replace("MODEL\n", MODEL)


def test_fsdp2_of_three_nodes_is_resharded_into_two_with_each_node_reading_the_slot_it_lacks_from_the_other(
        saved_by_three: Path, tmp_path: Path) -> None:
    """Three ranks on three hosts saved step 2, each node's replica on the next (0 -> 1 -> 2 -> 0); host 2 is lost and
    the job goes on with two ranks. Node 0 holds old rank 0 and old rank 2's replica, node 1 old rank 1 and old rank
    0's replica: node 0's rank reads old rank 1's shards from node 1's own slot, node 1's rank old rank 2's from the
    replica node 0 holds. The result equals torch.distributed.checkpoint's own reshard of the same step."""
    from .test_reshard_remote import Node  # (that module imports this one)

    images = []
    for old in range(3):
        data = bytearray((saved_by_three / f"slot_{old}.bin").read_bytes())
        doc = parse_document(bytes(data[data.rindex(b'{"format"'):]), expected_sum=None, where=f"slot {old}")
        images.append(SlotImage(data=data, doc=doc,
                                sums=tuple(json.loads((saved_by_three / f"slot_{old}.json").read_text())["sums"])))
    node_0, node_1 = Node(tmp_path, "n0", {0: images[0]}), Node(tmp_path, "n1", {1: images[1]})
    try:
        node_0.hold(images[2])
        node_1.hold(images[0])
        outputs = _restore_with_ports(tmp_path, saved_by_three, [(node_0, [0], [2]), (node_1, [1], [0])])
    finally:
        node_0.close()
        node_1.close()
    counts = [json.loads(next(line for line in o.splitlines() if line.startswith("RESHARDED ")).split(" ", 1)[1])
              for o in outputs]
    assert counts == [[1, 1, 1], [1, 1, 1]], counts  # each: its own slot, the replica it holds, one from the other


def _restore_with_ports(tmp_path: Path, saved: Path, nodes: list[tuple[Any, list[int], list[int]]]) -> list[str]:
    """RESTORE's ranks, one per node (node, its own old slots, the replicas it holds), over gloo: their outputs."""
    from .test_reshard_remote import JOB, TOKEN

    restore = tmp_path / "restore_worker.py"
    restore.write_text(RESTORE)
    said = [json.dumps({"own": own, "replicas": replicas, "address": node.address, "token": TOKEN, "job": JOB})
            for node, own, replicas in nodes]
    return _ranks([[str(restore), str(saved), one] for one in said], cwd=tmp_path, local_ranks=False)


LOAD_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from stead.ckpt import FlashCheckpointer

    phase, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    saving, persist = phase.startswith("save"), phase == "save-persist"
    torch.manual_seed(0 if saving else 1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    ckpt = FlashCheckpointer()
    if saving:
        model_sd, optim_sd = get_state_dict(model, opt)
        assert ckpt.save(1, {"model": model_sd, "optim": optim_sd, "epoch": 3})
        assert ckpt.save(2, {"model": model_sd, "optim": optim_sd, "epoch": 4}, persist=persist)
        assert not persist or ckpt.wait_persisted(60) == 2
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        step, state = ckpt.load({"model": model_sd, "optim": optim_sd})
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert step == 2 and state["epoch"] == 4, (step, state.get("epoch"))
    full = {k: v.full_tensor() for k, v in get_state_dict(model, opt)[0].items()}
    if saving and dist.get_rank() == 0:
        torch.save(full, out)
    elif not saving:
        expected = torch.load(out, weights_only=True)
        assert all(torch.equal(full[k], expected[k]) for k in expected), "restored weights differ"
        print("restored", step, flush=True)
    ckpt.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as test_fsdp.py's workers do: fully_shard keeps the process group alive past destroy
""")


@pytest.fixture
def memory_only(tmp_path: Path, settings: CheckpointSettings) -> Iterator[Cluster]:
    """A job whose agents never write a step to disk: what a restore gets, it got from memory."""
    no_disk = dataclasses.replace(settings, persist_on_failure=False)
    with Cluster(tmp_path, no_disk, job="reshard", stead_settings=Settings(retry_deadline_s=5.0)) as running:
        yield running


def _saved_by_two_ranks(cluster: Cluster, tmp_path: Path, phase: str) -> tuple[Path, Path]:
    """Steps 1 and 2 of an FSDP2 job of two ranks on node-0 (``phase``: "save", or "save-persist" to write step 2
    to disk too): the workers' script, and the file with the weights saved."""
    script = tmp_path / "fsdp_worker.py"
    script.write_text(LOAD_SCRIPT)
    cluster.agent(nproc=2)
    cluster.round(1, world=2, nproc=2)
    _run_ranks(cluster, script, phase, tmp_path / "expected.pt", 1, 2)
    return script, tmp_path / "expected.pt"


def _restored(cluster: Cluster, round_: int) -> CheckpointRestored:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [e for e in cluster.events if isinstance(e, CheckpointRestored) and e.round == round_]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no ckpt.restored for round {round_}: {cluster.event_types()}")


def test_a_resized_job_reshards_fsdp2_state_from_the_slots_its_node_holds_and_says_so(memory_only: Cluster,
                                                                                      tmp_path: Path) -> None:
    script, out = _saved_by_two_ranks(memory_only, tmp_path, "save")
    memory_only.round(2, world=1, nproc=1)  # shrunk to one rank: both old ranks' slots are in this node's memory
    [shrunk] = _run_ranks(memory_only, script, "restore", out, 2, 1)
    assert "restored 2" in shrunk and "tier=reshard" in shrunk, shrunk
    record = _restored(memory_only, 2)
    assert (record.step, record.resharded_ranks, record.reshard_own_parts, record.reshard_peer_parts,
            record.disk_ranks) == (2, 1, 2, 0, 0), record
    assert "resharded from memory 1 (the old ranks' slots read: own memory 2, peer replicas 0, other nodes 0)" in \
        restored_from(record)
    memory_only.round(3, world=3, nproc=3)  # grown to three: rank 1's rows come from both old ranks' slots
    grown = _run_ranks(memory_only, script, "restore", out, 3, 3)
    assert all("restored 2" in o and "tier=reshard" in o for o in grown), grown
    assert _restored(memory_only, 3).resharded_ranks == 3
    assert not list((tmp_path / "ckpt").glob("*/step_*")), "a step was written to disk: the test proves nothing"


def test_a_corrupt_slot_of_an_old_rank_is_caught_and_every_rank_reshards_from_disk_instead(cluster: Cluster,
                                                                                          tmp_path: Path) -> None:
    script, out = _saved_by_two_ranks(cluster, tmp_path, "save-persist")
    names = segment_names(cluster.job, "node-0", 1, cluster.settings.shm_namespace)
    slots = sorted(Path(SHM_DIR).glob(f"{names.prefix}i1-r1-s*"))  # old rank 1's two slots (steps 1 and 2)
    assert len(slots) == 2, slots
    for segment in slots:
        with segment.open("r+b") as data:  # the first byte of its first tensor, a shard of the first layer
            first = data.read(1)
            data.seek(0)
            data.write(bytes([first[0] ^ 0xFF]))
    cluster.round(2, world=1, nproc=1)
    [shrunk] = _run_ranks(cluster, script, "restore", out, 2, 1)
    assert "restored 2" in shrunk and "tier=disk" in shrunk, shrunk
    record = _restored(cluster, 2)
    assert (record.step, record.resharded_ranks, record.disk_ranks) == (2, 0, 1), record
    assert "ckpt.corrupt" in cluster.event_types(), cluster.event_types()
