"""The hosts platform's placement and refusals, without processes: this host's node on a recording platform, the
other hosts as offers whose command streams are read here."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from pathlib import Path

import pytest

from stead.cli.run_args import parse_run_args
from stead.core.errors import ConfigError
from stead.core.events import NodeExited, NodePending, NodeStarted, RoomFound
from stead.core.platform import NodeSpec
from stead.core.runspec import RunConfig
from stead.platforms.hosts import HostsPlatform, _platform, job_shape, shape_mismatch, static_rank
from stead.platforms.hosts._proto.stead.hosts import v1 as proto
from stead.testing.platforms import RecordingPlatform

pytestmark = pytest.mark.anyio

SHAPE = proto.JobShape(job="j", rdzv_id="j", min_nodes=2, max_nodes=3, nproc_per_node=1,
                       entrypoint=["", "train.py", "--steps", "10"], rdzv_backend="c10d")


def spec(node_id: str, incarnation: int = 1) -> NodeSpec:
    return NodeSpec(job="j", node_id=node_id, incarnation=incarnation, command=("agent",))


def offer(launcher: str, *, rank: int = -1, shape: proto.JobShape = SHAPE, running: tuple[str, ...] = ()
          ) -> proto.HostOffer:
    return proto.HostOffer(shape=shape, host=f"host-{launcher}", address=f"10.0.0.{len(launcher)}", node_rank=rank,
                           launcher_id=launcher,
                           running=[proto.RunningNode(node_id=n, incarnation=1) for n in running])


def platform(*, static: bool = False, local_rank: int | None = None, pending_after_s: float = 60.0
             ) -> tuple[HostsPlatform, RecordingPlatform]:
    local = RecordingPlatform()
    shape = dataclasses.replace(SHAPE, rdzv_backend="static" if static else "c10d")
    return HostsPlatform(local=local, shape=shape, local_rank=local_rank, static=static, host_name="h0",
                         keepalive_s=60.0, pending_after_s=pending_after_s, ended_wait_s=0.0), local


def launched(hosts: HostsPlatform, launcher: str) -> list[tuple[str, int]]:
    """What the master told that host to launch so far (its stream's queued commands, read here)."""
    queue = hosts._hosts[launcher].commands
    found = []
    while not queue.empty():
        command = queue.get_nowait()
        if command is not None and command.launch is not None:
            found.append((command.launch.node_id, command.launch.incarnation))
    return found


async def test_c10d_this_host_takes_the_first_node_offered_hosts_the_rest_and_a_spare_the_lost_one() -> None:
    hosts, local = platform()
    async with hosts:
        await hosts.launch(spec("node-0"))
        await hosts.launch(spec("node-1"))  # no host yet: it waits
        assert local.launches == [("node-0", 1)]
        for launcher in ("a", "b"):
            host, why = hosts.offer(offer(launcher))
            assert host is not None, why
        await hosts.placed()
        assert (launched(hosts, "a"), launched(hosts, "b")) == ([("node-1", 1)], [])  # b is a spare
        # node-1's host lost: its relaunch goes to the spare at once, never back to a host that still holds a node
        await hosts.kill("node-1", 1)
        await hosts.launch(spec("node-1", 2))
        assert (launched(hosts, "a"), launched(hosts, "b")) == ([], [("node-1", 2)])


async def test_a_node_never_goes_to_a_host_it_must_avoid_or_a_barred_one() -> None:
    hosts, local = platform()
    async with hosts:
        await hosts.launch(spec("node-0"))  # this host's
        for launcher in ("a", "b", "c"):
            host, why = hosts.offer(offer(launcher))
            assert host is not None, why
        hosts.bar("host-b", "drained", lost=False)
        await hosts.launch(dataclasses.replace(spec("node-1", 2), avoid_hosts=("host-a",)))  # excluded as faulty
        assert (launched(hosts, "a"), launched(hosts, "b"), launched(hosts, "c")) == ([], [], [("node-1", 2)])
        await hosts.launch(dataclasses.replace(spec("node-2"), avoid_hosts=("host-a",)))  # no host left for it
        assert (launched(hosts, "a"), launched(hosts, "b")) == ([], [])
    assert local.launches == [("node-0", 1)]


async def test_an_elected_master_runs_no_node_and_its_own_host_gets_one_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_platform, "HOME_LAST_S", 0.3)
    local = RecordingPlatform()
    hosts = HostsPlatform(local=local, shape=SHAPE, local_rank=None, static=False, host_name="h0", keepalive_s=60.0,
                          pending_after_s=60.0, ended_wait_s=0.0, home="10.0.0.4")  # (offer("home")'s address)
    async with hosts:
        for launcher in ("home", "a"):  # the master's own host offers itself first, as it does
            assert hosts.offer(offer(launcher))[0] is not None
        await hosts.launch(spec("node-0"))
        await hosts.launch(spec("node-1"))
        assert (local.launches, launched(hosts, "a"), launched(hosts, "home")) == ([], [("node-0", 1)], [])
        await asyncio.sleep(0.6)  # node-1 waited HOME_LAST_S for another host: the master's host takes it
        assert launched(hosts, "home") == [("node-1", 1)]
        assert await hosts.adopt(spec("node-2"), pid=os.getpid())  # a node of an earlier master: on a host
        assert local.adoptions == []


