"""Peer replicas: a node's committed step copied into another host's memory, and fetched back by the node that
replaces it, verified, with no disk read; a damaged replica, a stranger on the port and a full budget refused."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from stead.cli.certs import make_certs
from stead.core.config import Settings
from stead.core.platform import HOST_ENV
from stead.plugin import CheckpointRestored, NodeExited, NodeLost, Record
from stead.plugins.ckpt import _disk
from stead.plugins.ckpt._book import Book
from stead.plugins.ckpt._checksum import checksum
from stead.plugins.ckpt._client import PeerCopy
from stead.plugins.ckpt._layout import plan
from stead.plugins.ckpt._peers import PeerReplicas
from stead.plugins.ckpt._replicas import _GREETING, ReplicaError, ReplicaMeta, ReplicaServer, _proof, fetch, push
from stead.plugins.ckpt._shm import SegmentNames, SlotInfo, SlotState, VerifyState, unlink_quietly
from stead.plugins.ckpt.agent import CheckpointAgentExtension
from stead.plugins.ckpt.errors import CheckpointError
from stead.plugins.ckpt.events import CheckpointCorrupt
from stead.plugins.ckpt.plugin import CheckpointPlugin
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.testing import LocalCluster, environ_set

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture
def memory_only(settings: CheckpointSettings) -> CheckpointSettings:
    """Nothing is written to disk unless a test asks: whatever is restored came from memory."""
    return dataclasses.replace(settings, persist_on_failure=False, persist_on_stop=False, persist_grace_s=2.0)


def _cluster(tmp_path: Path, settings: CheckpointSettings, **stead: str) -> LocalCluster:
    return LocalCluster(tmp_path, settings, job="replicas",
                        stead_settings=Settings.from_mapping({"retry_deadline_s": "5", **stead}))


def _agent(cluster: LocalCluster, node: str, host: str, incarnation: int = 1) -> CheckpointAgentExtension:
    with environ_set({HOST_ENV: host}):
        return cluster.agent(node, incarnation=incarnation)


def _held(cluster: LocalCluster, node: str) -> list[tuple[int, int, int, int, int]]:
    ext = cluster.agents[node]
    assert ext._node is not None
    return ext._node.peers.held()


def _until(cluster: LocalCluster, done: Callable[[], bool], what: str, polls: int = 600) -> None:
    """Until ``done()``, letting the agents and the master work between looks (a bound on a wait, not a speed)."""
    for _ in range(polls):
        if done():
            return
        cluster.settle(0.05)
    pytest.fail(f"never, in {polls} looks: {what}")


def _lose_host(cluster: LocalCluster, node: str) -> None:
    """The node's host is gone: its agent killed and its memory with it."""
    names = cluster.agents[node]._names
    assert names is not None
    cluster.kill_agent(node)
    for name in names.all_mine():
        unlink_quietly(name)


def _replicated(cluster: LocalCluster, step: int) -> None:
    """Until ``step`` (of round 1) is replicated everywhere and every agent knows it (a save meanwhile would be
    skipped: both slots are kept, the replicated step's and the one on its way)."""
    def settled() -> bool:
        nodes = [ext._node for ext in cluster.agents.values() if ext._node is not None]
        return cluster.plugin.replication.replicated == (step, 1) and all(
            n.peers.replicated is not None and n.peers.replicated.replicated == (step, 1) for n in nodes)

    _until(cluster, settled, "the step being copied replicated everywhere, and every agent told")


def _two_hosts_save(cluster: LocalCluster, steps: int) -> None:
    """node-0 on host a, node-1 on host b, one rank each, save steps 1..steps (each rank's own values: a state that
    no rank can take from another's copy), each once the one before is replicated, and each node's replica of the
    last is in the other's memory."""
    _agent(cluster, "node-0", "a")
    _agent(cluster, "node-1", "b")
    for node, rank in (("node-0", 0), ("node-1", 1)):
        cluster.round(1, node_id=node, world=2, node_rank=rank)
    with cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0) as rank0, \
            cluster.worker(node_id="node-1", rank=1, world=2, local_rank=0) as rank1:
        for step in range(1, steps + 1):
            assert rank0.save(step, {"w": torch.full((1000,), 10.0 * step), "step": step})
            assert rank1.save(step, {"w": torch.full((1000,), 10.0 * step + 1), "step": step})
            _replicated(cluster, step)
    _until(cluster, lambda: [h[:4] for h in _held(cluster, "node-0")] == [(1, 2, steps, 1)]
           and [h[:4] for h in _held(cluster, "node-1")] == [(0, 2, steps, 1)], "each node holds the other's replica")


