"""The RPC server: grpclib bound to a port, every call authenticated with the job token.

``async with RpcServer(handlers, token=...) as srv`` listens (on a free port when
``port=0``), serves until the block ends, then stops listening, cancels the
calls in flight and closes every connection, so that clients see the master go
(RpcUnavailable) instead of waiting on a stream that will never end.

What a client can make the master hold is bounded before it is held:

- a request message's length is checked on its 5-byte prefix, before its body is read
  (``rpc_max_message_bytes``); the HTTP/2 flow-control windows (a stream's and the
  connection's) are one message once a call on the connection passed the token check, so a
  client cannot push much more before the server reads; before that they are HTTP/2's default
  (64 KiB), so a stranger pushes no more than that;
- what the server writes and its peer does not read is bounded: h2 answers every PING and SETTINGS
  itself, even while writing is paused, so a peer that sends them and never reads would grow the
  write buffer without end. A connection that made no authenticated call is aborted as soon as its
  writing pauses (``_WRITE_HIGH_WATER_BYTES`` buffered), any other once ``_MAX_WRITE_BUFFER_BYTES``
  are; and a connection the server closes is aborted after a best-effort GOAWAY, so that a peer
  that reads nothing cannot keep its socket and buffer (a graceful close waits for it to read);
- a connection opens at most ``_MAX_STREAMS_PER_CONNECTION`` calls at once, with headers of at
  most ``_MAX_HEADER_LIST_BYTES``;
- connections are limited in number and let go when unauthenticated or idle (:mod:`._links`);
- every count of a request is bounded before it is decoded, and nothing a valid message does not hold is decoded
  (:mod:`._wire`, from the codec); every string of a request is bounded and every float finite before a
  servicer sees it (:mod:`._checks`);
- a refusal for a limit says so in its status details, so that clients do not send the same request again
  (:mod:`._refusals`).

This module and :mod:`._channel` (the client's side) are the ones that reach into grpclib 0.4.9's internals; what
this one relies on:
``grpclib.protocol.Buffer.read`` (``recv_message`` reads a message's prefix with ``read(5)``, then its
body with ``read(length)``, and opens the flow-control window as it takes each chunk),
``grpclib.protocol.Stream.buffer`` (replaced in ``Handler.accept``, which ``EventsProcessor`` calls
before it hands the stream any DATA), ``grpclib.protocol.EventsProcessor.streams`` (the connection's
open calls), ``H2Protocol.connection``/``processor`` and ``Connection._connection`` (the h2
connection), and ``Server._protocol_factory`` with the attributes it reads (``_mapping``, ``_codec``,
``_status_details_codec``, ``__dispatch__``, ``_config``, ``_h2_config``, ``_handlers``), and what
``Server.start`` sets (``_loop``, ``_server``, ``_server_closed_fut``: a TLS server is started with a handshake
timeout grpclib does not pass).
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import socket
import ssl
from collections.abc import Callable, Collection, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, cast

import grpclib.const
import h2.exceptions
import structlog
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError
from grpclib.protocol import Buffer, H2Protocol
from grpclib.protocol import Stream as H2Stream
from grpclib.server import Handler, Server
from h2.errors import ErrorCodes
from h2.settings import SettingCodes

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.rpc._checks import check_request
from stead.core.rpc._links import Link, Links
from stead.core.rpc._proto.stead.v1 import Ack
from stead.core.rpc._refusals import RefusalCodec, over_limit
from stead.core.rpc._wire import check_wire
from stead.core.rpc.address import format_address
from stead.core.rpc.auth import require_token

if TYPE_CHECKING:
    from grpclib._typing import IProtoMessage

__all__ = ["RpcServer", "Servicer"]

log = structlog.get_logger()


class Servicer(Protocol):
    """A service implementation: a generated ``...ServiceBase`` subclass."""

    def __mapping__(self) -> Mapping[str, grpclib.const.Handler]: ...


_DEFAULTS = Settings()
#: the largest request body a server reads unless told otherwise (gRPC's own default)
DEFAULT_MAX_MESSAGE_BYTES = _DEFAULTS.rpc_max_message_bytes
#: calls one connection may have open at once (h2's own default, stated: an agent opens a few)
_MAX_STREAMS_PER_CONNECTION = 100
#: the largest header block of a call (gRPC's metadata limit is 8 KiB; a stead call sends well under 1 KiB)
_MAX_HEADER_LIST_BYTES = 16 << 10
#: HTTP/2's bounds on a flow-control window
_MIN_WINDOW, _MAX_WINDOW = 65_535, 2**31 - 1
#: a gRPC message's prefix: a compression flag and the body's length
_PREFIX_BYTES = 5
#: file descriptors the master keeps for itself (its store, logs, the sockets it opens) below its open-files limit
_RESERVED_FDS = 256
#: a connection's write buffer past which its writing pauses (asyncio's default, stated): the server's calls then
#: wait before they write on; a connection that made no authenticated call is aborted there
_WRITE_HIGH_WATER_BYTES = 64 << 10
#: HTTP/2's default frame size: what a reply writes at a time (grpclib writes one frame, then waits if paused)
_FRAME_BYTES = 16 << 10
#: the most an authenticated connection's write buffer holds before the connection is aborted: what its calls may
#: write once paused (one frame each, as they all wake when writing resumes) over the pause point. Only a peer that
#: stops reading gets there: its own PINGs and SETTINGS, which h2 answers whether writing is paused or not
_MAX_WRITE_BUFFER_BYTES = _WRITE_HIGH_WATER_BYTES + _MAX_STREAMS_PER_CONNECTION * _FRAME_BYTES


class _BoundedBuffer(Buffer):
    """A call's incoming bytes, read no further than one message of at most ``max_bytes``.

    ``recv_message`` asks for a message's body by the length its prefix claims: a claim over the limit is
    refused before anything is taken, so the flow-control window stays shut and the client cannot send on.
    """

    def __init__(self, ack_callback: Callable[[int], None], max_bytes: int, what: str) -> None:
        super().__init__(ack_callback)
        self._max_bytes = max_bytes
        self._what = what

    async def read(self, size: int) -> bytes:
        if size > self._max_bytes:
            over_limit(f"a {self._what} of {size} bytes is over this master's limit of {self._max_bytes} "
                       "bytes (setting rpc_max_message_bytes); send less per call")
        return await super().read(size)


class _StrictProtoCodec(ProtoCodec):
    """A request body that is not the expected message is INVALID_ARGUMENT, not an internal error; one whose
    counts are over their bounds is refused before it is decoded (see :func:`~._wire.check_wire`), and one
    whose strings are over their bounds or whose floats are not finite as it is decoded, before any servicer
    sees it (see :func:`~._checks.check_request`)."""

    def __init__(self, world_size: Callable[[], int | None]) -> None:
        self._world_size = world_size

    def decode(self, data: bytes, message_type: type[IProtoMessage]) -> IProtoMessage:
        check_wire(data, message_type, world_size=self._world_size())
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


class _LinkRoutes:
    """One connection's view of the method table: a call that reaches its method passed the token check
    (grpclib runs the RecvRequest listeners first), which marks the connection authenticated."""

    def __init__(self, routes: _Routes, authenticated: Callable[[], None]) -> None:
        self._routes = routes
        self._authenticated = authenticated

    def get(self, key: str, default: Any = None) -> grpclib.const.Handler:
        found: grpclib.const.Handler = self._routes.get(key)
        passed = self._authenticated

        async def authenticated(stream: Any) -> None:
            passed()
            await found.func(stream)

        return grpclib.const.Handler(authenticated, found.cardinality, found.request_type, found.reply_type)

    def request_name(self, key: str) -> str:
        """What a call of ``key`` sends, for messages: its request type's name."""
        found = dict.get(self._routes, key)
        return found.request_type.__name__ if found is not None else "request message"


