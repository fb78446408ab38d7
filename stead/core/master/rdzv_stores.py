"""The workers' rendezvous store: one torch TCPStore per round, in a process that outlives the master.

Workers connect to ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``)
instead of rank 0 hosting a store that dies with it; a fresh store per round
means no round ever reads a previous round's keys. The stores live in a small
process of their own (:mod:`stead.core.master.rdzv_host`), not in the master: a master
that is killed while a round's workers are still forming their process group
leaves their store running, and the next master finds the process through the
job's state store (``/stead/jobs/<job>/rdzv-host``) and goes on with it.

torch's TCPStore has no authentication, so each store listens only on the
master's own address (loopback when every node runs on this machine), never on
every interface as it does by default. The host process's control socket is
guarded: the master and the host prove to each other that they hold the job
token (an HMAC challenge both ways, drawn in :mod:`stead.core.master.rdzv_host`) before
the master sends anything else, so a process that took a dead host's recorded
port is refused, learns no token, and a new host is started in its place. Every
request carries an id that its reply repeats, and a request that fails or times
out drops its connection: the next one opens and proves a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import os
import signal
import subprocess
import sys

import structlog

from stead.core.config import Settings
from stead.core.errors import RetryableError, StoreError
from stead.core.events.log import job_prefix
from stead.core.master import rdzv_host
from stead.core.master.rdzv_host import HOST, MASTER, MAX_LINE_BYTES, PROTOCOL, TOKEN_ENV, is_nonce, new_nonce, proof
from stead.core.procs import cmdline, is_alive, let_go, signal_leader, wait_exit
from stead.core.retry import Backoff, retrying
from stead.core.store import StateStore

__all__ = ["HEALTH_STORE_ROUND", "RoundStores"]

log = structlog.get_logger("stead.tcpstore")

#: what a host process's command line holds (it runs the module's file: no `import stead` to wait for)
_HOST_MODULE = rdzv_host.__file__


#: the "round" whose store health checks use (rounds count from 1); its host keeps it for the whole job
HEALTH_STORE_ROUND = 0


class _NotTheHost(Exception):
    """Something answers at a rendezvous host's address but does not prove that it holds the job's token."""


class _BrokenOff(_NotTheHost):
    """The connection closed before the proof completed: a squatter that does not hold the token, or the job's
    host closing it as the oldest unproven one while other processes flood it with connections."""


class _HostLost(StoreError):
    """The connection to the rendezvous host broke off, or carried a reply that is not the request's: dropped."""


