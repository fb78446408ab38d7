"""The workers' rendezvous store: one torch TCPStore per round, in a process that outlives the master.

Workers connect to ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE``)
instead of rank 0 hosting a store that dies with it; a fresh store per round
means no round ever reads a previous round's keys. The stores live in a small
process of their own (:mod:`stead.core._rdzv_host`), not in the master: a master
that is killed while a round's workers are still forming their process group
leaves their store running, and the next master finds the process through the
job's state store (``/stead/jobs/<job>/rdzv-host``) and goes on with it.

torch's TCPStore has no authentication, so each store listens only on the
master's own address (loopback when every node runs on this machine), never on
every interface as it does by default; the host process's control socket asks for
the job token first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys

import structlog

from stead.core import _rdzv_host
from stead.core._rdzv_host import TOKEN_ENV
from stead.core.errors import RetryableError, StoreError
from stead.core.events.log import job_prefix
from stead.core.procs import cmdline, is_alive, let_go, signal_leader, wait_exit
from stead.core.store import StateStore

__all__ = ["HEALTH_STORE_ROUND", "RoundStores"]

log = structlog.get_logger("stead.tcpstore")

#: what a host process's command line holds (it runs the module's file: no `import stead` to wait for)
_HOST_MODULE = _rdzv_host.__file__


#: the "round" whose store health checks use (rounds count from 1); its host keeps it for the whole job
HEALTH_STORE_ROUND = 0


class RoundStores:
    """The stores of each round, in the job's rendezvous host process; ``enabled=False`` hosts none (tests).

    ``await start(store, job, token)`` finds the job's running host process (one a dead master left) or starts
    one; ``close()`` ends it.
    """

    def __init__(self, host: str, *, enabled: bool, gone_timeout_s: float = 60.0, timeout_s: float = 60.0) -> None:
        self.host = host
        self.enabled = enabled
        #: the host process exits when no master has been connected for this long
        self.gone_timeout_s = gone_timeout_s
        #: how long a request to the host process (its start, a round's store, its exit) may take
        self.timeout_s = timeout_s
        self._rounds: dict[int, tuple[str, int]] = {}
        self._latest: tuple[str, int] = (host, 0)
        #: the round's start effects run concurrently: every node of a round must get the same store
        self._lock = asyncio.Lock()
        self._state: tuple[StateStore, str, str] | None = None
        self._pid: int | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

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
                    port = await self._ask(f"ROUND {round_}")
                except (OSError, EOFError, TimeoutError) as exc:  # the host process died: a new one
                    log.warning("rdzv_host_lost", error=repr(exc), action="starting another")
                    self._drop_connection()
                    port = await self._ask(f"ROUND {round_}")
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
            if self._conn is not None:
                with contextlib.suppress(OSError, EOFError, TimeoutError):
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

    async def _ask(self, request: str) -> int:
        await self._connected()
        reply = await self._request(request, expect="PORT")
        return int(reply)

    async def _request(self, line: str, *, expect: str) -> str:
        assert self._conn is not None
        reader, writer = self._conn
        writer.write(line.encode() + b"\n")
        async with asyncio.timeout(self.timeout_s):
            await writer.drain()
            answer = (await reader.readline()).decode(errors="replace").strip()
        verb, _, rest = answer.partition(" ")
        if not answer:
            raise EOFError("the rendezvous host closed the connection")
        if verb != expect:
            raise StoreError(f"the rendezvous host answered {answer!r} to {line.split()[0]}; this is a bug in stead: "
                             "report it with the master's log")
        return rest

    async def _connected(self) -> None:
        if self._conn is not None:
            return
        assert self._state is not None, "RoundStores.start() was not called"
        store, job, token = self._state
        record = await store.get(_record_key(job))
        if record is not None:
            with contextlib.suppress(OSError, TimeoutError, ValueError, KeyError, TypeError):
                about = json.loads(record.value)
                await self._connect(str(about["host"]), int(about["port"]), token)
                self._pid = int(about["pid"])
                log.info("rdzv_host_adopted", pid=self._pid, port=about["port"])
                return
        port = await self._spawn(token)
        await self._connect(self.host, port, token)
        await store.put(_record_key(job), json.dumps({"pid": self._pid, "host": self.host, "port": port}).encode())

    async def _connect(self, host: str, port: int, token: str) -> None:
        async with asyncio.timeout(self.timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"TOKEN {token}\n".encode())
        self._conn = (reader, writer)

    async def _spawn(self, token: str) -> int:
        # its own session and no death signal: it outlives this master on purpose
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-P", _rdzv_host.__file__, self.host, str(self.gone_timeout_s),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True,
            env={**os.environ, TOKEN_ENV: token})
        assert process.stdout is not None
        async with asyncio.timeout(self.timeout_s):
            out = await process.stdout.read()
        if not out.strip().isdigit():
            process.kill()
            await process.wait()
            raise StoreError(f"the rendezvous host process did not start (said {out[:200]!r}); see its error above")
        self._process, self._pid = process, process.pid
        log.info("rdzv_host_started", pid=process.pid, port=int(out))
        return int(out)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None
        self._rounds.clear()

    async def _wait_gone(self) -> None:
        """Until the host process exited (SIGKILL after the timeout)."""
        pid, process = self._pid, self._process
        self._pid = self._process = None
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


def _record_key(job: str) -> str:
    return f"{job_prefix(job)}rdzv-host"