class _Handler(Handler):
    """grpclib's per-connection handler, whose calls read at most one bounded message at a time and keep the
    connection's link up to date."""

    def __init__(self, routes: _LinkRoutes, *args: Any, links: Links, link: Link, max_message_bytes: int) -> None:
        super().__init__(cast(dict[str, grpclib.const.Handler], routes), *args)
        self._routes = routes
        self._links = links
        self._link = link
        self._max_message_bytes = max_message_bytes

    def accept(self, stream: H2Stream, headers: Any, release_stream: Callable[[], Any]) -> None:
        assert stream.id is not None
        path = next((value for name, value in headers if name == ":path"), "")
        stream.buffer = _BoundedBuffer(functools.partial(stream.connection.ack, stream.id), self._max_message_bytes,
                                       self._routes.request_name(path))
        links, link = self._links, self._link
        links.active(link)

        def release() -> Any:
            links.active(link)
            return release_stream()

        super().accept(stream, headers, release)


class _Protocol(H2Protocol):
    """A connection: admitted under the connection limit, with stead's HTTP/2 limits, its flow-control windows
    widened to one message once a call authenticates, aborted when its peer does not read what it is sent, closed
    with a GOAWAY that says why."""

    def __init__(self, *args: Any, links: Links, window: int) -> None:
        super().__init__(*args)
        self._links = links
        self._window = window
        self.link = Link(close=self._close, busy=self._busy, peer="", now=links.now())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        cast(asyncio.WriteTransport, transport).set_write_buffer_limits(high=_WRITE_HIGH_WATER_BYTES)
        peer = transport.get_extra_info("peername")
        self.link.peer = format_address(*peer[:2]) if isinstance(peer, tuple) else str(peer)
        h2_conn = self.connection._connection
        h2_conn.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: _MAX_STREAMS_PER_CONNECTION,
                                 SettingCodes.MAX_HEADER_LIST_SIZE: _MAX_HEADER_LIST_BYTES})
        self.connection.flush()
        if not self._links.admit(self.link):
            self._close(f"this master holds its limit of {self._links.max_connections} connections (setting "
                        "rpc_max_connections), each with a call open; try again later", ErrorCodes.ENHANCE_YOUR_CALM)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._links.gone(self.link)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        buffered = self._buffered()
        if buffered > _MAX_WRITE_BUFFER_BYTES:
            self._cut(buffered, _MAX_WRITE_BUFFER_BYTES)

    def pause_writing(self) -> None:
        super().pause_writing()
        if not self.link.authenticated:  # a stranger that does not read: let go once whatever runs now is done
            asyncio.get_running_loop().call_soon(self._cut, self._buffered(), _WRITE_HIGH_WATER_BYTES)

    def authenticated(self) -> None:
        """A call on this connection passed the token check: the first one widens its windows to one message."""
        first = not self.link.authenticated
        self._links.authenticated(self.link)
        if first and self._window > _MIN_WINDOW and not self.connection.is_closing():
            h2_conn = self.connection._connection
            h2_conn.increment_flow_control_window(self._window - _MIN_WINDOW)
            h2_conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: self._window})
            self.connection.flush()

    def _buffered(self) -> int:
        transport = getattr(self.connection, "_transport", None)  # grpclib drops it once closed
        return transport.get_write_buffer_size() if transport is not None else 0

    def _cut(self, buffered: int, bound: int) -> None:
        if self.connection.is_closing():
            return
        self._links.cut(self.link, buffered=buffered)
        self._close(f"this master has {buffered} bytes buffered for this connection, over its bound of {bound} "
                    "bytes, and its peer reads none of them; read what the server sends", ErrorCodes.ENHANCE_YOUR_CALM)

    def _busy(self) -> bool:
        return bool(getattr(self, "processor", None) and self.processor.streams)

    def _close(self, reason: str, code: ErrorCodes = ErrorCodes.NO_ERROR) -> None:
        """Send a GOAWAY that says why, then abort: a graceful close would hold the socket and what is buffered
        until the peer reads it, which a peer that reads nothing never does. The GOAWAY goes out when the
        socket takes it at once, as it does for a peer that reads."""
        if not hasattr(self, "processor"):  # never connected
            return
        transport = getattr(self.connection, "_transport", None)
        try:
            self.connection._connection.close_connection(error_code=code, additional_data=reason.encode()[:1024])
            self.connection.flush()
        except (h2.exceptions.ProtocolError, AttributeError):  # closed already (AttributeError: its transport)
            pass
        if transport is not None:
            transport.abort()
        self.processor.close(reason)


