"""Resharding from memory with old ranks' slots held only on other nodes (_remoteparts): the ranks say which slots
their nodes hold, each reads the tensors it needs of the slots its node lacks over the holder's replica port (an own
slot of the holder or a replica it holds), each checked against its checksum; a damaged part, a holder gone
mid-fetch and a read over the port's limits never reach the state, and the ranks reshard from disk instead.

The ranks agree through a test double of the process group (threads of this process, MIN all-reduces over a
barrier); the FSDP2 test runs real ranks over gloo against replica servers of this process."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from stead.cli.certs import make_certs
from stead.core.config import Settings
from stead.core.events import CheckpointRestored
from stead.core.views.recovery import restored_from
from stead.plugins.ckpt import _replicas
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt._codec import encode
from stead.plugins.ckpt._disk import tensor_bytes
from stead.plugins.ckpt._group import Group
from stead.plugins.ckpt._layout import parse_document, plan
from stead.plugins.ckpt._memparts import MappedParts
from stead.plugins.ckpt._memreshard import read_tensor
from stead.plugins.ckpt._recover import Resharded, Restore
from stead.plugins.ckpt._remoteparts import PeerAccess, RemoteSlot
from stead.plugins.ckpt._replicas import OwnSlot, ReplicaError, ReplicaMeta, ReplicaServer, push
from stead.plugins.ckpt._replicawire import Conn, connect, send_parts
from stead.plugins.ckpt._shm import SegmentNames
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.testing import LocalCluster, SlotImage

from .test_no_unpickle import COLS, ROWS, weight, write_step
from .test_restore_faults import blank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TOKEN, JOB = "a-token-of-the-job", "remote-reshard"


class ThreadGroup(Group):
    """The ranks of a job as threads of this process: each ``min`` is one all-reduce over a barrier."""

    def __init__(self, *, rank: int, world: int, shared: dict[str, Any]) -> None:
        super().__init__(rank=rank, world=world)
        self._shared = shared

    def min(self, values: Sequence[int]) -> list[int]:
        shared = self._shared
        shared["in"][self.rank] = list(values)
        shared["barrier"].wait()
        result = [min(column) for column in zip(*shared["in"], strict=True)]
        shared["barrier"].wait()
        return result


def sharded_slots(step: int, *, world: int) -> list[SlotImage]:
    """``step`` as ``world`` ranks hold it in their slots, model.w sharded by rows (its layout document, in the
    slot's bytes too, saying so: what a holder serves is what a worker saved)."""
    images = []
    rows = ROWS // world
    for rank in range(world):
        state = {"model": {"w": weight(step)[rank * rows:(rank + 1) * rows].clone(), "b": torch.full((COLS,), 0.5)},
                 "pair": (torch.full((2,), float(step)), "tag"), "epoch": step, "lrs": [0.1, 0.2]}
        encoded = encode(state)
        metas = [m.to_json() for m in encoded.metas]
        metas[0].update(global_shape=[ROWS, COLS], offsets=[rank * rows, 0])  # model.w: a shard
        layout = plan(metas)
        document = layout.document(tree=encoded.tree, step=step, round_=1, rank=rank, world=world)
        data = bytearray(layout.needed(document))
        sums = []
        for tensor, offset, nbytes in zip(encoded.tensors, layout.offsets, layout.nbytes, strict=True):
            data[offset:offset + nbytes] = tensor_bytes(tensor.contiguous())
            sums.append(checksum(data[offset:offset + nbytes]))
        data[layout.checks_off:layout.layout_off] = struct.pack(f"<{len(sums)}Q", *sums)
        data[layout.layout_off:] = document
        doc = parse_document(document, expected_sum=checksum(document), where=f"the slot of rank {rank}")
        images.append(SlotImage(data=data, doc=doc, sums=tuple(sums)))
    return images


def _meta(image: SlotImage) -> ReplicaMeta:
    """The description of ``image`` as its agent gives it (where its checksums and layout document are)."""
    layout_off = image.data.rindex(b'{"format"')
    checks_off = layout_off - 8 * len(image.sums)
    return ReplicaMeta(rank=image.doc.rank, world=image.doc.world, step=image.doc.step, round=image.doc.round,
                       data_bytes=checks_off, n_tensors=len(image.sums), checks_off=checks_off, layout_off=layout_off,
                       layout_len=len(image.data) - layout_off, layout_sum=checksum(bytes(image.data[layout_off:])))


class Node:
    """One node of the test: the slots it holds as its own, the replicas its port holds, and that port."""

    def __init__(self, tmp: Path, name: str, own: dict[int, SlotImage]) -> None:
        self.own, self.name = own, name
        self.views: dict[int, Any] = {}
        self.names = SegmentNames(prefix=f"stead-ckpt-test-{tmp.name[-12:]}-{name}-", incarnation=1)
        self.server = ReplicaServer(names=self.names, token=TOKEN, job=JOB, tls=None, max_bytes=0, timeout_s=5.0,
                                    changed=lambda: None, own=self._own)
        self.address = self.server.start("127.0.0.1")
        self.replicas: dict[int, SlotImage] = {}

    def _own(self, rank: int, step: int, round_: int) -> OwnSlot | None:
        image = self.own.get(rank)
        if image is None or (image.doc.step, image.doc.round) != (step, round_):
            return None
        import mmap

        if rank not in self.views:
            view = mmap.mmap(-1, len(image.data))
            view[:] = bytes(image.data)
            self.views[rank] = view
        return OwnSlot(meta=_meta(image), view=self.views[rank], unchanged=lambda: True)

    def hold(self, image: SlotImage) -> None:
        """Take ``image`` as a replica, sent to this node's port as a peer sends one."""
        push(self.address, token=TOKEN, job=JOB, tls=None, meta=_meta(image), source=memoryview(image.data),
             intact=lambda: True, timeout_s=5.0)
        self.replicas[image.doc.rank] = image

    def parts(self) -> MappedParts:
        """What this node's agent hands its workers: its slots, own and replicas, and how to reach other ports."""
        held = {**self.own, **self.replicas}
        parts = [held[r].part(where=f"rank {r} on {self.name}") for r in sorted(held)]
        access = PeerAccess(address=self.address, token=TOKEN, job=JOB, tls=None, timeout_s=5.0)
        return MappedParts(parts=parts, own=len(self.own), peer=len(self.replicas), _maps=[], access=access)

    def close(self) -> None:
        self.server.close()
        for view in self.views.values():
            view.close()
        assert not self.names.all_mine()  # every replica's segment freed


@pytest.fixture
def closing() -> Iterator[list[Node]]:
    nodes: list[Node] = []
    yield nodes
    for node in nodes:
        node.close()


def _restores(nodes: Sequence[Node], tmp: Path) -> tuple[list[Restore], list[list[str]]]:
    """One restore per node's rank (agreeing through a ThreadGroup), and the corrupt copies each reports."""
    world = len(nodes)
    shared: dict[str, Any] = {"in": [[] for _ in range(world)], "barrier": threading.Barrier(world, timeout=30)}
    reports: list[list[str]] = [[] for _ in range(world)]
    restores = [Restore(rank=rank, world=world, root=tmp, settings=CheckpointSettings(dir=str(tmp)),
                        group=ThreadGroup(rank=rank, world=world, shared=shared), control=None,
                        mapped=lambda _i: None, report_corrupt=_reporter(reports[rank]))
                for rank in range(world)]
    return restores, reports


def _reporter(into: list[str]) -> Callable[[int, str, str], None]:
    """A restore's report of a corrupt copy, its detail noted in ``into``."""
    return lambda _step, _tier, detail: into.append(detail)


def _on_ranks(restores: Sequence[Restore], call: Callable[[int, Restore], Any]) -> list[Any]:
    """``call(rank, restore)`` on every rank at once, a thread each: what each returned."""
    results: list[Any] = [None] * len(restores)
    failures: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = call(rank, restores[rank])
        except BaseException as exc:
            failures.append(exc)
            assert isinstance(restores[rank].group, ThreadGroup)
            restores[rank].group._shared["barrier"].abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(restores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    return results


def _reshard(nodes: Sequence[Node], tmp: Path) -> tuple[list[Resharded | None], list[list[str]], list[Restore]]:
    """Each node's rank reshards step 3 of round 1 from memory."""
    restores, reports = _restores(nodes, tmp)
    results = _on_ranks(restores, lambda rank, restore: restore.reshard_from_memory(
        blank(), (3, 1), lambda _s, _r: nodes[rank].parts()))
    return results, reports, restores


def _two_nodes(tmp: Path, closing: list[Node]) -> list[Node]:
    """Step 3 saved by four ranks: node x holds old ranks 0 and 1 as its own slots and rank 3's replica, node y old
    rank 2's slot only (rank 3's node is gone). Each node lacks what the other holds."""
    images = sharded_slots(3, world=4)
    x = Node(tmp, "x", {0: images[0], 1: images[1]})
    closing.append(x)
    y = Node(tmp, "y", {2: images[2]})
    closing.append(y)
    x.hold(images[3])
    return [x, y]


def test_slots_held_only_on_other_nodes_are_read_from_their_ports_and_the_step_equals_the_saved_one(
        tmp_path: Path, closing: list[Node], monkeypatch: pytest.MonkeyPatch) -> None:
    connections: list[int] = []
    serve = ReplicaServer._reads

    def counted(server: ReplicaServer, conn: Conn, request: dict[str, Any]) -> None:
        connections.append(request["rank"])
        serve(server, conn, request)

    monkeypatch.setattr(ReplicaServer, "_reads", counted)
    nodes = _two_nodes(tmp_path, closing)
    results, reports, _ = _reshard(nodes, tmp_path)
    assert reports == [[], []]
    assert sorted(connections) == [0, 2], connections  # one connection per port read from: y's rank reads 0, 1, 3
    for rank, result in enumerate(results):
        assert result is not None, rank
        (step, state), own, peer, other_nodes = result
        assert step == 3 and state["epoch"] == 3 and state["pair"][1] == "tag"
        assert torch.equal(state["model"]["w"], weight(3))  # the four old shards, one under the other
        assert (own, peer, other_nodes) == ((2, 1, 1) if rank == 0 else (1, 0, 3)), (rank, result[1:])
    assert not list(tmp_path.glob("step_*")), "nothing was on disk to read"




def test_a_part_damaged_on_the_node_holding_it_is_caught_and_every_rank_reshards_from_disk(
        tmp_path: Path, closing: list[Node]) -> None:
    write_step(tmp_path, 3, world=4)
    x, y = _two_nodes(tmp_path, closing)
    held = x.server.held[3]  # the replica of old rank 3 on node x, read by node y's rank
    offset = int(x.replicas[3].doc.tensors[0]["offset"])
    held.view[offset] ^= 0xFF
    results, reports, restores = _reshard([x, y], tmp_path)
    assert results == [None, None]
    assert reports[0] == [] and len(reports[1]) == 1, reports
    assert "the slot of rank 3 on the node at" in reports[1][0] and "fails its checksum" in reports[1][0]
    from_disk = _on_ranks(restores, lambda _rank, restore: restore.from_tiers(blank(), None, False))
    for (step, state), source in from_disk:
        assert step == 3 and source.tier == "disk" and torch.equal(state["model"]["w"], weight(3))


def _gone_mid_read(conn: Conn, meta: Any, view: Any, ranges: list[tuple[int, int]],
                   unchanged: Callable[[], bool]) -> None:
    """How a holder of old rank 2's slot answers when its host goes away while it sends a tensor: half the bytes,
    then nothing (its head is sent whole)."""
    if not ranges or meta.rank != 2:
        return send_parts(conn, meta, view, ranges, unchanged)
    offset, nbytes = ranges[0]
    conn.send_line({"ok": True, "bytes": nbytes})
    conn.sock.sendall(bytes(view[offset:offset + nbytes // 2]))
    conn.sock.shutdown(socket.SHUT_RDWR)
    raise OSError("the host went away")


def test_a_holder_gone_mid_fetch_makes_every_rank_reshard_from_disk_saying_why(
        tmp_path: Path, closing: list[Node], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_replicas, "send_parts", _gone_mid_read)  # node y, holding old rank 2, fails mid-tensor
    x, y = _two_nodes(tmp_path, closing)
    results, reports, _ = _reshard([x, y], tmp_path)
    assert results == [None, None]
    assert reports[1] == [] and len(reports[0]) == 1, reports
    assert "the slot of rank 2 on the node at" in reports[0][0] and "the holder went away" in reports[0][0]


def test_a_read_over_the_port_s_limits_or_outside_the_slot_is_refused_with_the_reason(
        tmp_path: Path, closing: list[Node]) -> None:
    x, _ = _two_nodes(tmp_path, closing)
    access = x.parts().access
    assert access is not None
    slot = RemoteSlot(x.address, access, rank=3, step=3, round_=1)
    try:
        part = slot.part()
        with pytest.raises(ReplicaError, match=r"refused a read: a read of 5368709120 bytes is refused: at most "
                                               r"4294967296 in one request"):
            slot.read(0, 5 << 30)
        with pytest.raises(ReplicaError, match=r"outside the \d+ bytes of tensor data of rank 3's step 3: refused"):
            slot.read(0, len(x.replicas[3].data))
        target = bytearray(int(part.tensors[0]["nbytes"]))
        read_tensor(part, 0, memoryview(target))  # the connection still serves
        assert bytes(target) == bytes(x.replicas[3].data[:len(target)])
    finally:
        slot.close()
    conn = connect(x.address, token=TOKEN, job=JOB, tls=None, timeout_s=5.0)
    try:
        conn.send_line({"op": "read", "rank": 3, "step": 3, "round": 1, "ranges": [[0, 1]] * 1025})
        assert conn.json() == {"ok": False, "error": "a read of 1025 ranges is refused: at most 1024 in one request "
                                                     "(ask for the rest in another)"}
    finally:
        conn.close()
    with pytest.raises(ReplicaError, match=r"refused this node: it did not prove it holds this job's token"):
        connect(x.address, token="another-token", job=JOB, tls=None, timeout_s=5.0)


def test_the_status_line_of_a_reshard_counts_the_slots_read_from_other_nodes() -> None:
    record = CheckpointRestored(round=2, step=3, resharded_ranks=2, reshard_own_parts=3, reshard_peer_parts=1,
                                reshard_remote_parts=4)
    assert restored_from(record) == ("step 3: resharded from memory 2 (the old ranks' slots read: own memory 3, "
                                     "peer replicas 1, other nodes 4)")


@pytest.mark.parametrize("tls", [False, True])
def test_an_agent_serves_its_own_slots_to_a_reshard_elsewhere_tells_its_workers_how_to_reach_ports_and_counts_them(
        tmp_path: Path, settings: CheckpointSettings, tls: bool) -> None:
    files = {name: str(path) for name, path in make_certs(job="own", directory=tmp_path / "pki",
                                                          hosts=["127.0.0.1"]).items()} if tls else {}
    with LocalCluster(tmp_path, dataclasses.replace(settings, replicas=1, persist_on_failure=False), job="own",
                      stead_settings=Settings.from_mapping({"retry_deadline_s": "5", **files})) as cluster:
        cluster.agent()
        cluster.round(1)
        node = cluster.agents["node-0"]._node
        assert node is not None
        state = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.full((7,), 2.5), "step": 2}
        with cluster.worker() as ckpt:
            assert ckpt.save(2, state)
            for _ in range(200):  # until the agent computed the slot's checksums (it serves no slot before)
                if node._own_slot(0, 2, 1) is not None:
                    break
                cluster.settle(0.05)
            mapped = ckpt._memory_parts(2, 1)
            assert mapped is not None and mapped.access is not None
            try:
                assert mapped.access.address == node.peers.address and mapped.access.token == cluster.token
                assert (mapped.access.tls is not None) == tls  # the workers reach other ports as the agents do
                slot = RemoteSlot(mapped.access.address, mapped.access, rank=0, step=2, round_=1)
                try:
                    part = slot.part()
                    got = [bytearray(int(t["nbytes"])) for t in part.tensors]
                    for index, target in enumerate(got):
                        read_tensor(part, index, memoryview(target))
                finally:
                    slot.close()
            finally:
                mapped.close()
            assert bytes(got[0]) == tensor_bytes(state["w"]) and bytes(got[1]) == tensor_bytes(state["b"])
            other = RemoteSlot(node.peers.address, mapped.access, rank=1, step=2, round_=1)
            try:
                with pytest.raises(ReplicaError, match="holds no slot of rank 1 step 2"):
                    other.part()
            finally:
                other.close()

            # what load() tells the agent after such a reshard reaches the master's record, and stead status
            assert ckpt._link is not None
            ckpt._link.notify({"op": "restored", "step": 2, "tier": "reshard", "own": 1, "peer": 0, "remote": 2})
            for _ in range(200):
                records = [e for e in cluster.events if isinstance(e, CheckpointRestored)]
                if records:
                    break
                cluster.settle(0.05)
    assert [(r.step, r.resharded_ranks, r.reshard_own_parts, r.reshard_peer_parts, r.reshard_remote_parts)
            for r in records] == [(2, 1, 1, 0, 2)]
    assert "resharded from memory 1 (the old ranks' slots read: own memory 1, peer replicas 0, other nodes 2)" in \
        restored_from(records[0])