def _replace_node_1(cluster: LocalCluster) -> None:
    """node-1's host is lost; node-1 comes back on host c, and both nodes start round 2."""
    _lose_host(cluster, "node-1")
    _agent(cluster, "node-1", "c", incarnation=2)
    for node, rank in (("node-0", 0), ("node-1", 1)):
        cluster.round(2, node_id=node, world=2, node_rank=rank, restart_count=1)


def _push_empty(address: str, *, token: str, job: str, timeout_s: float = 5.0) -> None:
    """Offer ``address`` a replica of two bytes (what a refusal is tested with)."""
    meta = ReplicaMeta(rank=1, world=2, step=5, round=1, data_bytes=0, n_tensors=0, checks_off=0, layout_off=0,
                       layout_len=2, layout_sum=0)
    push(address, token=token, job=job, tls=None, meta=meta, source=memoryview(b"{}"), intact=lambda: True,
         timeout_s=timeout_s)


def _load(cluster: LocalCluster, node: str, rank: int) -> tuple[int, dict[str, object]] | None:
    with cluster.worker(node_id=node, rank=rank, world=2, local_rank=0, round_=2) as ckpt:
        return ckpt.load()


def test_a_lost_host_s_replacement_restores_its_rank_s_newest_step_from_a_peer_s_replica(
        tmp_path: Path, memory_only: CheckpointSettings) -> None:
    with _cluster(tmp_path, memory_only) as cluster:
        _two_hosts_save(cluster, steps=3)
        _until(cluster, lambda: re.search(r"node-0 \(host a\) holds rank 1 \([24]\.0 MiB\)",  # (one or two buffers)
                                          " ".join(cluster.plugin._status)) is not None,
               "stead status says who holds which replica")
        _replace_node_1(cluster)
        restored = [_load(cluster, "node-0", 0), _load(cluster, "node-1", 1)]
        cluster.settle()
        events = [e for e in cluster.events if isinstance(e, CheckpointRestored)]
    for rank, got in enumerate(restored):
        assert got is not None and got[0] == 3 and got[1]["step"] == 3
        assert torch.equal(got[1]["w"], torch.full((1000,), 30.0 + rank))  # type: ignore[arg-type]
    assert not (Path(memory_only.dir) / "replicas").exists()  # no file was there to read
    assert [(e.step, e.memory_ranks, e.peer_ranks, e.disk_ranks) for e in events] == [(3, 1, 1, 0)]


def test_when_the_newest_step_s_replica_was_not_in_place_every_rank_restores_the_newest_one_that_was(
        tmp_path: Path, memory_only: CheckpointSettings) -> None:
    """node-1's host is lost after step 4 was committed and before its replica reached node-0: node-1's replacement
    fetches step 3, known committed there, and node-0's rank still holds step 3 in its other slot, known committed
    too: with a process group (tests/e2e) the ranks agree on step 3, each from memory (one step trained again, none
    read from disk). Without one each rank decides alone, so only rank 1's restore is looked at here."""
    with _cluster(tmp_path, memory_only) as cluster:
        _two_hosts_save(cluster, steps=3)
        node_1 = cluster.agents["node-1"]._node
        assert node_1 is not None
        node_1.peers._push = lambda *_: False  # type: ignore[method-assign]  # nothing more leaves node-1's host
        with cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0) as rank0, \
                cluster.worker(node_id="node-1", rank=1, world=2, local_rank=0) as rank1:
            assert rank0.save(4, {"w": torch.full((1000,), 40.0), "step": 4})
            assert rank1.save(4, {"w": torch.full((1000,), 41.0), "step": 4})
        _until(cluster, lambda: cluster.plugin.book.step == 4, "step 4 committed")
        _replace_node_1(cluster)
        survivor = cluster.agents["node-0"]._node
        assert survivor is not None
        control = survivor._ranks[0].control
        assert {s.step for s in control.slots() if s.complete} == {3, 4}
        assert {(3, 1), (4, 1)} <= set(control.recently_committed())
        got = _load(cluster, "node-1", 1)
    assert got is not None and got[0] == 3 and got[1]["step"] == 3
    assert torch.equal(got[1]["w"], torch.full((1000,), 31.0))  # type: ignore[arg-type]


