"""`stead run --rdzv-backend etcd` over several machines: every host a master candidate, one elected, the rest hot
standbys.

Every host runs the same command. Its `stead run` does three things at once:

- it **campaigns** (:class:`Candidate`): it puts the job's leader key (``/stead/jobs/<job>/master-leader``) in
  etcd if the key is absent, under a lease of ``heartbeat_timeout_s`` that it keeps alive. The winner binds a
  socket on its own address and runs the job's master on it in a child process (``stead run`` again, as the
  supervisor of a one-machine job does), the master's address in the key. The others watch the key: when it goes
  (the master's host died, or was cut off from etcd, and its lease expired), they campaign again, and the winner's
  master takes the job over from its log in etcd (the running nodes adopted: no worker restarted). A candidate
  that loses its lease kills its master at once; a master that kept writing meanwhile is fenced by the log
  itself (two masters cannot append one sequence number: the second gets ``LogConflict`` and stops);
- it **forwards** (:class:`MasterProxy`): it listens on its own address and forwards each connection to the
  elected master. This host's agents and workers are given that local address as their master's, so they never
  learn that the master moved: their connections break and reconnect, to the new master;
- it **runs this host's node**, as any host of a multi-machine job does (:func:`stead.platforms.hosts.join_job`,
  through the proxy). The elected master runs no node of its own: its host's `stead run` offers itself as the
  others do, and it gets a node last, so that where the job has a spare host the master's host is that spare.

The job's end is written in the key (``{"ended": CODE}``, no lease): standbys then stop campaigning, and a host
that runs the command again later resumes the job as a one-machine `stead run` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import structlog

from stead.cli.on_hosts import HOST_KEEPALIVE_S
from stead.cli.supervisor import EXIT_MASTER_CRASHED, LISTEN_FD_ENV, TAKEOVER_ENV, listen, stop_orphans
from stead.core.agent.netif import interface_toward
from stead.core.config import Settings
from stead.core.errors import ConfigError, RetryableError, StoreError
from stead.core.events.log import job_prefix
from stead.core.jobtoken import JOB_TOKEN_ENV
from stead.core.platform import Platform
from stead.core.procs import become_subreaper, signal_leader, tied_argv
from stead.core.retry import Backoff
from stead.core.rpc.address import parse_address
from stead.core.runspec import RunConfig
from stead.core.store import StateStore, WatchKind, open_store

if TYPE_CHECKING:  # (the hosts package is imported when the job runs, in _run)
    from stead.platforms.hosts import NodeSpecFactory

__all__ = ["Candidate", "Leader", "LeaderView", "MasterProxy", "leader_key", "run_elected"]

log = structlog.get_logger("stead.elected")

#: how often a connection waiting for a master (none elected yet, or the elected one not answering yet) tries
PROXY_RETRY_S = 0.1
#: how long the proxy holds a connection that waits for a master before it closes it (the client retries)
PROXY_WAIT_S = 30.0
#: how long a host whose candidate saw the job end waits for its node's own word of the end before it stops it
ENDED_GRACE_S = 10.0
#: how much the proxy reads and writes at once
_CHUNK = 1 << 16


def leader_key(job: str) -> str:
    """The etcd key that names the job's elected master (its value: :class:`Leader` as JSON)."""
    return f"{job_prefix(job)}master-leader"


