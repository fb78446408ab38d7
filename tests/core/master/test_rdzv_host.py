"""The rendezvous host process against what a local process without the token can do to it, and its masters."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import psutil
import pytest
from structlog.testing import capture_logs

from stead.core.config import Settings
from stead.core.errors import StoreError
from stead.core.master import rdzv_host
from stead.core.master.rdzv_host import HOST, MASTER, PROTOCOL, TOKEN_ENV, new_nonce, proof
from stead.core.master.rdzv_stores import RoundStores
from stead.core.store import StateStore, open_store

pytestmark = pytest.mark.anyio

TOKEN = "the-job-token-7f3a9c1e5b2d4068"
JOB = "rdzv"
RECORD_KEY = f"/stead/jobs/{JOB}/rdzv-host"
#: how long a test waits for something that should come (a bound against hanging, not a measured time)
WAIT_S = 30.0


@contextlib.contextmanager
def host_process(*, gone_timeout_s: float = WAIT_S, auth_timeout_s: float = WAIT_S,
                 max_pending: int = 16) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A rendezvous host process on loopback, started as a master starts it, and its control port."""
    process = subprocess.Popen(
        [sys.executable, "-P", rdzv_host.__file__, "127.0.0.1", str(gone_timeout_s), str(auth_timeout_s),
         str(max_pending)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env={**os.environ, TOKEN_ENV: TOKEN})
    assert process.stdout is not None
    try:
        yield process, int(process.stdout.read())
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


class Peer:
    """A plain socket client of a host's control socket: a master's side done by hand, or a stranger's."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.hello = self.line()  # read: the host took the connection

    def line(self) -> str:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.sock.recv(1)
            if not chunk:
                break
            data += chunk
        return data.decode()

    def send(self, text: str) -> None:
        self.sock.sendall(text.encode())

    def prove(self, token: str = TOKEN, address: str = "") -> str:
        """Answer the host's challenge; what the host answers."""
        host_nonce = self.hello.split()[2]
        mine = new_nonce()
        self.send(f"PROOF {mine} {proof(token, MASTER, address or f'127.0.0.1:{self.port}', host_nonce, mine)}\n")
        answer = self.line()
        assert answer == f"PROOF {proof(token, HOST, f'127.0.0.1:{self.port}', host_nonce, mine)}\n"
        return answer

    def ask(self, request: str) -> str:
        self.send(request + "\n")
        return self.line().rstrip("\n")

    def rest(self) -> bytes:
        """Everything the host sends until it closes the connection."""
        data = b""
        with contextlib.suppress(ConnectionResetError):  # it closed with what we sent unread
            while chunk := self.sock.recv(4096):
                data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def peer(port: int, *, proven: bool = False) -> Iterator[Peer]:
    client = Peer(port)
    try:
        if proven:
            client.prove()
        yield client
    finally:
        client.close()


@contextlib.asynccontextmanager
async def job_store() -> AsyncIterator[StateStore]:
    store = await open_store("memory://")
    try:
        yield store
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def master(store: StateStore, *,
                 auth_timeout_s: float = Settings.rdzv_host_auth_timeout_s) -> AsyncIterator[RoundStores]:
    """A master's side of the job's rendezvous host (the one on record, or one it starts)."""
    rounds = RoundStores("127.0.0.1", enabled=True, gone_timeout_s=WAIT_S, auth_timeout_s=auth_timeout_s)
    try:
        await rounds.start(store, JOB, TOKEN)
        yield rounds
    finally:
        await rounds.close()


async def record(store: StateStore, pid: int, port: int) -> None:
    """What a master that crashed left in the store about its host process."""
    await store.put(RECORD_KEY, json.dumps({"pid": pid, "host": "127.0.0.1", "port": port}).encode())


async def recorded(store: StateStore) -> dict[str, int]:
    found = await store.get(RECORD_KEY)
    assert found is not None
    about: dict[str, int] = json.loads(found.value)
    return about


def test_replies_repeat_their_request_s_id_and_exit_ends_the_host() -> None:
    with host_process() as (process, port), peer(port, proven=True) as client:
        first = client.ask("7 ROUND 1")
        assert first.startswith("7 PORT ")
        assert client.ask("8 ROUND 1") == f"8 {first[2:]}"  # the same store when asked again
        assert client.ask("9 ROUND 2").startswith("9 PORT ") and client.ask("9 ROUND 2") != f"9 {first[2:]}"
        assert client.ask("10 JUMP").startswith("10 ERROR unknown request")
        assert client.ask("ROUND 3").startswith("- ERROR a request starts with its id")
        assert client.ask("11 EXIT") == "11 BYE"
        assert process.wait(WAIT_S) == 0


async def test_an_idle_connection_without_the_token_opened_first_does_not_block_a_master() -> None:
    with host_process() as (process, port), peer(port):  # a stranger connects first and says nothing
        async with job_store() as store:
            await record(store, process.pid, port)
            async with master(store) as rounds:
                assert (await rounds.for_round(1))[1] > 0
                assert await recorded(store) == {"pid": process.pid, "host": "127.0.0.1", "port": port}
            assert process.wait(WAIT_S) == 0  # and its close still ends the host


def test_a_line_without_a_newline_is_cut_off_at_its_bound_and_the_host_does_not_hold_it() -> None:
    with host_process() as (process, port), peer(port, proven=True) as client:
        assert client.ask("1 ROUND 1").startswith("1 PORT ")  # torch is imported: the host's memory is settled
        before = psutil.Process(process.pid).memory_info().rss
        sent, chunk = 0, b"x" * (1 << 20)
        with peer(port) as flood, pytest.raises(OSError):  # the host closes the connection: the sender sees it
            while sent < 300 << 20:
                flood.sock.sendall(chunk)
                sent += len(chunk)
        assert sent < 300 << 20
        assert psutil.Process(process.pid).memory_info().rss - before < 64 << 20
        assert client.ask("2 ROUND 1").startswith("2 PORT ")  # and it still serves its master


@pytest.mark.parametrize("wrong", ["another token", "another host's address", "the old TOKEN line"])
def test_a_client_whose_proof_is_wrong_is_closed_before_anything_else_is_read(wrong: str) -> None:
    with host_process() as (process, port), peer(port) as client:
        assert client.hello.startswith(f"HELLO {PROTOCOL} ")
        host_nonce, mine = client.hello.split()[2], new_nonce()
        if wrong == "the old TOKEN line":
            client.send(f"TOKEN {TOKEN}\n1 ROUND 1\n")
        else:
            token, address = ("not-the-token", f"127.0.0.1:{port}") if wrong == "another token" else (
                TOKEN, f"127.0.0.1:{port + 1}")  # a relay to another host of the job: its MAC is for the other
            client.send(f"PROOF {mine} {proof(token, MASTER, address, host_nonce, mine)}\n1 ROUND 1\n")
        assert client.rest() == b""  # no proof of the host's, no reply: closed
        assert process.poll() is None


def test_a_connection_that_does_not_prove_the_token_in_time_is_closed_but_a_master_may_stay_idle() -> None:
    auth_timeout_s = 2.0
    with host_process(auth_timeout_s=auth_timeout_s) as (_, port), peer(port, proven=True) as client:
        with peer(port) as stranger:
            assert stranger.rest() == b""  # its deadline passed: the master's, had it one, passed before it
        time.sleep(auth_timeout_s)  # and a whole timeout more, for the host's thread of the master's connection
        assert client.ask("1 ROUND 1").startswith("1 PORT ")


def test_past_the_bound_of_unproven_connections_the_oldest_is_closed_and_a_master_still_gets_in() -> None:
    deadline_s = 4 * WAIT_S  # the oldest is closed long before its deadline
    with host_process(max_pending=2, auth_timeout_s=deadline_s) as (_, port), peer(port) as oldest, peer(port), \
            peer(port):
        assert oldest.rest() == b""
        with peer(port, proven=True) as client:
            assert client.ask("1 ROUND 1").startswith("1 PORT ")


def test_the_host_lives_while_a_master_is_connected_and_unproven_connections_do_not_keep_it() -> None:
    gone_timeout_s = 1.0
    with host_process(gone_timeout_s=gone_timeout_s) as (process, port), peer(port):
        with peer(port, proven=True):
            time.sleep(2 * gone_timeout_s)  # a host that did not count its master would be gone after one
            assert process.poll() is None
        assert process.wait(WAIT_S) == 0  # the stranger's connection is still open


def test_a_host_started_without_the_job_token_refuses_to_run() -> None:
    environ = {name: value for name, value in os.environ.items() if name != TOKEN_ENV}
    done = subprocess.run([sys.executable, "-P", rdzv_host.__file__, "127.0.0.1", "1", "1", "1"],
                          capture_output=True, env=environ, timeout=WAIT_S, check=False)
    assert done.returncode == 2 and TOKEN_ENV.encode() in done.stderr and done.stdout == b""


class Squatter:
    """A plain socket server that took a dead host's port: it records all it is sent, and either says nothing,
    greets like a host and answers the master's proof with a made-up one, or floods the master with one line."""

    def __init__(self, port: int, behaviour: str) -> None:
        self.behaviour = behaviour
        self.received = b""
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", port))
        self.server.listen()
        self.server.settimeout(WAIT_S)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError), self.server.accept()[0] as conn:
            conn.settimeout(WAIT_S)
            if self.behaviour == "greets":
                conn.sendall(f"HELLO {PROTOCOL} {new_nonce()}\n".encode())
            elif self.behaviour == "floods":
                conn.sendall(b"H" * (8 << 20))
            elif self.behaviour == "hangs up":
                return
            while chunk := conn.recv(4096):
                self.received += chunk
                if self.behaviour == "greets" and b"\n" in self.received and chunk.endswith(b"\n"):
                    conn.sendall(b"PROOF " + b"0" * 64 + b"\n")

    def close(self) -> None:
        self.thread.join(WAIT_S)
        self.server.close()