def test_with_the_job_s_certificates_replicas_travel_over_mutual_tls_and_a_plain_text_peer_gets_nothing(
        tmp_path: Path, memory_only: CheckpointSettings) -> None:
    tls = {name: str(path) for name, path in make_certs(job="replicas", directory=tmp_path / "pki",
                                                        hosts=["127.0.0.1"]).items()}
    with _cluster(tmp_path, memory_only, **tls) as cluster:
        _two_hosts_save(cluster, steps=2)
        holder = cluster.agents["node-0"]._node
        assert holder is not None
        with pytest.raises(ReplicaError, match="it may serve TLS and this node not"):  # (it waits for a TLS hello)
            _push_empty(holder.peers.address, token=cluster.token, job=cluster.job, timeout_s=1.0)
        _replace_node_1(cluster)
        got = _load(cluster, "node-1", 1)
        cluster.settle()
        events = [e for e in cluster.events if isinstance(e, CheckpointRestored)]
    assert got is not None and got[0] == 2 and torch.equal(got[1]["w"], torch.full((1000,), 21.0))  # type: ignore[arg-type]
    assert holder.peers._client_tls is not None
    assert not events or events[-1].peer_ranks == 1


def test_a_damaged_replica_is_reported_and_never_restored(tmp_path: Path, memory_only: CheckpointSettings) -> None:
    with _cluster(tmp_path, memory_only) as cluster:
        _two_hosts_save(cluster, steps=2)
        holder = cluster.agents["node-0"]._node
        assert holder is not None and holder.peers._server is not None
        held = holder.peers._server.held[1]
        held.view[0] ^= 0xFF  # a flipped byte in the first tensor of rank 1's replica
        _replace_node_1(cluster)
        restored = _load(cluster, "node-1", 1)
        cluster.settle()
        corrupt = [e for e in cluster.events if isinstance(e, CheckpointCorrupt)]
    assert restored is None  # no other copy of rank 1's state exists: nothing, rather than damaged bytes
    assert [(e.rank, e.step, e.tier) for e in corrupt] == [(1, 2, "peer")]
    assert "fail their checksums" in corrupt[0].detail


def test_a_replica_whose_checksums_fail_on_arrival_is_refused_and_the_previous_one_kept(
        tmp_path: Path, memory_only: CheckpointSettings) -> None:
    with _cluster(tmp_path, memory_only) as cluster:
        _two_hosts_save(cluster, steps=1)
        node = cluster.agents["node-1"]._node
        holder = cluster.agents["node-0"]._node
        assert node is not None and holder is not None
        state = node._ranks[0]
        slot = next(s for s in state.control.slots() if s.step == 1)
        damaged = bytearray(state.mapping(slot, node.names)[:slot.layout_off + slot.layout_len])
        damaged[0] ^= 1
        meta = ReplicaMeta.of_slot(slot)
        with pytest.raises(ReplicaError, match="fail their checksums"):
            push(holder.peers.address, token=cluster.token, job=cluster.job, tls=None, meta=meta,
                 source=memoryview(damaged), intact=lambda: True, timeout_s=5.0)
        assert [h[:4] for h in holder.peers.held()] == [(1, 2, 1, 1)]


def test_a_peer_without_the_job_s_token_is_refused_before_anything_is_sent(
        tmp_path: Path, memory_only: CheckpointSettings) -> None:
    with _cluster(tmp_path, memory_only) as cluster:
        _two_hosts_save(cluster, steps=1)
        holder = cluster.agents["node-0"]._node
        assert holder is not None
        for token, job in (("x" * 43, cluster.job), (cluster.token, "another-job")):
            with pytest.raises(ReplicaError, match="did not prove it holds this job's token"):
                _push_empty(holder.peers.address, token=token, job=job)
        assert [h[:4] for h in holder.peers.held()] == [(1, 2, 1, 1)]