async def test_a_host_reports_its_node_and_is_free_again_once_its_node_exited() -> None:
    hosts, _ = platform()
    async with hosts:
        await hosts.launch(spec("node-0"))
        hosts.offer(offer("a"))
        await hosts.launch(spec("node-1"))
        assert launched(hosts, "a") == [("node-1", 1)]
        hosts.report(proto.NodeReport(launcher_id="a", node_id="node-1", incarnation=1, started=True, pid=7))
        hosts.report(proto.NodeReport(launcher_id="a", node_id="node-1", incarnation=1, exited=True, exit_code=1))
        hosts.report(proto.NodeReport(launcher_id="a", node_id="node-9", incarnation=1, started=True, pid=8))
        events = hosts._events
        assert events.get_nowait() == NodeStarted(node_id="node-1", incarnation=1, host="host-a", pid=7)
        assert events.get_nowait() == NodeExited(node_id="node-1", incarnation=1, exit_code=1)
        room = events.get_nowait()  # the host is free again: room for a node the job may have given up on
        assert isinstance(room, RoomFound) and "host-a" in room.reason and "node-1/1 exited" in room.reason
        assert events.empty()  # node-9 is not a node placed there: dropped
        await hosts.launch(spec("node-1", 2))
        assert launched(hosts, "a") == [("node-1", 2)]


async def test_static_ranks_go_to_their_hosts_and_a_node_without_its_host_is_reported_pending() -> None:
    static = dataclasses.replace(SHAPE, rdzv_backend="static", min_nodes=3)
    hosts, local = platform(static=True, local_rank=0, pending_after_s=0.0)
    hosts.shape = static
    async with hosts:
        hosts.offer(offer("two", rank=2, shape=static))
        for node in ("node-0", "node-1", "node-2"):
            await hosts.launch(spec(node))
        assert local.launches == [("node-0", 1)]
        assert launched(hosts, "two") == [("node-2", 1)]
        pending = hosts._events.get_nowait()
        assert isinstance(pending, NodePending) and pending.node_id == "node-1"
        assert "no host with --node-rank 1 is connected" in pending.reason
        hosts.offer(offer("one", rank=1, shape=static))
        await hosts.placed()
        assert launched(hosts, "one") == [("node-1", 1)]


