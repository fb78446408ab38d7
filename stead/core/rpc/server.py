"""The RPC server: grpclib bound to a port, every call authenticated with the job token.

``async with RpcServer(handlers, token=...) as srv`` listens (on a free port when
``port=0``), serves until the block ends, then stops listening, cancels the
calls in flight and closes every connection, so that clients see the master go
(RpcUnavailable) instead of waiting on a stream that will never end.
"""

from __future__ import annotations

import asyncio
import os
import socket
import weakref
from collections.abc import Collection, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import grpclib.const
import structlog
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from grpclib.server import Server

from stead.core.errors import ConfigError
from stead.core.rpc._checks import check_request
from stead.core.rpc._proto.stead.v1 import Ack
from stead.core.rpc.address import format_address
from stead.core.rpc.auth import require_token

if TYPE_CHECKING:
    from grpclib._typing import IProtoMessage

__all__ = ["RpcServer", "Servicer"]

log = structlog.get_logger()


class Servicer(Protocol):
    """A service implementation: a generated ``...ServiceBase`` subclass."""

    def __mapping__(self) -> Mapping[str, grpclib.const.Handler]: ...


#: the largest request body a server decodes unless told otherwise (gRPC's own default)
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20


class _StrictProtoCodec(ProtoCodec):
    """A request body that is not the expected message is INVALID_ARGUMENT, not an internal error; one over
    ``max_bytes`` is RESOURCE_EXHAUSTED, refused before it is decoded (and so before anything is built from it);
    a message whose strings are over their bounds or whose floats are not finite is refused as it is decoded,
    before any servicer sees it (see :func:`~._checks.check_request`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    def decode(self, data: bytes, message_type: type[IProtoMessage]) -> IProtoMessage:
        if len(data) > self.max_bytes:
            raise GRPCError(Status.RESOURCE_EXHAUSTED,
                            f"a {message_type.__name__} of {len(data)} bytes is over this master's limit of "
                            f"{self.max_bytes} bytes (setting rpc_max_message_bytes); send less per call")
        try:
            message = super().decode(data, message_type)
        except Exception as exc:
            raise GRPCError(Status.INVALID_ARGUMENT,
                            f"the request body is not a valid {message_type.__name__} message ({exc}): "
                            "send messages built from proto/stead/v1 of the same stead version") from exc
        check_request(message)
        return message


class _Routes(dict[str, grpclib.const.Handler]):
    """The server's method table; a method it does not serve is answered UNIMPLEMENTED with what to do.

    grpclib's own answer to an unknown path carries no content-type, which its
    client reports as ``UNKNOWN: Missing content-type header``.
    """

    def get(self, key: str, default: Any = None) -> Any:
        found = super().get(key)
        if found is not None:
            return found

        async def unimplemented(stream: Any) -> None:
            raise GRPCError(Status.UNIMPLEMENTED, f"{key} is not served by this stead master; run the master and its "
                                                  "clients with the same stead version, and the plugin that serves "
                                                  "it (is it installed and enabled?)")

        return grpclib.const.Handler(unimplemented, grpclib.const.Cardinality.UNARY_UNARY, Ack, Ack)


class _Server(Server):
    """grpclib's server, which also drops its open connections when closed, and says UNIMPLEMENTED clearly.

    ``Server.close`` stops listening and cancels the calls in flight, but leaves
    accepted connections open: their clients would wait forever on a stream and
    could still start new calls on a server that was stopped.
    """

    def __init__(self, handlers: Collection[Servicer], **kwargs: Any) -> None:
        super().__init__(handlers, **kwargs)
        self._mapping = _Routes(self._mapping)
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        self._protocols.add(protocol)
        return protocol

    def drop_connections(self) -> None:
        for protocol in list(self._protocols):
            if hasattr(protocol, "processor"):  # set once the connection is made
                protocol.processor.close("the server was stopped")


class RpcServer:
    """Serves ``handlers`` on ``host:port`` for the duration of an ``async with`` block."""

    def __init__(
        self,
        handlers: Collection[Servicer],
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        token_file: str | os.PathLike[str] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        listen_fd: int | None = None,
    ) -> None:
        self._handlers = tuple(handlers)
        self._listen_fd = listen_fd
        self._max_message_bytes = max_message_bytes
        self._token = token
        self._token_file = token_file
        self._host = host
        self._requested_port = port
        self._port: int | None = None
        self._server: _Server | None = None

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The port actually bound (the free one the OS chose when ``port=0``)."""
        if self._port is None:
            raise RuntimeError("RpcServer.port is known only inside `async with RpcServer(...)`")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` as a client passes it."""
        return format_address(self._host, self.port)

    async def __aenter__(self) -> Self:
        if self._server is not None:
            raise RuntimeError("RpcServer is already serving; use one `async with` per instance")
        server = _Server(self._handlers, codec=_StrictProtoCodec(self._max_message_bytes))
        require_token(server, self._token, token_file=self._token_file)
        sock = await self._bind()
        try:
            await server.start(sock=sock)
        except BaseException:
            sock.close()
            raise
        self._server = server
        self._port = sock.getsockname()[1]
        log.info("rpc_server_started", host=self._host, port=self._port)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        server.drop_connections()
        await server.wait_closed()
        log.info("rpc_server_stopped", host=self._host, port=self._port)
        self._port = None

    async def _bind(self) -> socket.socket:
        if self._listen_fd is not None:  # handed over, listening already; closing ours leaves the giver's open
            sock = socket.socket(fileno=os.dup(self._listen_fd))
            sock.setblocking(False)
            self._host = sock.getsockname()[0]
            return sock
        where = format_address(self._host, self._requested_port)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                self._host, self._requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, kind, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {where}: {exc}; pass a host name or address of this machine") \
                from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setblocking(False)
            sock.bind(sockaddr)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"cannot listen on {where}: {exc}; choose another port, or 0 for a free one") \
                from None
        return sock

    def __repr__(self) -> str:
        port = self._port if self._port is not None else self._requested_port
        return f"RpcServer({format_address(self._host, port)})"