def test_a_budget_too_small_for_a_replica_is_named_in_the_refusal(
        tmp_path: Path, memory_only: CheckpointSettings) -> None:
    with _cluster(tmp_path, dataclasses.replace(memory_only, replica_max_bytes=4096)) as cluster:
        _agent(cluster, "node-0", "a")
        node = cluster.agents["node-0"]._node
        assert node is not None
        with pytest.raises(ReplicaError, match=r"ckpt\.replica_max_bytes=4096"):
            _push_empty(node.peers.address, token=cluster.token, job=cluster.job)
        assert node.peers.held() == []


def test_nodes_on_one_host_keep_no_replicas(tmp_path: Path, memory_only: CheckpointSettings) -> None:
    with _cluster(tmp_path, memory_only) as cluster:
        for node, rank in (("node-0", 0), ("node-1", 1)):
            _agent(cluster, node, "same-host")
            cluster.round(1, node_id=node, world=2, node_rank=rank)
        with cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0) as rank0, \
                cluster.worker(node_id="node-1", rank=1, world=2, local_rank=0) as rank1:
            for step in (1, 2):
                assert rank0.save(step, {"w": torch.ones(10)}) and rank1.save(step, {"w": torch.ones(10)})
        cluster.settle(0.5)
        assert _held(cluster, "node-0") == [] and _held(cluster, "node-1") == []
        for node in ("node-0", "node-1"):
            names = cluster.agents[node]._names
            assert names is not None and not [n for n in names.all_mine() if "-p0-" in n or "-p1-" in n]


def test_a_replica_of_a_step_is_replaced_by_the_next_one_in_one_of_two_buffers(
        tmp_path: Path, memory_only: CheckpointSettings) -> None:
    with _cluster(tmp_path, memory_only) as cluster:
        _two_hosts_save(cluster, steps=4)
        names = cluster.agents["node-0"]._names
        assert names is not None
        replicas = [n for n in names.all_mine() if "-p1-" in n]
        [(rank, _, step, _, taken)] = _held(cluster, "node-0")
    assert len(replicas) == 2, replicas  # the newest, and the previous one's buffer the next is written into
    assert (rank, step, taken) == (1, 4, 2 * (2 << 20))  # the memory both take, as reported
    assert not _disk.candidates(Path(memory_only.dir) / "replicas", 0, any_rank=True)


def test_a_process_squatting_on_a_holder_s_port_is_sent_nothing() -> None:
    """A process that took a dead agent's port cannot prove it holds the job's token: the sender stops there."""
    got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def squatter() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(f"{_GREETING} 0123\n".encode())
                got.append(conn.recv(4096))  # the sender's nonce and proof
                conn.sendall(b"0" * 64 + b"\n")  # a proof it cannot make
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    got.append(conn.recv(4096))

        thread = threading.Thread(target=squatter)
        thread.start()
        with pytest.raises(ReplicaError, match="did not prove it holds this job's token"):
            _push_empty(f"127.0.0.1:{port}", token="t" * 43, job="j")
        thread.join()
    assert len(got) == 2 and got[1] == b""  # after its proof failed, the sender closed without a byte more


@pytest.mark.anyio
async def test_a_node_that_ended_is_no_holder_any_more_and_its_next_incarnation_s_report_stays() -> None:
    plugin = CheckpointPlugin(settings=CheckpointSettings())
    plugin.book = Book(step=5, step_round=1, persisted=-1)
    for node, host, rank in (("node-0", "a", 0), ("node-1", "b", 1)):
        plugin.replica_report(node_id=node, incarnation=1, round_=1, host=host, address=f"10.0.0.{rank + 1}:5000",
                              ranks=[rank], held={1 - rank: ((5, 1, 2),)})
    assert [s[0] for s in plugin.replica_sources("node-2", [0, 1])] == ["node-1", "node-0"]
    lost = Record(seq=1, at=0.0, event=NodeLost(node_id="node-1", incarnation=1, reason="host b hung up"))
    await plugin.handle(record=lost, ctx=None)  # type: ignore[arg-type]
    assert [s[0] for s in plugin.replica_sources("node-2", [0, 1])] == ["node-0"]  # rank 0's copy went with host b
    plugin.replica_report(node_id="node-1", incarnation=2, round_=2, host="c", address="10.0.0.3:5000", ranks=[1],
                          held={0: ((5, 1, 2),)})
    late = Record(seq=2, at=0.0, event=NodeExited(node_id="node-1", incarnation=1, signal=9))
    await plugin.handle(record=late, ctx=None)  # type: ignore[arg-type]
    assert [s[0] for s in plugin.replica_sources("node-2", [0])] == ["node-1"]