@dataclasses.dataclass(frozen=True)
class Leader:
    """What the leader key says: the elected master's address and host, or the job's end (its exit code)."""

    address: str = ""
    host: str = ""
    ended: int | None = None

    def encode(self) -> bytes:
        return json.dumps({"ended": self.ended} if self.ended is not None else
                          {"address": self.address, "host": self.host}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Leader | None:
        """The key's value; None for one that is not stead's (it is then left alone, as a held key)."""
        try:
            value = json.loads(raw)
            if "ended" in value:
                return cls(ended=int(value["ended"]))
            return cls(address=str(value["address"]), host=str(value.get("host", "")))
        except (ValueError, TypeError, KeyError):
            return None


class LeaderView:
    """The leader key as etcd has it now, kept up to date by a watch; waiters wake on every change."""

    def __init__(self, store: StateStore, job: str, settings: Settings) -> None:
        self.store = store
        self.key = leader_key(job)
        self.settings = settings
        #: the key's value (None: absent) and mod revision (0: absent)
        self.leader: Leader | None = None
        self.revision = 0
        #: whether a live master was seen elected during this `stead run` (a later election takes the job over)
        self.seen_live = False
        self._changed = asyncio.Condition()

    @property
    def address(self) -> str:
        """The elected master's address; "" when none is."""
        return self.leader.address if self.leader is not None else ""

    async def follow(self) -> None:
        """Keep the view up to date for as long as it runs (riding out etcd outages)."""
        backoff = Backoff(self.settings)
        while True:
            try:
                before = await self.store.revision()  # (taken first: a put between the two reads is watched)
                found = await self.store.get(self.key)
                await self._set(found.value if found else None, found.mod_revision if found else 0)
                start = max(before, found.mod_revision if found else 0) + 1
                async for event in self.store.watch(self.key, start_revision=start):
                    if event.key == self.key:
                        deleted = event.kind is WatchKind.DELETE
                        await self._set(None if deleted else event.value, 0 if deleted else event.revision)
                    backoff.reset()
            except (RetryableError, StoreError) as exc:
                log.info("leader_watch_retry", error=str(exc))
                await backoff.wait()

    async def _set(self, raw: bytes | None, revision: int) -> None:
        async with self._changed:
            self.leader = Leader.decode(raw) if raw is not None else None
            self.revision = revision
            if self.leader is not None and self.leader.address:
                self.seen_live = True
            self._changed.notify_all()

    async def wait_for(self, ready: Callable[[LeaderView], bool], timeout_s: float | None = None) -> bool:
        """Wait until ``ready(self)`` (False when ``timeout_s`` passed first)."""
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: ready(self))
            return True
        except TimeoutError:
            return False


class MasterProxy:
    """Forwards each connection made to this host's address to the elected master: the master's address for this
    host's agents and workers, which stays the same however often the master moves."""

    def __init__(self, view: LeaderView, host: str) -> None:
        self.view = view
        self.host = host
        self._server: asyncio.Server | None = None
        #: the open connections, each with the master address it goes to
        self._links: dict[asyncio.StreamWriter, str] = {}

    @property
    def address(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    async def __aenter__(self) -> MasterProxy:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._links):
            writer.close()
        await self._server.wait_closed()

    def moved(self) -> None:
        """The master changed: every connection to another one is closed (its clients connect again, to the new)."""
        for writer, address in list(self._links.items()):
            if address != self.view.address:
                writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await self._connect()
            if upstream is None:
                return
            up_reader, up_writer, address = upstream
            self._links[writer] = self._links[up_writer] = address
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(_pipe(reader, up_writer))
                    tasks.create_task(_pipe(up_reader, writer))
            finally:
                self._links.pop(writer, None)
                self._links.pop(up_writer, None)
                up_writer.close()
        except* (OSError, asyncio.IncompleteReadError):
            pass  # either side went: the other is closed below
        finally:
            writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str] | None:
        """A connection to the elected master, waiting for one to be elected and to answer (its clients wait in
        this, as they would in a listening socket's backlog); None after :data:`PROXY_WAIT_S`."""
        deadline = time.monotonic() + PROXY_WAIT_S
        while time.monotonic() < deadline:
            address = self.view.address
            if address:
                host, port = parse_address(address)
                try:
                    async with asyncio.timeout(PROXY_WAIT_S / 10):
                        up_reader, up_writer = await asyncio.open_connection(host, port)
                    return up_reader, up_writer, address
                except (OSError, TimeoutError):
                    pass
            await self.view.wait_for(_moved_from(address), timeout_s=PROXY_RETRY_S)
        return None


def _moved_from(address: str) -> Callable[[LeaderView], bool]:
    """Whether the view names a master other than at ``address``."""
    return lambda view: view.address != address


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until the reader ends; then end the writer's side too."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


