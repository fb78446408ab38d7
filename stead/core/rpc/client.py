"""Clients of the master's RPC services, with grpclib's errors mapped to stead's.

:class:`MasterClient` mirrors :class:`~stead.core.rpc.backend.AgentBackend` (the
same dataclasses and reports in and out); plugins build their clients on :class:`RpcConnection`. A master
that cannot be reached raises :class:`~stead.core.errors.RpcUnavailable`, which
:func:`retrying` retries with exponential backoff (no sooner than a shedding master's
retry-after); a refused token raises :class:`~stead.core.errors.Unauthenticated` and a
rejected request :class:`~stead.core.errors.InvalidRequest`, which are not retried: a
request over one of the master's limits (its size, a field's count) is one of those,
told apart from a master shedding load by the status details the server sends
(:mod:`._refusals`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncGenerator, Iterator, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import structlog
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from stead.core.errors import (
    ConfigError,
    HungUp,
    InvalidRequest,
    PermanentError,
    RpcUnavailable,
    SteadError,
    Unauthenticated,
)
from stead.core.events import (
    JobWarned,
    NodeHealthReported,
    NumericsReported,
    StacksDumped,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.retry import retrying
from stead.core.rpc._channel import Channel
from stead.core.rpc._proto.stead.v1 import (
    AgentServiceStub,
    Command,
    CommandsRequest,
    HeartbeatBatch,
    HeartbeatReply,
    HeartbeatRequest,
)
from stead.core.rpc._refusals import Refusal, RefusalCodec
from stead.core.rpc.address import parse_address
from stead.core.rpc.auth import attach_token
from stead.core.rpc.backend import (
    HEARTBEAT_STREAM_ROUTE,
    AgentCommand,
    AgentReport,
    HeartbeatInfo,
    RegisterInfo,
    RegisterResult,
)
from stead.core.rpc.convert import (
    command_from_proto,
    failure_to_proto,
    health_to_proto,
    heartbeat_to_proto,
    numerics_to_proto,
    register_reply_from_proto,
    register_to_proto,
    stacks_to_proto,
    warned_to_proto,
    workers_to_proto,
)
from stead.core.rpc.tls import TLS_HINT
from stead.core.tokenfile import check_token

__all__ = ["HeartbeatStream", "MasterClient", "RpcConnection", "retrying"]

log = structlog.get_logger()

T = TypeVar("T")

# Statuses after which the same call may succeed later: the master is restarting, overloaded or failing (a
# RESOURCE_EXHAUSTED that says the request is over a limit is not retried: see RpcConnection._from_status).
_RETRYABLE = frozenset({
    Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED, Status.RESOURCE_EXHAUSTED, Status.ABORTED,
    Status.CANCELLED, Status.UNKNOWN, Status.INTERNAL,
})


class RpcConnection:
    """One grpclib channel to ``address``: adds the job token, applies timeouts, maps errors."""

    def __init__(self, address: str, token: str, call_timeout_s: float, *, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: connect with mutual TLS with this context (:func:`~stead.core.rpc.tls.client_tls`), plain TCP
        without."""
        self.host, self.port = parse_address(address)
        self._tls = tls
        self.address = address
        self._token = check_token(token)
        if not call_timeout_s > 0:
            raise ConfigError(f"call_timeout_s={call_timeout_s} must be > 0: pass the RPC timeout setting")
        self.call_timeout_s = call_timeout_s
        self._channel: Channel | None = None

    @property
    def channel(self) -> Channel:
        if self._channel is None:
            raise RuntimeError("use the client inside `async with`: its connection is not open")
        return self._channel

    def open(self) -> None:
        if self._channel is not None:
            raise RuntimeError("the client is already open; use one `async with` per instance")
        channel = Channel(self.host, self.port, ssl=self._tls, status_details_codec=RefusalCodec())
        attach_token(channel, self._token)
        self._channel = channel

    def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    @contextlib.contextmanager
    def errors(self, method: str) -> Iterator[None]:
        """Turn what grpclib raises inside the block into stead's errors.

        grpclib ends a call whose deadline passed or whose connection was lost by
        cancelling the calling task and raising its own error instead of the
        CancelledError, without ``uncancel()``: the task would stay "cancelling"
        for good, and a later cancel scope or ``asyncio.timeout`` of that task would
        let its own cancellation escape (an agent that outlived its master crashed
        at exit). Those cancellations are taken back here.
        """
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        try:
            yield
        except GRPCError as exc:
            raise self._from_status(method, exc) from exc
        except StreamTerminatedError as exc:
            _take_back_cancels(task, cancelling)
            failure = self._channel.tls_failure if self._channel is not None else None
            if failure is not None:
                raise Unauthenticated(f"{method}: TLS with the master at {self.address} failed: {failure}; "
                                      f"{TLS_HINT}") from exc
            hung_up = self._channel.hung_up if self._channel is not None else None
            if hung_up is not None:  # retried: a master at its connection limit hangs up so too
                raise HungUp(f"{method}: TLS with the master at {self.address} likely failed: {hung_up}; "
                             f"{TLS_HINT}") from exc
            raise RpcUnavailable(f"{method}: the connection to the master at {self.address} was lost ({exc}); "
                                 "the master may be restarting: retry") from exc
        except TimeoutError as exc:
            _take_back_cancels(task, cancelling)
            raise RpcUnavailable(f"{method}: the master at {self.address} did not answer within "
                                 f"{self.call_timeout_s}s; check that it is running and not overloaded") from exc
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            raise RpcUnavailable(f"{method}: the master at {self.address} hung up during the TLS handshake ({exc}); "
                                 f"it may be restarting: retry; if this persists, {TLS_HINT}") from exc
        except ssl.SSLError as exc:
            raise Unauthenticated(f"{method}: TLS with the master at {self.address} failed: {_tls_failure(exc)}; "
                                  f"{TLS_HINT}") from exc
        except OSError as exc:
            raise RpcUnavailable(f"{method}: cannot reach the master at {self.address} ({exc}); "
                                 "check that it is running and that the address is right") from exc
        except ProtocolError as exc:
            raise RpcUnavailable(f"{method}: the server at {self.address} did not answer as a stead master "
                                 f"({exc}); check the address") from exc

    def _from_status(self, method: str, exc: GRPCError) -> SteadError:
        detail = exc.message or exc.status.name
        if exc.status in (Status.UNAUTHENTICATED, Status.PERMISSION_DENIED):
            return Unauthenticated(f"{method}: the master at {self.address} refused the job token: {detail}")
        if exc.status == Status.INVALID_ARGUMENT:
            return InvalidRequest(f"{method}: {detail}")
        refusal = exc.details if isinstance(exc.details, Refusal) else Refusal()
        if refusal.over_limit:
            return InvalidRequest(f"{method}: the master at {self.address} refused the request as over its limits "
                                  f"({exc.status.name}): {detail}; the same request is refused every time")
        if exc.status in _RETRYABLE:
            unavailable = RpcUnavailable(f"{method}: the master at {self.address} answered {exc.status.name}: "
                                         f"{detail}; retry later")
            unavailable.retry_after_s = refusal.retry_after_s
            return unavailable
        return PermanentError(f"{method}: the master at {self.address} answered {exc.status.name}: {detail}; "
                              "run the master and the agents with the same stead version")


