"""A host of a job over several machines that does not serve the job's master: it offers itself and runs a node.

`stead run` with torchrun's multi-node flags on a host other than the master's (node rank R > 0 of a static
rendezvous; a host whose address is not the c10d endpoint) calls :func:`join_job`. It offers this host to the
job's master (``HostService.Offer``), waiting for the master while it is not up yet (a progress line every
:data:`WAITING_REPORT_S`), then starts and kills its node's agent as the master says, on a platform for this
machine, and reports what the agent did. The agent registers and heartbeats with the master itself.

It ends when the master says that the job ended (printing the job's outcome, exiting with its code), when the
master refuses this host (another job's command line, a node rank another host holds: a clear error, exit 2), or
when the master stays unreachable past ``master_gone_timeout_s`` (its node's agent is stopped: exit 1). A stream
broken for a shorter time (the master restarting, a short outage) is offered again, naming the node this host
runs, which the master then keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import sys
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import cast

import anyio
import betterproto2
import structlog
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.config import Settings
from stead.core.errors import HungUp, PermanentError, RpcUnavailable, Unauthenticated
from stead.core.events import NodeExited, NodeStarted
from stead.core.platform import HOST_ENV, NodeSpec, Platform
from stead.core.retry import Backoff
from stead.core.rpc import RpcConnection, client_tls
from stead.core.rpc.address import parse_address
from stead.core.runspec import RunConfig
from stead.core.tokenfile import write_token_file
from stead.platforms.hosts._platform import job_shape
from stead.platforms.hosts._proto.stead.hosts import v1 as proto

__all__ = ["WAITING_REPORT_S", "NodeSpecFactory", "join_job"]

log = structlog.get_logger("stead.hosts")

#: how often a host says what it waits for while the master is not reachable
WAITING_REPORT_S = 10.0
#: the exit code of a host the master refused (its command line means another job), as for any bad input
EXIT_REFUSED = 2
#: a host not yet in the job whose connections the master closes this many times in a row before saying anything
#: stops: TLS refuses it (a master shedding load at its connection limit answers a retry)
HUNG_UP_LIMIT = 3

NodeSpecFactory = Callable[[str, int, str, str], NodeSpec]


async def join_job(config: RunConfig, *, token: str, local: Platform, node_spec: NodeSpecFactory,
                   keepalive_s: float) -> int:
    """Run this host's part of the job ``config`` describes, whose master serves at ``config.hosts_endpoint`` and
    writes to this host's stream at least every ``keepalive_s``."""
    host = _Host(config, token=token, local=local, node_spec=node_spec, keepalive_s=keepalive_s)
    try:
        async with cast(contextlib.AbstractAsyncContextManager[Platform], local):
            return await host.run()
    finally:
        host.token_file.unlink(missing_ok=True)