def test_a_replacement_fetches_its_rank_s_newest_copy_and_the_replicated_one_that_every_rank_can_get(
        tmp_path: Path, memory_only: CheckpointSettings) -> None:
    """Step 4 is committed and its copy of rank 1 reached node-0, rank 0's never reached node-1 (node-0's sends
    fail): step 3 stays the replicated step. node-0 keeps its copy of rank 1's step 3 beside step 4's, and node-1's
    replacement fetches both: whichever the ranks agree on (4 if every rank has it, else 3) is in its memory."""
    with _cluster(tmp_path, memory_only) as cluster:
        _two_hosts_save(cluster, steps=3)
        node_0 = cluster.agents["node-0"]._node
        assert node_0 is not None
        node_0.peers._push = lambda *_: False  # type: ignore[method-assign]
        with cluster.worker(node_id="node-0", rank=0, world=2, local_rank=0) as rank0, \
                cluster.worker(node_id="node-1", rank=1, world=2, local_rank=0) as rank1:
            assert rank0.save(4, {"w": torch.full((1000,), 40.0), "step": 4})
            assert rank1.save(4, {"w": torch.full((1000,), 41.0), "step": 4})
            _until(cluster, lambda: sorted(h[2] for h in _held(cluster, "node-0")) == [3, 4],
                   "node-0 holds rank 1's step 4 and keeps its step 3 (the replicated one)")
            assert cluster.plugin.replication.replicated == (3, 1)
            assert not rank0.save(5, {"w": torch.full((1000,), 50.0), "step": 5})  # slots of 3 and 4 kept
        _replace_node_1(cluster)
        replacement = cluster.agents["node-1"]._node
        assert replacement is not None
        assert sorted(s.step for s in replacement._ranks[0].control.slots() if s.complete) == [3, 4]
        assert replacement.peers.fetched[0] == {3, 4}
        got = _load(cluster, "node-1", 1)
        cluster.settle()
    assert got is not None and got[0] == 4 and torch.equal(got[1]["w"], torch.full((1000,), 41.0))  # type: ignore[arg-type]


def test_a_holder_of_another_version_of_the_protocol_is_named_as_such() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def older() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"stead-replica 1 0123\n")
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    conn.recv(4096)

        thread = threading.Thread(target=older)
        thread.start()
        with pytest.raises(ReplicaError, match=r"speaks 'stead-replica 1'.*run every node with the same stead"):
            _push_empty(f"127.0.0.1:{port}", token="t" * 43, job="j")
        thread.join()


# -- the transfer: the sender's copy ahead of its send, the holder's checks as the bytes arrive -----------------


_TOKEN, _JOB = "t" * 43, "j"


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[ReplicaServer]:
    names = SegmentNames(prefix=f"stead-ckpt-test-{tmp_path.name[-12:]}-", incarnation=1)
    server = ReplicaServer(names=names, token=_TOKEN, job=_JOB, tls=None, max_bytes=0, timeout_s=5.0,
                           changed=lambda: None)
    server.start("127.0.0.1")
    try:
        yield server
    finally:
        server.close()
    assert not names.all_mine()  # every buffer freed


def _slot(step: int, tensors: list[int], *, seed: int = 0) -> tuple[SlotInfo, bytearray]:
    """A saved slot of rank 1 (world 2) holding tensors of these sizes in bytes, with its checksums and layout
    document, as a worker and its agent leave it (large ones span several of the transfer's pieces)."""
    layout = plan([{"dtype": "uint8", "shape": [n], "nbytes": n} for n in tensors])
    document = layout.document(tree={"step": step}, step=step, round_=1, rank=1, world=2)
    memory = bytearray(layout.needed(document))
    rng = np.random.default_rng(seed)
    for offset, nbytes in zip(layout.offsets, layout.nbytes, strict=True):
        memory[offset:offset + nbytes] = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    sums = [checksum(memoryview(memory)[o:o + n]) for o, n in zip(layout.offsets, layout.nbytes, strict=True)]
    memory[layout.checks_off:layout.layout_off] = np.array(sums, dtype=np.uint64).tobytes()
    memory[layout.layout_off:] = document
    info = SlotInfo(index=0, seq=4, state=SlotState.COMPLETE, step=step, round=1, rank=1, world=2,
                    data_bytes=layout.data_bytes, n_tensors=layout.n_tensors, checks_off=layout.checks_off,
                    layout_off=layout.layout_off, layout_len=len(document), layout_sum=checksum(document), gen=1,
                    capacity=len(memory), checks_seq=4, verify_seq=0, verify_state=VerifyState.NONE)
    return info, memory