@pytest.mark.parametrize("behaviour", ["is silent", "greets", "floods", "hangs up"])
async def test_a_process_on_the_recorded_port_that_fails_the_proof_is_refused_learns_no_token_and_a_new_host_starts(
        behaviour: str) -> None:
    async with job_store() as store:
        with host_process() as (process, port):
            await record(store, process.pid, port)
            process.kill()  # the master and its host are gone; a local user binds the host's port
            process.wait()
        squatter = Squatter(port, behaviour)
        try:
            with capture_logs() as logs:
                async with master(store, auth_timeout_s=2.0) as rounds:
                    assert await recorded(store) != {"pid": process.pid, "host": "127.0.0.1", "port": port}
                    host, store_port = await rounds.for_round(1)
                    assert (host, store_port) != ("127.0.0.1", port)
        finally:
            squatter.close()
    assert TOKEN.encode() not in squatter.received
    assert b"ROUND" not in squatter.received and b"EXIT" not in squatter.received
    if behaviour == "greets":
        assert squatter.received.startswith(b"PROOF ")  # it answered the challenge, with a MAC, not the token
    refused = [entry for entry in logs if entry["event"] == "rdzv_host_refused"]
    assert len(refused) == 1 and refused[0]["log_level"] == "warning"
    assert refused[0]["address"] == f"127.0.0.1:{port}"
    assert "not the job's rendezvous host" in refused[0]["meaning"]
    assert [entry["event"] for entry in logs if entry["log_level"] in ("error", "critical")] == []