class _Host:
    def __init__(self, config: RunConfig, *, token: str, local: Platform, node_spec: NodeSpecFactory,
                 keepalive_s: float) -> None:
        self.config = config
        self.keepalive_s = keepalive_s
        self.settings: Settings = config.settings
        self.address = config.hosts_endpoint
        self.token = token
        self.local = local
        self.node_spec = node_spec
        self.launcher_id = secrets.token_hex(8)
        #: mutual TLS with the master when the tls_* settings ask for it (checked before this host started)
        self.tls = client_tls(self.settings)
        self.name = os.environ.get(HOST_ENV) or socket.gethostname()  # the platform's name for it, if any
        self.node_rank = config.node_rank if config.rdzv_backend == "static" else -1
        #: the token file this host's agents read (its own: the master's host may share this directory)
        self.token_file = write_token_file(Path(".stead") / f"{config.job_name}.{self.launcher_id}.token", token)
        self.running: dict[tuple[str, int], int] = {}
        self.accepted = False

    async def run(self) -> int:
        reports: asyncio.Queue[proto.NodeReport] = asyncio.Queue()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._watch_local, reports)
            tasks.start_soon(self._send_reports, reports)
            code = await self._follow()
            tasks.cancel_scope.cancel()
        return code

    async def _follow(self) -> int:
        """Offer this host to the master, again after a broken stream, and do what its commands say."""
        backoff = Backoff(self.settings)
        heard = time.monotonic()
        said = heard
        hung_up = 0  # connections in a row the master closed before it said anything
        while True:
            try:
                async with contextlib.aclosing(self._offer()) as commands:
                    async for command in commands:
                        heard = time.monotonic()
                        backoff.reset()
                        ended = await self._obey(command)
                        if ended is not None:
                            return ended  # (the stream closed at once: the master waits for that)
            except Unauthenticated as exc:
                print(f"stead run: error: {exc}. Every host of the job needs the same STEAD_JOB_TOKEN and, with the "
                      "tls_* settings, a certificate of the job's CA", file=sys.stderr)
                return EXIT_REFUSED
            except _Refused as exc:
                print(f"stead run: error: the job's master at {self.address} refused this host: {exc}",
                      file=sys.stderr)
                return EXIT_REFUSED
            except RpcUnavailable as exc:
                hung_up = hung_up + 1 if isinstance(exc, HungUp) else 0
                if hung_up >= HUNG_UP_LIMIT and not self.accepted:  # TLS, not a master shedding load, by now
                    print(f"stead run: error: {exc} (the same {hung_up} times in a row)", file=sys.stderr)
                    return EXIT_REFUSED
                if isinstance(exc.__cause__, socket.gaierror):
                    print(f"stead run: error: the job's master address {self.address} does not resolve on this host "
                          f"({exc.__cause__}): give the master's host by an address or a name every host resolves",
                          file=sys.stderr)
                    return EXIT_REFUSED
                error = str(exc)
            else:
                error = "the master ended this host's stream"
            now = time.monotonic()
            limit = self.settings.master_gone_timeout_s if self.accepted else self.config.join_timeout_s
            if now - heard > limit:
                what = "was unreachable" if self.accepted else "could not be reached"
                print(f"stead: the job's master at {self.address} {what} for {limit:g} s "
                      f"({'master_gone_timeout_s' if self.accepted else 'join_timeout_s'}); this host's node is "
                      f"stopped. Last error: {error}", file=sys.stderr)
                return 1
            if now - said >= WAITING_REPORT_S:
                said = now
                print(f"stead: waiting for the job's master at {self.address} ("
                      f"{self._who_serves()}); {now - heard:.0f} s so far: {error}", file=sys.stderr)
            log.info("host_offer_retry", master=self.address, error=error)
            await backoff.wait()

    def _who_serves(self) -> str:
        if self.config.rdzv_backend == "static":
            return "the host with --node-rank 0 runs it"
        return "the host whose address the --rdzv-endpoint is runs it"

    async def _offer(self) -> AsyncGenerator[proto.HostCommand, None]:
        offer = proto.HostOffer(
            shape=job_shape(self.config), host=self.name, address=self._local_address(), node_rank=self.node_rank,
            launcher_id=self.launcher_id,
            running=[proto.RunningNode(node_id=n, incarnation=i, pid=p) for (n, i), p in self.running.items()])
        conn = RpcConnection(self.address, self.token, self.settings.rpc_timeout_s, tls=self.tls)
        conn.open()
        try:
            stream = cast(AsyncGenerator[proto.HostCommand, None],
                          proto.HostServiceStub(conn.channel).offer(offer))
            try:
                while True:
                    with _refusals(), conn.errors("HostService.Offer"):
                        try:  # (the master writes at least every HOST_KEEPALIVE_S: silence is a broken link)
                            async with asyncio.timeout(self.keepalive_s * 3):
                                command = await anext(stream)
                        except StopAsyncIteration:
                            return
                    yield command
            finally:
                with contextlib.suppress(Exception), conn.errors("HostService.Offer"):
                    await stream.aclose()
        finally:
            conn.close()

    async def _obey(self, command: proto.HostCommand) -> int | None:
        which, value = betterproto2.which_one_of(command, "kind")
        match which:
            case "accepted":
                assert isinstance(value, proto.Accepted)
                if not self.accepted:
                    rank = f"node rank {self.node_rank}" if self.node_rank >= 0 else "a node"
                    print(f"stead: host {self.name} joined job {self.config.job_name} (its master at "
                          f"{self.address}); it runs {rank}", file=sys.stderr)
                self.accepted = True
                log.info("host_accepted", master=self.address, host=value.host)
                keep_spares = getattr(self.local, "keep_spares", None)
                if not self.running and callable(keep_spares):  # a node may come at once: its agent starts warm
                    await keep_spares(self.node_spec("spare", 0, self.address, str(self.token_file)))
            case "launch":
                assert isinstance(value, proto.Launch)
                spec = self.node_spec(value.node_id, value.incarnation, self.address, str(self.token_file))
                await self.local.launch(spec)
            case "kill":
                assert isinstance(value, proto.Kill)
                await self.local.kill(value.node_id, value.incarnation)
            case "ended":
                assert isinstance(value, proto.Ended)
                if value.summary:
                    print(value.summary, file=sys.stderr)
                return value.exit_code
        return None  # (an empty command: the master is there)

    async def _watch_local(self, reports: asyncio.Queue[proto.NodeReport]) -> None:
        async for event in self.local.events():
            if not isinstance(event, NodeStarted | NodeExited):
                continue  # (this machine's platform has nothing else to say of the node)
            key = (event.node_id, event.incarnation)
            if isinstance(event, NodeStarted):
                self.running[key] = event.pid or 0
                reports.put_nowait(proto.NodeReport(launcher_id=self.launcher_id, node_id=event.node_id,
                                                    incarnation=event.incarnation, started=True, pid=event.pid or 0))
            elif isinstance(event, NodeExited):
                self.running.pop(key, None)
                reports.put_nowait(proto.NodeReport(launcher_id=self.launcher_id, node_id=event.node_id,
                                                    incarnation=event.incarnation, exited=True,
                                                    exit_code=event.exit_code, signal=event.signal,
                                                    reason=event.reason))

    async def _send_reports(self, reports: asyncio.Queue[proto.NodeReport]) -> None:
        """Each report reaches the master, in order, retried while it is unreachable (a restarting master)."""
        conn = RpcConnection(self.address, self.token, self.settings.rpc_timeout_s, tls=self.tls)
        conn.open()
        backoff = Backoff(self.settings)
        try:
            while True:
                try:  # a keepalive when there is nothing to report: the master gives no node to a silent host
                    async with asyncio.timeout(self.keepalive_s):
                        report = await reports.get()
                except TimeoutError:
                    report = proto.NodeReport(launcher_id=self.launcher_id)
                while True:
                    try:
                        with conn.errors("HostService.ReportNode"):
                            await proto.HostServiceStub(conn.channel).report_node(
                                report, timeout=self.settings.rpc_timeout_s)
                        backoff.reset()
                        break
                    except RpcUnavailable as exc:
                        log.info("host_report_retry", node=report.node_id, error=str(exc))
                        await backoff.wait()
        finally:
            conn.close()

    def _local_address(self) -> str:
        """The address this host reaches the master from (what the master's logs name it by)."""
        host, port = parse_address(self.address)
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, port))
                return str(probe.getsockname()[0])
        except OSError:
            return ""


class _Refused(Exception):
    """The master refused this host's offer; the message says why and what to do."""


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """A refusal of the offer (FAILED_PRECONDITION) as :class:`_Refused`, with the master's words."""
    try:
        yield
    except PermanentError as exc:
        cause = exc.__cause__
        if isinstance(cause, GRPCError) and cause.status is Status.FAILED_PRECONDITION:
            raise _Refused(cause.message or "no reason given") from None
        raise