class MasterClient:
    """The agent's side of AgentService: ``async with MasterClient("host:port", token, call_timeout_s=5)``."""

    def __init__(self, address: str, token: str, *, call_timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        self._conn = RpcConnection(address, token, call_timeout_s, tls=tls)
        self._beats: HeartbeatStream | None = None

    @property
    def address(self) -> str:
        return self._conn.address

    @property
    def _stub(self) -> AgentServiceStub:
        return AgentServiceStub(self._conn.channel)

    async def __aenter__(self) -> Self:
        self._conn.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        beats, self._beats = self._beats, None
        if beats is not None:
            await beats.close()
        self._conn.close()

    async def register(self, info: RegisterInfo) -> RegisterResult:
        with self._conn.errors("AgentService.Register"):
            reply = await self._stub.register(register_to_proto(info), timeout=self._conn.call_timeout_s)
        return register_reply_from_proto(reply)

    async def heartbeat(self, info: HeartbeatInfo) -> bool:
        """False when the master does not know this node incarnation: register again.

        Sent on this client's heartbeat stream (opened at the first heartbeat, again after a failure): a message
        each way, not a call. A node that shares its connection with others opens its own :meth:`beats`.
        """
        if self._beats is None:
            self._beats = self.beats()
        return await self._beats.send(info)

    def beats(self) -> HeartbeatStream:
        """A stream for one node's heartbeats on this client's connection."""
        return HeartbeatStream(self._conn)

    async def heartbeats(self, beats: Sequence[HeartbeatInfo]) -> list[str]:
        """Many nodes' heartbeats in one call (an aggregator's); returns the node ids that must register again."""
        batch = HeartbeatBatch(beats=[heartbeat_to_proto(info) for info in beats])
        with self._conn.errors("AgentService.Heartbeats"):
            reply = await self._stub.heartbeats(batch, timeout=self._conn.call_timeout_s)
        return list(reply.unknown)

    async def commands(self, node_id: str, incarnation: int) -> AsyncGenerator[AgentCommand, None]:
        """The master's commands for this node incarnation, in order, until the master ends the stream.

        No timeout applies: the stream stays open while the node lives. A lost
        master raises RpcUnavailable; leaving the loop early closes the stream.
        """
        method = "AgentService.Commands"
        request = CommandsRequest(node_id=node_id, incarnation=incarnation)
        # The generated stub is an async generator, typed as a plain iterator.
        stream = cast(AsyncGenerator[Command, None], self._stub.commands(request))
        try:
            while True:
                with self._conn.errors(method):
                    try:
                        message = await anext(stream)
                    except StopAsyncIteration:
                        return
                command = command_from_proto(message)
                if command is None:
                    log.warning("rpc_unknown_command", id=message.id, node=node_id,
                                hint="the master is newer than this agent: run both with the same stead version")
                    continue
                yield command
        finally:
            with self._conn.errors(method):
                await stream.aclose()

    async def report_failure(self, report: AgentReport[WorkerFailed]) -> None:
        with self._conn.errors("AgentService.ReportFailure"):
            await self._stub.report_failure(failure_to_proto(report), timeout=self._conn.call_timeout_s)

    async def report_workers(self, report: AgentReport[WorkersStarted | WorkersSucceeded]) -> None:
        with self._conn.errors("AgentService.ReportWorkers"):
            await self._stub.report_workers(workers_to_proto(report), timeout=self._conn.call_timeout_s)

    async def report_stacks(self, report: AgentReport[StacksDumped]) -> None:
        with self._conn.errors("AgentService.ReportStacks"):
            await self._stub.report_stacks(stacks_to_proto(report), timeout=self._conn.call_timeout_s)

    async def report_health(self, report: AgentReport[NodeHealthReported]) -> None:
        with self._conn.errors("AgentService.ReportHealth"):
            await self._stub.report_health(health_to_proto(report), timeout=self._conn.call_timeout_s)

    async def report_numerics(self, report: AgentReport[NumericsReported]) -> None:
        with self._conn.errors("AgentService.ReportNumerics"):
            await self._stub.report_numerics(numerics_to_proto(report), timeout=self._conn.call_timeout_s)

    async def report_warned(self, report: AgentReport[JobWarned]) -> None:
        with self._conn.errors("AgentService.ReportWarned"):
            await self._stub.report_warned(warned_to_proto(report), timeout=self._conn.call_timeout_s)

    def __repr__(self) -> str:
        return f"MasterClient({self._conn.address})"


class HeartbeatStream:
    """One node's heartbeats on one long-lived HeartbeatStream call, each answered before the next is sent.

    The call is opened at the first :meth:`send` and again after it broke; a heartbeat that finds it broken, or
    gets no answer within the call timeout, raises RpcUnavailable (the agent tries again at its next beat).
    """

    _METHOD = "AgentService.HeartbeatStream"

    def __init__(self, conn: RpcConnection) -> None:
        self._conn = conn
        self._call: contextlib.AbstractAsyncContextManager[Any] | None = None
        self._stream: Any = None
        self._lock = asyncio.Lock()

    async def send(self, info: HeartbeatInfo) -> bool:
        async with self._lock:
            try:
                with self._conn.errors(self._METHOD):
                    async with asyncio.timeout(self._conn.call_timeout_s):
                        if self._stream is None:
                            call = self._conn.channel.request(HEARTBEAT_STREAM_ROUTE, Cardinality.STREAM_STREAM,
                                                              HeartbeatRequest, HeartbeatReply)
                            self._stream = await call.__aenter__()
                            self._call = call
                        await self._stream.send_message(heartbeat_to_proto(info))
                        reply = await self._stream.recv_message()
                if reply is None:
                    raise RpcUnavailable(f"{self._METHOD}: the master at {self._conn.address} ended the heartbeat "
                                         "stream; it may be restarting: retry")
            except BaseException:
                await self._drop()
                raise
        if reply.error:
            raise InvalidRequest(f"{self._METHOD}: {reply.error}")
        return bool(reply.known)

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    async def _drop(self) -> None:
        call, self._call, self._stream = self._call, None, None
        if call is not None:
            with contextlib.suppress(Exception):  # the call is gone either way; never wait long for it
                async with asyncio.timeout(_DROP_TIMEOUT_S):
                    await call.__aexit__(None, None, None)


#: the longest a broken heartbeat call is waited for while it is closed
_DROP_TIMEOUT_S = 1.0


def _tls_failure(exc: ssl.SSLError) -> str:
    """What went wrong in a TLS handshake this client made, in words."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"this client does not trust the master's certificate ({exc.verify_message})"
    if exc.reason == "WRONG_VERSION_NUMBER":
        return "the server answered in plain text: its master runs without the tls_* settings"
    return f"the handshake was refused ({exc.reason or exc})"


def _take_back_cancels(task: asyncio.Task[object] | None, before: int) -> None:
    """Undo the cancellations grpclib made of ``task`` to end a call (see :meth:`RpcConnection.errors`)."""
    while task is not None and task.cancelling() > before:
        task.uncancel()