@pytest.mark.parametrize(("theirs", "said"), [
    (dataclasses.replace(SHAPE, entrypoint=["", "train.py", "--steps", "11"]),
     "the script and its arguments: 'train.py --steps 11' here, 'train.py --steps 10' on the master's host"),
    (dataclasses.replace(SHAPE, min_nodes=3), "--nnodes: 3 here, 2:3 on the master's host"),
    (dataclasses.replace(SHAPE, job="k", rdzv_id="k"), "the job name (--job-name or --rdzv-id): 'k' here"),
    (dataclasses.replace(SHAPE, nproc_per_node=2), "--nproc-per-node: 2 here, 1 on the master's host"),
])
def test_a_host_that_means_another_job_is_told_what_differs(theirs: proto.JobShape, said: str) -> None:
    assert said in shape_mismatch(SHAPE, theirs)
    hosts, _ = platform()
    host, why = hosts.offer(offer("a", shape=theirs))
    assert host is None and said in why and "Run the same command on every host" in why


def test_two_hosts_claiming_one_static_rank_or_the_master_s_are_refused() -> None:
    static = dataclasses.replace(SHAPE, rdzv_backend="static")
    hosts, _ = platform(static=True, local_rank=0)
    hosts.shape = static
    assert hosts.offer(offer("a", rank=1, shape=static))[0] is not None
    host, why = hosts.offer(offer("b", rank=1, shape=static))
    assert host is None and "--node-rank 1 is held by host host-a" in why
    host, why = hosts.offer(offer("c", rank=0, shape=static))
    assert host is None and "--node-rank 0 is the master's host's (h0)" in why
    assert hosts.offer(offer("a", rank=1, shape=static))[0] is not None  # the same `stead run` again: taken


def _parse(tmp_path: Path, *argv: str) -> RunConfig:
    (tmp_path / "train.py").write_text("")
    return parse_run_args([*argv, "train.py", "--lr", "1"], environ={"PATH": os.defpath}, cwd=str(tmp_path))


def test_the_shape_names_the_script_not_the_interpreter(tmp_path: Path) -> None:
    assert static_rank("node-12") == 12 and static_rank("spare") is None
    config = _parse(tmp_path, "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1")
    shape = job_shape(config)
    assert list(shape.entrypoint) == ["", "train.py", "--lr", "1"] and shape.rdzv_backend == "static"
    assert config.hosts_endpoint == "10.0.0.1:29500" and config.platform == "hosts"


@pytest.mark.parametrize(("argv", "endpoint"), [
    (("--nnodes", "2"), ""),  # N nodes on this machine, as before
    (("--nnodes", "2", "--node-rank", "0"), "127.0.0.1:29500"),
    (("--nnodes", "3", "--master-addr", "fd00::1", "--master-port", "7000"), "[fd00::1]:7000"),
    (("--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0.example"), "node0.example:29400"),
    (("--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[fd00::2]:5"), "[fd00::2]:5"),
    (("--nnodes", "1:4", "--rdzv-backend", "c10d"), ""),
    (("--standalone", "--rdzv-endpoint", "h:1"), ""),
    # etcd: the etcd server every host's `stead run` campaigns at (its port 2379 by default)
    (("--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd0"), "etcd0:2379"),
    (("--nnodes", "1:3", "--rdzv-backend", "etcd-v2", "--store", "etcd://10.1.2.3:7/"), "10.1.2.3:7"),
    (("--nnodes", "2", "--rdzv-backend", "etcd"), ""),  # no etcd named: every node on this machine
])
def test_torchrun_multi_node_flags_name_where_the_master_serves(tmp_path: Path, argv: tuple[str, ...],
                                                               endpoint: str) -> None:
    assert _parse(tmp_path, *argv).hosts_endpoint == endpoint


@pytest.mark.parametrize(("argv", "said"), [
    (("--nnodes", "2:3", "--node-rank", "1"), "a static rendezvous over several hosts needs a fixed node count"),
    (("--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", "--store", "sqlite:///x.db"),
     "keeps the job in etcd, but --store is 'sqlite:///x.db'"),
    (("--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379", "--store", "etcd://g:2379"),
     "name different etcd servers"),
    (("--nnodes", "2", "--rdzv-backend", "zk", "--rdzv-endpoint", "h:1"), "is not one stead knows"),
    (("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:99999"), "is not HOST:PORT"),
    (("--nnodes", "2", "--node-rank", "1", "--platform", "k8s"), "--platform k8s starts the nodes itself"),
])
def test_multi_node_flags_that_cannot_mean_one_job_are_refused(tmp_path: Path, argv: tuple[str, ...],
                                                              said: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)):
        _parse(tmp_path, *argv)