@dataclasses.dataclass
class _Channel:
    """A connection to the job's rendezvous host on which both sides proved they hold the job's token."""

    address: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class RoundStores:
    """The stores of each round, in the job's rendezvous host process; ``enabled=False`` hosts none (tests).

    ``await start(store, job, token)`` finds the job's running host process (one a dead master left) or starts
    one; ``close()`` ends it.
    """

    def __init__(self, host: str, *, enabled: bool, gone_timeout_s: float = 60.0, timeout_s: float = 60.0,
                 auth_timeout_s: float = Settings.rdzv_host_auth_timeout_s,
                 max_pending: int = Settings.rdzv_host_max_pending, settings: Settings | None = None) -> None:
        self.host = host
        #: the retries' backoff and deadline (retry_* settings)
        self._settings = settings or Settings()
        self.enabled = enabled
        #: the host process exits when no master has been connected for this long
        self.gone_timeout_s = gone_timeout_s
        #: how long a request to the host process (its start, a round's store, its exit) may take
        self.timeout_s = timeout_s
        #: how long the mutual proof may take, on either side (then the other side is not the job's)
        self.auth_timeout_s = auth_timeout_s
        #: how many connections that have not proven the token the host process holds at once
        self.max_pending = max_pending
        self._rounds: dict[int, tuple[str, int]] = {}
        self._latest: tuple[str, int] = (host, 0)
        #: the round's start effects run concurrently: every node of a round must get the same store
        self._lock = asyncio.Lock()
        self._state: tuple[StateStore, str, str] | None = None
        self._pid: int | None = None
        self._process: asyncio.subprocess.Process | None = None
        #: the host process's control socket, once it proved itself
        self._address: tuple[str, int] | None = None
        self._conn: _Channel | None = None
        self._last_id = 0

    @property
    def latest(self) -> tuple[str, int]:
        """The address of the newest store (what a registering agent is told)."""
        return self._latest

    async def start(self, store: StateStore, job: str, token: str) -> None:
        """Connect to the job's rendezvous host process, starting one when there is none."""
        self._state = (store, job, token)
        if self.enabled:
            async with self._lock:
                await self._connected()

    async def for_round(self, round_: int) -> tuple[str, int]:
        """The store of ``round_``, created on first ask (the same one when asked again)."""
        if not self.enabled:
            return self._latest
        async with self._lock:
            if round_ not in self._rounds:
                try:
                    port = await self._ask(round_)
                except _HostLost as exc:  # a new connection, to a new host process if this one died
                    log.warning("rdzv_host_lost", error=str(exc), action="asking again on a new connection")
                    port = await self._ask(round_)
                self._rounds[round_] = (self.host, port)
            address = self._rounds[round_]
            for old in sorted(r for r in self._rounds if r != HEALTH_STORE_ROUND)[:-2]:
                del self._rounds[old]  # the newest round's, the one before, and the health checks' stay
            if round_ != HEALTH_STORE_ROUND and round_ == max(self._rounds):
                self._latest = address
            return address

    async def close(self) -> None:
        """End the host process (its stores with it) and forget it."""
        if not self.enabled or self._state is None:
            return
        async with self._lock:
            with contextlib.suppress(StoreError, _NotTheHost, OSError, TimeoutError):
                if self._conn is None and self._address is not None:  # a request that failed dropped it
                    self._conn = await self._open(*self._address, self._state[2])
                if self._conn is not None:
                    await self._request("EXIT", expect="BYE")
            self._drop_connection()
            await self._wait_gone()
            store, job, _ = self._state
            with contextlib.suppress(RetryableError, StoreError):
                await store.delete(_record_key(job))

    def leave(self) -> None:
        """Let go of the host process without ending it (this master fails; the next one finds it in the store
        and goes on with its stores, which the running round's workers use)."""
        self._drop_connection()
        if self._process is not None:
            let_go(self._process)
        self._pid = self._process = None

    # -- the host process ------------------------------------------------------------

    async def _ask(self, round_: int) -> int:
        reply = await self._request(f"ROUND {round_}", expect="PORT")
        if not (reply.isascii() and reply.isdigit() and 0 < int(reply) < 65536):
            raise self._lost(f"answered PORT {reply[:40]!r} for round {round_}, not a port")
        return int(reply)

    async def _request(self, request: str, *, expect: str) -> str:
        """Send ``request`` and return what follows ``expect`` in its reply (the one with the request's id)."""
        channel = await self._connected()
        self._last_id += 1
        request_id = str(self._last_id)
        try:
            async with asyncio.timeout(self.timeout_s):
                channel.writer.write(f"{request_id} {request}\n".encode())
                await channel.writer.drain()
                answer = await _read_line(channel.reader)
        except TimeoutError as exc:
            raise self._lost(f"did not answer {request} within {self.timeout_s:g} s") from exc
        except (OSError, ValueError) as exc:
            raise self._lost(f"broke the connection off at {request}: {exc!r}") from exc
        except BaseException:  # cancelled: its reply may still come, never on this connection
            self._drop_connection()
            raise
        answer_id, _, rest = answer.partition(" ")
        verb, _, value = rest.partition(" ")
        if answer_id == request_id and verb == "ERROR":
            raise StoreError(f"the rendezvous host at {channel.address} could not answer {request}: {value}")
        if answer_id != request_id or verb != expect:
            said = f"answered {answer[:80]!r}" if answer else "closed the connection"
            raise self._lost(f"{said} at request {request_id} ({request}), whose reply is '{request_id} {expect} ...'")
        return value

    async def _connected(self) -> _Channel:
        """The proven connection to the job's host process: the recorded one, or a new one this master starts."""
        if self._conn is not None:
            return self._conn
        assert self._state is not None, "RoundStores.start() was not called"
        store, job, token = self._state
        recorded = await _recorded(store, job)
        if recorded is not None and recorded[0] != self.host:  # an earlier master's, on another host (elected
            log.info("rdzv_host_elsewhere", address=f"{recorded[0]}:{recorded[1]}", here=self.host,  # masters)
                     action="starting one here: the rounds this master starts are served from its own address")
            recorded = None
        if recorded is not None:
            host, port, pid = recorded
            try:
                self._conn = await self._open_recorded(host, port, pid, token)
            except _NotTheHost as exc:
                log.warning("rdzv_host_refused", address=f"{host}:{port}", reason=str(exc),
                            meaning="what listens there is not the job's rendezvous host", action="starting a new one")
            except (OSError, TimeoutError) as exc:  # it exited: nobody connected for gone_timeout_s, or it died
                log.info("rdzv_host_gone", address=f"{host}:{port}", error=repr(exc), action="starting a new one")
            else:
                self._pid, self._address = pid, (host, port)
                log.info("rdzv_host_adopted", pid=pid, address=self._conn.address)
                return self._conn
        port = await self._spawn(token)
        try:
            conn = await self._open(self.host, port, token)
        except (_NotTheHost, OSError, TimeoutError) as exc:
            raise StoreError(f"the rendezvous host process this master started (pid {self._pid}, {self.host}:{port}) "
                             f"did not complete the job's proof: {exc}; see its error above") from exc
        try:  # on record before it is used: the next master finds the stores of the rounds this one starts
            await retrying(lambda: store.put(_record_key(job), json.dumps(
                {"pid": self._pid, "host": self.host, "port": port}).encode()), self._settings,
                what=f"rendezvous host record of {job}")
        except BaseException:
            conn.writer.close()
            raise
        self._conn, self._address = conn, (self.host, port)
        return self._conn

    async def _open_recorded(self, host: str, port: int, pid: int | None, token: str) -> _Channel:
        """A proven connection to the recorded host. A connection closed during the proof is tried again within
        ``rdzv_host_auth_timeout_s`` (a flood of connections makes the host close the oldest unproven ones); one
        still closed then is a squatter's, unless the recorded process is the job's host, alive: then StoreError,
        for starting a second host would give the round's nodes two different stores."""
        backoff = Backoff(self._settings)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.auth_timeout_s
        while True:
            try:
                return await self._open(host, port, token)
            except _BrokenOff as exc:
                if loop.time() < deadline:
                    log.info("rdzv_host_proof_retried", address=f"{host}:{port}", reason=str(exc))
                    await backoff.wait()
                    continue
                if pid is not None and is_alive(pid) and _HOST_MODULE in cmdline(pid):
                    raise StoreError(
                        f"the job's rendezvous host (pid {pid}, {host}:{port}) runs but closed every connection of "
                        f"this master during the proof for rdzv_host_auth_timeout_s={self.auth_timeout_s:g} s: "
                        "another process is flooding it with connections; stop it (`ss -tnp` shows who connects "
                        "there), then restart the master") from exc
                raise

    async def _open(self, host: str, port: int, token: str) -> _Channel:
        """A connection to ``host:port`` on which both sides proved they hold ``token`` (the token is never sent).

        OSError or TimeoutError: nothing answers there. _NotTheHost: something does, and fails the proof.
        """
        address = f"{host}:{port}"
        async with asyncio.timeout(self.auth_timeout_s):
            reader, writer = await asyncio.open_connection(host, port, limit=MAX_LINE_BYTES)
        try:
            try:
                async with asyncio.timeout(self.auth_timeout_s):
                    hello = await _read_line(reader)
                    if not hello:
                        raise _BrokenOff("it closed the connection before it greeted (a squatter, or the job's host "
                                         "closing this connection for a newer one)")
                    words = hello.split(" ")
                    if len(words) != 3 or words[:2] != ["HELLO", PROTOCOL] or not is_nonce(words[2]):
                        raise _NotTheHost(f"it greeted with {hello[:80]!r}, not {PROTOCOL}'s HELLO and a nonce")
                    host_nonce, master_nonce = words[2], new_nonce()
                    writer.write(f"PROOF {master_nonce} "
                                 f"{proof(token, MASTER, address, host_nonce, master_nonce)}\n".encode())
                    await writer.drain()
                    answer = await _read_line(reader)
            except TimeoutError as exc:
                raise _NotTheHost(f"it did not complete the proof within {self.auth_timeout_s:g} s "
                                  "(rdzv_host_auth_timeout_s)") from exc
            except ValueError as exc:
                raise _NotTheHost(f"it sent a line longer than {MAX_LINE_BYTES} bytes during the proof") from exc
            except OSError as exc:
                raise _BrokenOff(f"the connection broke off during the proof: {exc!r}") from exc
            if not answer:
                raise _BrokenOff("it closed the connection at this master's proof: it does not hold the job's token "
                                 "(or it closed this connection for a newer one)")
            verb, _, mac = answer.partition(" ")
            expected = proof(token, HOST, address, host_nonce, master_nonce)
            if verb != "PROOF" or not hmac.compare_digest(mac.encode(), expected.encode()):
                raise _NotTheHost("its proof of the job's token is wrong")
        except BaseException:
            writer.close()
            raise
        return _Channel(address, reader, writer)

    async def _spawn(self, token: str) -> int:
        # its own session and no death signal: it outlives this master on purpose
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-P", rdzv_host.__file__, self.host, str(self.gone_timeout_s), str(self.auth_timeout_s),
            str(self.max_pending), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True,
            env={**os.environ, TOKEN_ENV: token})
        assert process.stdout is not None
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await process.stdout.read()
        except BaseException as exc:
            process.kill()
            await process.wait()
            if isinstance(exc, TimeoutError):
                raise StoreError(f"the rendezvous host process did not say its port within {self.timeout_s:g} s "
                                 "(a machine too loaded to start Python?); it was killed: see its error above, then "
                                 "restart the master") from exc
            raise
        if not out.strip().isdigit():
            process.kill()
            await process.wait()
            raise StoreError(f"the rendezvous host process did not start (said {out[:200]!r}); see its error above")
        self._process, self._pid = process, process.pid
        log.info("rdzv_host_started", pid=process.pid, port=int(out))
        return int(out)

    def _lost(self, what: str) -> _HostLost:
        """Drop the connection (a reply may still come on it) and say what the host did."""
        address = "?" if self._conn is None else self._conn.address
        self._drop_connection()
        return _HostLost(f"the rendezvous host at {address} {what}")

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.writer.close()
            self._conn = None
        self._rounds.clear()

    async def _wait_gone(self) -> None:
        """Until the host process exited (SIGKILL after the timeout)."""
        pid, process = self._pid, self._process
        self._pid = self._process = None
        self._address = None
        if process is not None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        elif pid is not None:  # a dead master's: not our child
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout_s):
                    await wait_exit(pid)
            if is_alive(pid) and _HOST_MODULE in cmdline(pid):
                signal_leader(pid, signal.SIGKILL)


async def _read_line(reader: asyncio.StreamReader) -> str:
    """One line of the protocol without its newline; "" at EOF, ValueError past MAX_LINE_BYTES (the reader's limit)."""
    return (await reader.readline()).decode("ascii", errors="replace").rstrip("\n")


async def _recorded(store: StateStore, job: str) -> tuple[str, int, int] | None:
    """The host, port and pid of the job's host process on record, if any."""
    record = await store.get(_record_key(job))
    if record is None:
        return None
    try:
        about = json.loads(record.value)
        return str(about["host"]), int(about["port"]), int(about["pid"])
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("rdzv_host_record_unreadable", key=_record_key(job), error=repr(exc), action="starting a new host")
        return None


def _record_key(job: str) -> str:
    return f"{job_prefix(job)}rdzv-host"