#: a stand-in for the job's host that a flood of connections keeps from serving: it closes every connection at once
#: (as the host closes the oldest unproven one), and its command line names the host's module, as the host's does
_SWAMPED_HOST = """
import socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    server.accept()[0].close()
"""


@contextlib.contextmanager
def swamped_host() -> Iterator[tuple[int, int]]:
    """(pid, port) of a running stand-in for a swamped host (see _SWAMPED_HOST)."""
    swamped = subprocess.Popen([sys.executable, "-c", _SWAMPED_HOST, rdzv_host.__file__], stdout=subprocess.PIPE)
    try:
        assert swamped.stdout is not None
        yield swamped.pid, int(swamped.stdout.readline())
    finally:
        swamped.kill()
        swamped.wait()
        if swamped.stdout is not None:
            swamped.stdout.close()


async def test_a_recorded_host_that_runs_but_keeps_closing_the_master_s_connection_is_not_replaced() -> None:
    """Starting a second host would give the nodes of one round two different stores: the master says what
    keeps it out instead."""
    with swamped_host() as (pid, port):
        async with job_store() as store:
            await record(store, pid, port)
            with capture_logs() as logs, \
                    pytest.raises(StoreError, match=rf"pid {pid}.*runs but closed every connection.*flooding"):
                async with master(store, auth_timeout_s=1.0) as rounds:
                    await rounds.for_round(1)
    events = [entry["event"] for entry in logs]
    assert "rdzv_host_proof_retried" in events
    assert "rdzv_host_started" not in events and "rdzv_host_refused" not in events


async def test_a_reply_that_comes_after_its_request_was_given_up_is_never_taken_for_a_later_one() -> None:
    async with job_store() as store, master(store) as rounds:
        about = await recorded(store)
        os.kill(about["pid"], signal.SIGSTOP)  # the host cannot answer: the request is given up (as an effect
        try:  # that runs past effect_timeout_s is), its bytes already sent
            with pytest.raises(TimeoutError), anyio.fail_after(1):
                await rounds.for_round(1)
        finally:
            os.kill(about["pid"], signal.SIGCONT)  # now it answers round 1, on the connection given up
        round_2 = await rounds.for_round(2)
        round_1 = await rounds.for_round(1)
        with peer(about["port"], proven=True) as other:  # what the host itself says
            assert other.ask("1 ROUND 2") == f"1 PORT {round_2[1]}"
            assert other.ask("2 ROUND 1") == f"2 PORT {round_1[1]}"


async def test_the_host_serves_two_masters_at_once() -> None:
    async with job_store() as store, master(store) as first:
        assert (await first.for_round(1))[1] > 0
        async with master(store) as second:  # a new master while the old one still holds its connection
            assert await second.for_round(2) == await first.for_round(2)
            assert await first.for_round(3) == await second.for_round(3)


async def test_a_host_on_record_at_another_master_s_address_is_not_dialled_and_one_starts_here() -> None:
    """An elected master on another machine recorded it (`--rdzv-backend etcd`): that machine may be gone, and
    the rounds this master starts are served from its own address anyway."""
    async with job_store() as store:
        await store.put(RECORD_KEY, json.dumps({"pid": 1, "host": "10.77.0.1", "port": 9}).encode())
        with capture_logs() as logs:
            async with master(store) as rounds:
                host, _ = await rounds.for_round(1)
                assert host == "127.0.0.1" and str((await recorded(store))["host"]) == "127.0.0.1"
    events = [entry["event"] for entry in logs]
    assert "rdzv_host_elsewhere" in events and "rdzv_host_gone" not in events and "rdzv_host_started" in events