async def test_a_host_back_from_a_partition_with_a_node_the_job_lost_is_told_to_kill_it() -> None:
    hosts, _ = platform()
    async with hosts:
        await hosts.launch(spec("node-0"))
        hosts.offer(offer("a"))
        await hosts.launch(spec("node-1"))
        assert launched(hosts, "a") == [("node-1", 1)]
        await hosts.kill("node-1", 1)  # lost: its host was cut off (the kill does not reach it)
        await hosts.launch(spec("node-1", 2))  # no host free: waits
        host, _ = hosts.offer(offer("a", running=("node-1",)))  # the link heals: the same `stead run` again
        assert host is not None
        first = host.commands.get_nowait()
        assert first is not None and first.kill == proto.Kill(node_id="node-1", incarnation=1)
        hosts.report(proto.NodeReport(launcher_id="a", node_id="node-1", incarnation=1, exited=True, signal=9))
        await hosts.placed()
        assert launched(hosts, "a") == [("node-1", 2)]  # then it runs the node anew


@pytest.mark.parametrize(("case", "reported"), [
    ("hung up, heard from lately", True),
    ("hung up, then offered itself again", False),
    ("hung up, not heard from for a while (cut off: the hang-up came as the link healed)", False),
    ("its stream closed by the master", False),
    ("hung up as the master leaves", False),
    ("hung up after its node was killed", False),
])
async def test_a_host_that_hangs_up_and_stays_away_has_its_node_reported_exited_at_once(
        case: str, reported: bool) -> None:
    hosts, _ = platform()
    hosts.hung_up_grace_s = 0.0
    async with hosts:
        await hosts.launch(spec("node-0"))
        host, _ = hosts.offer(offer("a"))
        assert host is not None
        await hosts.launch(spec("node-1"))
        assert launched(hosts, "a") == [("node-1", 1)]
        if case.startswith("hung up, not heard"):
            host.seen -= 3 * hosts.keepalive_s
        if case == "hung up after its node was killed":
            await hosts.kill("node-1", 1)
        if case == "hung up as the master leaves":
            hosts.detach()
        hosts.gone(host, hung_up=case != "its stream closed by the master")
        if case == "hung up, then offered itself again":
            hosts.offer(offer("a", running=("node-1",)))
        hosts._hung_up_nodes()
        hosts._hung_up_nodes()  # once only
        found = []
        while not hosts._events.empty():
            found.append(hosts._events.get_nowait())
        if not reported:
            assert found == []
            return
        assert len(found) == 1, found
        exited = found[0]
        assert isinstance(exited, NodeExited) and (exited.node_id, exited.incarnation) == ("node-1", 1)
        assert exited.exit_code is None and exited.reason.startswith("NodeLost: host host-a (10.0.0.1) hung up")
        await hosts.kill("node-1", 1)
        await hosts.launch(spec("node-1", 2))  # the host is gone: its node waits for another
        assert hosts._waiting.keys() == {("node-1", 2)}


async def test_a_hung_up_host_is_looked_at_again_as_its_grace_ends_not_at_the_next_placing_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_platform, "PLACE_LOOK_S", 3600.0)  # only the grace's own timer can report the node
    hosts, _ = platform()
    hosts.hung_up_grace_s = 0.05
    async with hosts:
        await hosts.launch(spec("node-0"))
        host, _ = hosts.offer(offer("a"))
        assert host is not None
        await hosts.launch(spec("node-1"))
        hosts.gone(host, hung_up=True)
        async with asyncio.timeout(30):
            while not isinstance(exited := await hosts._events.get(), NodeExited):
                pass
        assert isinstance(exited, NodeExited) and (exited.node_id, exited.incarnation) == ("node-1", 1)
