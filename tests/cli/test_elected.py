"""The election of a job's master among its hosts (stead.cli.elected), against a real etcd: one candidate wins,
a lost lease kills its master, the next one takes the job over, the job's end reaches every candidate, and the
proxy follows the master where it moves. The masters here are a small stand-in (``master_command``) that records
how it was started and exits as the test says."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stead.cli.elected import Candidate, Leader, LeaderView, MasterProxy, leader_key
from stead.cli.run_args import parse_run_args
from stead.core.procs import is_alive
from stead.core.runspec import RunConfig
from stead.core.store import StateStore, open_store
from stead.core.store.etcd import EtcdStore

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]

#: a master: records its pid, whether it takes over and the socket it got, then exits with exit-N's code
FAKE_MASTER = """
import os, pathlib, socket, sys, time
folder = pathlib.Path(sys.argv[1])
n = len(list(folder.glob("master-*")))
fd = int(os.environ["STEAD_MASTER_LISTEN_FD"])
port = socket.socket(fileno=os.dup(fd)).getsockname()[1]
# written whole, then named (a test reading the folder never sees a file half written)
(folder / f".master-{n}").write_text(f"{os.getpid()} {os.environ.get('STEAD_MASTER_TAKEOVER', '-')} {port}")
(folder / f".master-{n}").rename(folder / f"master-{n}")
code = folder / f"exit-{n}"
while not code.exists():
    time.sleep(0.02)