class Candidate:
    """This host's campaign for the job's master: wins the leader key when it is free, runs the master while it
    holds it, and says the job's exit code once the job ended (its own master's, or another's in the key)."""

    def __init__(self, config: RunConfig, argv: Sequence[str], *, token: str, view: LeaderView, host: str,
                 master_command: Sequence[str] | None = None) -> None:
        """``master_command`` runs the master instead of ``python -m stead run ARGV`` (a test's stand-in): it gets
        the same environment (the socket, the token, :data:`TAKEOVER_ENV`) and its exit code means the same."""
        self.config = config
        self.master_command = list(master_command or (sys.executable, "-m", "stead", "run", *argv))
        self.settings = config.settings
        self.token = token
        self.view = view
        self.host = host
        #: the master this host runs, while it runs one
        self.master: asyncio.subprocess.Process | None = None
        #: a stop asked for (SIGINT, SIGTERM) while this host runs the master: passed on to it
        self.stop: signal.Signals | None = None
        #: how many masters this host ran died while the job ran (at most master_max_restarts + 1 are run)
        self.crashes = 0

    @property
    def serving(self) -> bool:
        return self.master is not None and self.master.returncode is None

    def pass_on(self, sig: signal.Signals) -> None:
        """Ask this host's master to stop the job (the job stops on every host)."""
        self.stop = sig
        if self.master is not None and self.master.returncode is None:
            signal_leader(self.master.pid, sig)

    async def run(self) -> int:
        """Campaign until the job ended; its exit code."""
        backoff = Backoff(self.settings)
        while True:
            await self.view.wait_for(lambda v: v.leader is None or v.leader.ended is not None)
            leader = self.view.leader
            if leader is not None and leader.ended is not None and self.view.seen_live:
                return leader.ended  # ended during this run: nothing to take over
            try:
                code = await self._campaign(takeover=self.view.seen_live)
            except (RetryableError, StoreError) as exc:  # etcd away, or the lease lost: its master was killed
                log.warning("campaign_failed", error=str(exc), hint="campaigning again")
                await backoff.wait()
                continue
            if code is not None:
                return code
            if self.crashes > self.settings.master_max_restarts:
                print(f"stead: the masters this host ran died {self.crashes} times (master_max_restarts="
                      f"{self.settings.master_max_restarts}); it campaigns no more: another host's may take the job "
                      "over", file=sys.stderr)
                log.error("campaign_given_up", crashes=self.crashes)
                await asyncio.Event().wait()  # (this host's node goes on as long as the job has a master)
            backoff.reset()
            # not elected: the view shows the winner within a moment (no campaign again on what it knew before)
            await self.view.wait_for(lambda v: v.leader is not None, timeout_s=PROXY_RETRY_S * 5)

    async def _campaign(self, *, takeover: bool) -> int | None:
        """Try once to win the key; while held, run the master. The job's exit code once it ended; None: not
        elected, or the master died (another campaign follows)."""
        store = self.view.store
        async with store.lease(self.settings.heartbeat_timeout_s) as lease:
            expected = self.view.revision if self.view.leader is not None else 0
            if self.view.leader is not None and self.view.leader.ended is None:
                return None  # elected meanwhile
            sock = listen(self.host, self.config.master_port or 0)
            try:
                port = sock.getsockname()[1]
                address = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
                won = await store.compare_and_put(self.view.key, Leader(address, socket.gethostname()).encode(),
                                                  expected_mod_revision=expected, lease=lease)
                if not won:
                    return None
                print(f"stead: job {self.config.job_name}: this host was elected its master, serving at {address}"
                      f"{' (taking the job over)' if takeover else ''}", file=sys.stderr)
                log.info("master_elected", address=address, takeover=takeover, lease=lease.id)
                code = await self._serve(sock, takeover=takeover)
            finally:
                sock.close()
            if code < 0 or code == EXIT_MASTER_CRASHED:
                self.crashes += 1
                print(f"stead: the master this host ran {'was killed' if code < 0 else 'failed'}; the hosts elect "
                      "another, which takes the job over", file=sys.stderr)
                return None
            # the job ended: said in the key, without the lease (it outlives this host)
            await store.put(self.view.key, Leader(ended=code).encode())
            return code

    async def _serve(self, sock: socket.socket, *, takeover: bool) -> int:
        """Run the job's master on ``sock`` until it exits; its exit code. Cancelled (the lease lost, this host
        leaving), it is killed at once: another master may be elected already."""
        env = {**os.environ, LISTEN_FD_ENV: str(sock.fileno()), JOB_TOKEN_ENV: self.token}
        if takeover:
            env[TAKEOVER_ENV] = "1"
        # SIGKILL, not SIGTERM, if this process dies: a master told to stop would stop the job on every host, where
        # a standby is to take it over
        command = tied_argv(self.master_command, signal.SIGKILL)
        self.master = await asyncio.create_subprocess_exec(*command, env=env, pass_fds=(sock.fileno(),),
                                                           process_group=0)
        if self.stop is not None:
            signal_leader(self.master.pid, self.stop)
        try:
            return await self.master.wait()
        finally:
            if self.master.returncode is None:
                log.warning("master_fenced", pid=self.master.pid,
                            why="this host lost its lease (or leaves): another master may be elected already")
                signal_leader(self.master.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    await asyncio.shield(self.master.wait())


def own_address(endpoint: str) -> str:
    """The address this host reaches etcd from: where its master serves when elected, and its proxy listens."""
    host, port = parse_address(endpoint)
    found = interface_toward(host, port)
    if found is None:
        raise ConfigError(f"this host has no route to the etcd at --rdzv-endpoint {endpoint}: give an address "
                          "every host reaches")
    return found[1]


def run_elected(config: RunConfig, argv: Sequence[str], *, token: str, local: Callable[[], Awaitable[Platform]],
                node_spec: NodeSpecFactory) -> int:
    """This host's part of a job whose hosts elect its master, its node on the platform ``local()`` makes for this
    machine, started as ``node_spec`` says; the job's exit code."""
    become_subreaper()  # a master this host ran leaves its rendezvous store process to it
    try:
        return asyncio.run(_run(config, argv, token=token, local=local, node_spec=node_spec))
    except KeyboardInterrupt:
        print(f"stead: stopped; this host's node of job {config.job_name} was stopped", file=sys.stderr)
        return 130
    except ConfigError as exc:
        print(f"stead run: error: {exc}", file=sys.stderr)
        return 2
    finally:
        stop_orphans(config.settings)


async def _run(config: RunConfig, argv: Sequence[str], *, token: str, local: Callable[[], Awaitable[Platform]],
               node_spec: NodeSpecFactory) -> int:
    from stead.platforms.hosts import join_job  # (not at import: `stead run` imports this module only here)

    settings = config.settings
    host = own_address(config.hosts_endpoint)
    try:
        store = await open_store(config.store_url, settings=settings)
    except RetryableError as exc:
        raise ConfigError(f"the job's etcd at {config.hosts_endpoint} is unreachable: {exc}") from None
    view = LeaderView(store, config.job_name, settings)
    try:
        async with MasterProxy(view, host) as proxy, asyncio.TaskGroup() as tasks:
            follow = tasks.create_task(view.follow())
            moved = tasks.create_task(_on_change(view, proxy.moved))
            candidate = Candidate(config, list(argv), token=token, view=view, host=host)
            print(f"stead: job {config.job_name}: this host is a master candidate (etcd at {config.hosts_endpoint});"
                  f" its agents reach the elected master through {proxy.address}", file=sys.stderr)
            joined = dataclasses.replace(config, hosts_endpoint=proxy.address)
            node = tasks.create_task(join_job(joined, token=token, local=await local(), node_spec=node_spec,
                                              keepalive_s=HOST_KEEPALIVE_S))
            campaign = tasks.create_task(candidate.run())
            stopped: list[signal.Signals] = []
            _on_signals(candidate, node, stopped)
            code = await _outcome(node, campaign, candidate)
            for task in (follow, moved, node, campaign):
                task.cancel()
            return 128 + stopped[0] if stopped and code in (0, 130) else code
    finally:
        await store.close()


async def _outcome(node: asyncio.Task[int], campaign: asyncio.Task[int], candidate: Candidate) -> int:
    """The job's exit code: as this host's node heard it from the master; while this host serves the master, once
    the master ended too; when the job's end is known here first (the leader key), after the node's own word or
    :data:`ENDED_GRACE_S`."""
    await asyncio.wait([node, campaign], return_when=asyncio.FIRST_COMPLETED)
    if node.cancelled():  # stopped here by a signal
        return 130
    if node.done():
        if candidate.serving:  # the job ended: the master ends with it
            with contextlib.suppress(asyncio.CancelledError):
                await campaign
        return node.result()
    done, _ = await asyncio.wait([node], timeout=ENDED_GRACE_S)
    return node.result() if done else campaign.result()


async def _on_change(view: LeaderView, moved: Callable[[], None]) -> None:
    while True:
        address = view.address
        await view.wait_for(_moved_from(address))
        moved()


def _on_signals(candidate: Candidate, node: asyncio.Task[int], stopped: list[signal.Signals]) -> None:
    """SIGINT (Ctrl-C) on the master's host stops the job (everywhere), as on a c10d job's master host; elsewhere it
    stops this host's node. SIGTERM (the machine shutting down, the host drained) stops this host's node and, on
    the master's host, hands the job over: the master is killed and the lease given back, so a standby takes the
    job over at once; the job goes on."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        stopped.append(sig)
        if candidate.serving and sig is signal.SIGINT:
            print(f"stead: {sig.name}: stopping the job (this host runs its master)", file=sys.stderr)
            candidate.pass_on(sig)
            return
        handed = " and hands the job to another host's master" if candidate.serving else ""
        print(f"stead: {sig.name}: this host stops its node{handed}; the job goes on without it", file=sys.stderr)
        node.cancel()  # (the campaign is cancelled with it: its master killed, its lease given back)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