def _send(server: ReplicaServer, slot: SlotInfo, memory: bytearray, **kw: object) -> None:
    push(server.address, token=_TOKEN, job=_JOB, tls=None, meta=ReplicaMeta.of_slot(slot), source=memoryview(memory),
         intact=lambda: True, timeout_s=5.0, **kw)  # type: ignore[arg-type]


def _held_bytes(server: ReplicaServer, rank: int = 1) -> tuple[int, bytes]:
    held = server.held[rank]
    return held.meta.step, bytes(held.view[:held.meta.nbytes])


_SIZES = [3 << 20, 40, 11 << 20, 0, 5 << 20]  # (the middle one spans two pieces and several checks)


def test_a_tensor_damaged_in_the_middle_of_the_stream_is_refused_and_the_previous_replica_kept(
        holder: ReplicaServer) -> None:
    first, first_bytes = _slot(1, _SIZES)
    _send(holder, first, first_bytes)
    second, damaged = _slot(2, _SIZES, seed=1)
    damaged[second.data_bytes // 2] ^= 0x10  # inside the third tensor, mid-stream
    with pytest.raises(ReplicaError, match=r"1 of 5 tensors fail their checksums \(first: tensor 2\)"):
        _send(holder, second, damaged)
    assert _held_bytes(holder) == (1, bytes(first_bytes))


def test_a_replica_and_its_fetch_arrive_checked_tensor_by_tensor_and_whole(holder: ReplicaServer) -> None:
    slot, memory = _slot(3, _SIZES)
    _send(holder, slot, memory)
    assert _held_bytes(holder) == (3, bytes(memory))
    got = bytearray(len(memory) + 4096)
    meta = fetch(holder.address, token=_TOKEN, job=_JOB, tls=None, rank=1, step=3, round_=1,
                 into=lambda _meta: memoryview(got), timeout_s=5.0)
    assert meta == ReplicaMeta.of_slot(slot) and got[:len(memory)] == memory


def test_a_sender_that_stops_mid_stream_leaves_the_previous_replica_and_the_holder_serving(
        holder: ReplicaServer) -> None:
    first, first_bytes = _slot(1, _SIZES)
    _send(holder, first, first_bytes)
    second, second_bytes = _slot(2, _SIZES, seed=1)

    def vanish(upto: int) -> None:
        if upto > len(second_bytes) // 2:
            raise ReplicaError("the sender went away")

    with pytest.raises(ReplicaError, match="the sender went away"):
        _send(holder, second, second_bytes, ready=vanish)
    assert _held_bytes(holder) == (1, bytes(first_bytes))
    _send(holder, second, second_bytes)  # the holder took the next one in the half-written buffer
    assert _held_bytes(holder) == (2, bytes(second_bytes))
    assert len(holder.names.all_mine()) == 2  # double-buffered: no segment left by the broken transfer


def test_a_layout_placing_tensors_outside_the_replica_s_data_is_refused_with_the_reason(
        holder: ReplicaServer) -> None:
    slot, memory = _slot(1, [1000])
    lying = dataclasses.replace(slot, data_bytes=500)
    with pytest.raises(ReplicaError, match="places tensors beyond its 500 bytes of tensor data"):
        _send(holder, lying, memory)  # (told why: the holder read the rest before it answered)
    assert holder.held == {}


class _Rank:
    """One local rank's memory as the sender sees it (its control block too): its slot, and whether the worker keeps
    it or began to rewrite it."""

    def __init__(self, info: SlotInfo, memory: bytearray, *, kept: bool) -> None:
        self.local_rank, self.round, self.info, self.memory = 0, info.round, info, memory
        self.rewritten = self.gone = False
        self.control = self
        self.kept = ((-1, -1), (info.step, info.round) if kept else (-1, -1))

    def mapping(self, info: SlotInfo, names: SegmentNames) -> bytearray:
        if self.gone:
            raise CheckpointError("shared-memory segment x is gone; its agent has exited or restarted")
        return self.memory

    def slot(self, index: int) -> SlotInfo:
        return dataclasses.replace(self.info, seq=self.info.seq + (1 if self.rewritten else 0))


def _sender(tmp_path: Path) -> PeerReplicas:
    return PeerReplicas(ckpt=CheckpointSettings(dir=str(tmp_path)), settings=Settings.from_mapping({}),
                        names=SegmentNames(prefix="stead-ckpt-test-sender-", incarnation=1), token=_TOKEN, job=_JOB,
                        master_address="127.0.0.1:1", new_gen=lambda: 1)


@pytest.mark.parametrize("kept", [True, False], ids=["kept-sent-from-the-slot", "copied-as-it-is-sent"])
def test_a_node_sends_its_slot_whole_straight_from_it_while_kept_else_from_a_copy(
        tmp_path: Path, holder: ReplicaServer, kept: bool) -> None:
    slot, memory = _slot(4, _SIZES)
    sender = _sender(tmp_path)
    target = PeerCopy(node_id="node-0", address=holder.address)
    assert sender._push(_Rank(slot, memory, kept=kept), slot, target)  # type: ignore[arg-type]
    assert _held_bytes(holder) == (4, bytes(memory))
    assert bool(sender._buffers) is not kept  # a kept slot needs no copy


@pytest.mark.parametrize("kept", [True, False], ids=["kept-sent-from-the-slot", "copied-as-it-is-sent"])
def test_a_slot_rewritten_while_it_was_read_is_never_put_in_place(
        tmp_path: Path, holder: ReplicaServer, kept: bool) -> None:
    first, first_bytes = _slot(1, _SIZES)
    _send(holder, first, first_bytes)
    slot, memory = _slot(2, _SIZES, seed=1)
    rank = _Rank(slot, memory, kept=kept)
    rank.rewritten = True  # a save began in the slot after the sender read its description
    sender = _sender(tmp_path)
    assert not sender._push(rank, slot, PeerCopy(node_id="node-0", address=holder.address))  # type: ignore[arg-type]
    assert _held_bytes(holder) == (1, bytes(first_bytes))


def test_a_slot_whose_memory_cannot_be_copied_is_not_sent_and_the_sender_says_why(
        tmp_path: Path, holder: ReplicaServer) -> None:
    slot, memory = _slot(1, _SIZES)
    rank = _Rank(slot, memory, kept=False)
    rank.gone = True
    sender = _sender(tmp_path)
    with capture_logs() as logs:
        assert not sender._push(rank, slot, PeerCopy(node_id="node-0", address=holder.address))  # type: ignore[arg-type]
    assert holder.held == {}
    assert [e["error"] for e in logs if e["event"] == "ckpt_replica_not_sent"] == [
        "rank 1's slot could not be copied (shared-memory segment x is gone; its agent has exited or restarted)"]


def test_a_holder_that_goes_away_mid_fetch_is_an_error_naming_how_far_it_came() -> None:
    slot, memory = _slot(1, _SIZES)
    meta = ReplicaMeta.of_slot(slot)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def holder_that_dies() -> None:
            conn, _ = server.accept()
            with conn, conn.makefile("rb") as lines:
                conn.sendall(f"{_GREETING} 0123\n".encode())
                client_nonce = lines.readline().decode().split(" ")[0]
                conn.sendall(f"{_proof(_TOKEN, 'server', _JOB, '0123', client_nonce)}\n".encode())
                lines.readline()  # the request
                conn.sendall((json.dumps({"ok": True, "meta": meta.to_json()}) + "\n").encode())
                conn.sendall(memory[slot.checks_off:])  # the checksums and layout, then half the tensors
                conn.sendall(memory[:slot.data_bytes // 2])

        thread = threading.Thread(target=holder_that_dies)
        thread.start()
        got = bytearray(len(memory))
        with pytest.raises(ReplicaError, match=rf"closed the connection after {slot.data_bytes // 2} of "
                                               rf"{slot.checks_off} bytes"):
            fetch(f"127.0.0.1:{port}", token=_TOKEN, job=_JOB, tls=None, rank=1, step=1, round_=1,
                  into=lambda _meta: memoryview(got), timeout_s=5.0)
        thread.join()