sys.exit(int(code.read_text()))
"""


@dataclasses.dataclass(frozen=True)
class _Lease:
    """A lease by its id (the candidate's, read from the key)."""

    id: int
    ttl_s: float


def _config(etcd_url: str, job: str, *more: str) -> RunConfig:
    return parse_run_args(["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                           etcd_url.removeprefix("etcd://"), "--rdzv-id", job, "--set", "heartbeat_timeout_s=2",
                           *more, str(REPO / "examples" / "train.py")])


@contextlib.asynccontextmanager
async def _candidate(config: RunConfig, folder: Path) -> AsyncIterator[tuple[Candidate, asyncio.Task[int]]]:
    """A candidate campaigning (its view following the key), on a store of its own, as on a host of its own."""
    store = await open_store(config.store_url, settings=config.settings)
    view = LeaderView(store, config.job_name, config.settings)
    script = folder / "master.py"
    script.write_text(FAKE_MASTER)
    candidate = Candidate(config, [], token="t0ken", view=view, host="127.0.0.1",
                          master_command=[sys.executable, str(script), str(folder)])
    follow = asyncio.create_task(view.follow())
    campaign = asyncio.create_task(candidate.run())
    try:
        yield candidate, campaign
    finally:
        for task in (campaign, follow):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await store.close()


async def _until(predicate: object, what: str, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 (another process writes the files)
            await asyncio.sleep(0.02)


def _masters(folder: Path) -> list[tuple[int, str, int]]:
    found = []
    for path in sorted(folder.glob("master-*"), key=lambda p: int(p.name.split("-")[1])):
        pid, takeover, port = path.read_text().split()
        found.append((int(pid), takeover, int(port)))
    return found


async def _leader(store: StateStore, job: str) -> tuple[Leader | None, int | None]:
    found = await store.get(leader_key(job))
    return (Leader.decode(found.value), found.lease) if found else (None, None)


async def test_one_candidate_is_elected_and_the_job_s_end_reaches_every_candidate(
        etcd_url: str, tmp_path: Path) -> None:
    config = _config(etcd_url, "one-of-two")
    folder = tmp_path / "masters"
    folder.mkdir()
    async with _candidate(config, folder) as (first, one), _candidate(config, folder) as (second, two):
        await _until(lambda: _masters(folder), "a master")
        await asyncio.sleep(0.5)  # (a second master would have started by now)
        [(pid, takeover, port)] = _masters(folder)
        assert takeover == "-"  # the first master of this run submits the job
        assert [first.serving, second.serving].count(True) == 1
        leader, lease = await _leader(first.view.store, config.job_name)
        assert leader == Leader(address=f"127.0.0.1:{port}", host=socket.gethostname()) and lease
        with socket.create_connection(("127.0.0.1", port)):  # the master's socket, bound by its candidate
            pass
        (folder / "exit-0").write_text("0")  # the job succeeded
        assert await asyncio.wait_for(one, 20) == 0
        assert await asyncio.wait_for(two, 20) == 0
        leader, lease = await _leader(first.view.store, config.job_name)
        assert leader == Leader(ended=0) and lease is None  # said without the lease: it outlives the hosts
    assert len(_masters(folder)) == 1 and not is_alive(pid)


async def test_a_candidate_that_loses_its_lease_kills_its_master_and_the_next_master_takes_the_job_over(
        etcd_url: str, tmp_path: Path) -> None:
    config = _config(etcd_url, "fenced")
    folder = tmp_path / "masters"
    folder.mkdir()
    async with _candidate(config, folder) as (candidate, campaign):
        await _until(lambda: _masters(folder), "a master")
        [(pid, _, _)] = _masters(folder)
        _, lease = await _leader(candidate.view.store, config.job_name)
        assert lease is not None
        store = candidate.view.store
        assert isinstance(store, EtcdStore)
        await store.revoke_lease(_Lease(id=lease, ttl_s=2.0))  # as etcd does when it expires
        await _until(lambda: len(_masters(folder)) == 2, "a second master")
        assert not is_alive(pid)  # fenced: killed as its candidate lost the lease
        (second_pid, takeover, _) = _masters(folder)[1]
        assert takeover == "1"
        (folder / "exit-1").write_text("1")  # the job failed under the second master
        assert await asyncio.wait_for(campaign, 20) == 1
    assert not is_alive(second_pid)


async def test_a_master_that_crashes_is_followed_by_one_that_takes_the_job_over(
        etcd_url: str, tmp_path: Path) -> None:
    config = _config(etcd_url, "crashed")
    folder = tmp_path / "masters"
    folder.mkdir()
    (folder / "exit-0").write_text("70")  # EXIT_MASTER_CRASHED: it failed while the job ran
    (folder / "exit-1").write_text("130")  # the job stopped under the next one
    async with _candidate(config, folder) as (_, campaign):
        assert await asyncio.wait_for(campaign, 20) == 130
    assert [takeover for _, takeover, _ in _masters(folder)] == ["-", "1"]


async def test_a_host_whose_masters_keep_dying_stops_campaigning_after_master_max_restarts(
        etcd_url: str, tmp_path: Path) -> None:
    config = _config(etcd_url, "doomed", "--set", "master_max_restarts=1")
    folder = tmp_path / "masters"
    folder.mkdir()
    for n in range(3):
        (folder / f"exit-{n}").write_text("70")
    async with _candidate(config, folder) as (candidate, campaign):
        await _until(lambda: candidate.crashes == 2, "two masters dead")
        await asyncio.sleep(0.5)  # (a third would have started by now)
        assert len(_masters(folder)) == 2 and not campaign.done()


async def test_the_proxy_forwards_to_the_elected_master_and_follows_it_when_it_moves(
        etcd_url: str, tmp_path: Path) -> None:
    del tmp_path

    async def serve(name: bytes) -> asyncio.Server:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(100):
                writer.write(name + data)
                await writer.drain()
            writer.close()
        return await asyncio.start_server(answer, "127.0.0.1", 0)

    config = _config(etcd_url, "proxied")
    store = await open_store(config.store_url, settings=config.settings)
    view = LeaderView(store, config.job_name, config.settings)
    follow = asyncio.create_task(view.follow())
    one, two = await serve(b"one:"), await serve(b"two:")
    try:
        async with MasterProxy(view, "127.0.0.1") as proxy:
            host, port = proxy.address.split(":")
            reader, writer = await asyncio.open_connection(host, int(port))  # before any master: it waits
            writer.write(b"hello")
            await store.put(view.key, Leader(f"127.0.0.1:{one.sockets[0].getsockname()[1]}").encode())
            assert await asyncio.wait_for(reader.read(100), 10) == b"one:hello"
            watcher = asyncio.create_task(_moves(view, proxy))
            await store.put(view.key, Leader(f"127.0.0.1:{two.sockets[0].getsockname()[1]}").encode())
            assert await asyncio.wait_for(reader.read(100), 10) == b""  # closed: it went to the old master
            writer.close()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"again")
            assert await asyncio.wait_for(reader.read(100), 10) == b"two:again"
            writer.close()
            watcher.cancel()
    finally:
        follow.cancel()
        for server in (one, two):
            server.close()
        await store.close()


async def _moves(view: LeaderView, proxy: MasterProxy) -> None:
    while True:
        address = view.address
        await view.wait_for(lambda v: v.address != address)  # noqa: B023 (awaited in the same iteration)
        proxy.moved()


@pytest.mark.parametrize(("raw", "expected"), [
    (b'{"address": "10.0.0.1:5", "host": "h0"}', Leader("10.0.0.1:5", "h0")),
    (b'{"ended": 130}', Leader(ended=130)),
    (b"not json", None),
    (b'{"ended": "x"}', None),
    (b'{"host": "h0"}', None),
    (b"[1]", None),
])
def test_the_leader_key_s_value_is_read_as_stead_wrote_it_or_not_at_all(raw: bytes, expected: Leader | None) -> None:
    assert Leader.decode(raw) == expected
    if expected is not None:
        assert Leader.decode(expected.encode()) == expected