class _Server(Server):
    """grpclib's server with stead's limits (see the module docstring), which also drops its open
    connections when closed, and says UNIMPLEMENTED clearly.

    ``Server.close`` stops listening and cancels the calls in flight, but leaves
    accepted connections open: their clients would wait forever on a stream and
    could still start new calls on a server that was stopped.
    """

    def __init__(self, handlers: Collection[Servicer], *, links: Links, max_message_bytes: int, **kwargs: Any) -> None:
        # HTTP/2's default windows until a call authenticates (see _Protocol.authenticated)
        super().__init__(handlers, config=Configuration(http2_connection_window_size=_MIN_WINDOW,
                                                        http2_stream_window_size=_MIN_WINDOW),
                         status_details_codec=RefusalCodec(), **kwargs)
        self._mapping = _Routes(self._mapping)
        self._links = links
        self._max_message_bytes = max_message_bytes
        self._window = min(max(max_message_bytes + _PREFIX_BYTES, _MIN_WINDOW), _MAX_WINDOW)

    def _protocol_factory(self) -> H2Protocol:
        # grpclib's own, with a handler and a protocol of ours
        self.__gc_step__()
        protocol = _Protocol(None, self._config, self._h2_config, links=self._links, window=self._window)
        handler = _Handler(_LinkRoutes(cast(_Routes, self._mapping), protocol.authenticated), self._codec,
                           self._status_details_codec, self.__dispatch__, links=self._links, link=protocol.link,
                           max_message_bytes=self._max_message_bytes)
        protocol.handler = handler
        self._handlers.add(handler)
        return protocol

    async def serve(self, sock: socket.socket, tls: ssl.SSLContext | None, *, handshake_timeout_s: float) -> None:
        """grpclib's ``start(sock=sock, ssl=tls)``, with TLS handshakes bounded: grpclib passes no handshake
        timeout, and asyncio's default would hold a silent stranger's socket for a minute, before the connection
        limit counts it."""
        if tls is None:
            await self.start(sock=sock)
            return
        self._server = await self._loop.create_server(self._protocol_factory, sock=sock, ssl=tls,
                                                      ssl_handshake_timeout=handshake_timeout_s)
        self._server_closed_fut = self._loop.create_future()

    def drop_connections(self) -> None:
        self._links.close_all("the server was stopped")


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
        max_connections: int = _DEFAULTS.rpc_max_connections,
        idle_timeout_s: float = _DEFAULTS.rpc_idle_timeout_s,
        auth_timeout_s: float = _DEFAULTS.rpc_auth_timeout_s,
        listen_fd: int | None = None,
        world_size: Callable[[], int | None] = lambda: None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``world_size``: the job's largest world (MAX nodes x processes per node), None before there is a job;
        every list of a request with one entry per rank holds at most that many. ``tls``: serve mutual TLS with
        this context (:func:`~stead.core.rpc.tls.server_context`), plain TCP without."""
        self._tls = tls
        self._handlers = tuple(handlers)
        self._world_size = world_size
        self._listen_fd = listen_fd
        self._max_message_bytes = max_message_bytes
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        self._auth_timeout_s = auth_timeout_s
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

    @property
    def connections(self) -> int:
        """The connections the server holds now."""
        return len(self._server._links) if self._server is not None else 0

    async def __aenter__(self) -> Self:
        if self._server is not None:
            raise RuntimeError("RpcServer is already serving; use one `async with` per instance")
        links = Links(max_connections=_connection_limit(self._max_connections),
                      idle_timeout_s=self._idle_timeout_s, auth_timeout_s=self._auth_timeout_s)
        server = _Server(self._handlers, links=links, max_message_bytes=self._max_message_bytes,
                         codec=_StrictProtoCodec(self._world_size))
        require_token(server, self._token, token_file=self._token_file)
        sock = await self._bind()
        try:
            await server.serve(sock, self._tls, handshake_timeout_s=self._auth_timeout_s)
        except BaseException:
            sock.close()
            raise
        self._server = server
        self._port = sock.getsockname()[1]
        log.info("rpc_server_started", host=self._host, port=self._port, max_connections=links.max_connections,
                 max_message_bytes=self._max_message_bytes, tls=self._tls is not None)
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


def _connection_limit(wanted: int) -> int:
    """``wanted``, or fewer where the process's open-files limit would run out first: past it, accepting
    fails for everyone, where at the limit the server can still let an unused connection go for a new one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted <= soft - _RESERVED_FDS:
        return wanted
    capped = max(1, soft - _RESERVED_FDS)
    log.info("rpc_max_connections_capped", wanted=wanted, max_connections=capped, open_files_limit=soft,
             hint="raise the master's open-files limit (ulimit -n) to hold more connections")
    return capped
