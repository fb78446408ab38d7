"""A bare HTTP/2 peer of a gRPC server: what a broken or hostile client sends, frame by frame.

grpclib's own client keeps to the protocol (it never claims a message longer than it
sends, it opens calls only to make them); tests of the master's limits need a peer that
does not::

    async with await RawPeer.connect(host, port) as peer:
        answer = await peer.call("/stead.v1.AgentService/Heartbeat", token,
                                 prefix=b"\\x00\\xff\\xff\\xff\\xff", total=256 << 20)
        answer.status, answer.sent      # RESOURCE_EXHAUSTED, and how much the server let through

    idle = [await RawPeer.connect(host, port) for _ in range(2000)]  # preface and settings, then nothing

    async with await DeafPeer.connect(host, port) as deaf:  # sends, never reads what the server answers
        await deaf.pings(1 << 20)                          # a megabyte of PINGs, each answered with a PING ACK
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Mapping
from types import TracebackType
from typing import Self

import h2.config
import h2.connection
import h2.events
import h2.exceptions

__all__ = ["DeafPeer", "RawAnswer", "RawPeer"]

#: how much a read takes from the socket at once
_READ_BYTES = 64 << 10
#: a deaf peer's receive buffer: the kernel's smallest, so that what the server answers backs up on the server
_DEAF_RECEIVE_BYTES = 4096
#: one PING frame: 8 bytes of payload (HTTP/2 section 6.7)
_PING = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"\x00" * 8


@dataclasses.dataclass(frozen=True)
class RawAnswer:
    #: bytes of DATA the peer got to send (the server's flow-control windows let them through)
    sent: int
    #: the gRPC status the server answered with (grpc-status), None when it answered none
    status: int | None
    message: str
    #: the headers and trailers the server answered with (grpc-status, grpc-message, its own metadata)
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)


class RawPeer:
    """One HTTP/2 connection, its preface and settings sent; :meth:`call` makes a call of any shape."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 conn: h2.connection.H2Connection) -> None:
        self._reader = reader
        self._writer = writer
        self._conn = conn
        self.host = ""

    @classmethod
    async def connect(cls, host: str, port: int) -> RawPeer:
        reader, writer = await asyncio.open_connection(host, port)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        peer = cls(reader, writer, conn)
        peer.host = host
        return peer

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):  # the server closed it first
            await self._writer.wait_closed()

    async def call(self, path: str, token: str, *, prefix: bytes, total: int, patience_s: float = 10.0) -> RawAnswer:
        """Open a call of ``path`` and send ``prefix`` (a message's 5-byte prefix, or a whole message), then filler
        bytes up to ``total`` as fast as the server's windows allow, until the server answers, or lets nothing
        more through for ``patience_s``."""
        conn = self._conn
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", self.host), ("content-type", "application/grpc+proto"),
                                   ("te", "trailers"), ("authorization", f"Bearer {token}")])
        sent = 0
        headers: dict[str, str] = {}
        filler = b"\0" * conn.max_outbound_frame_size
        answered = False
        while not answered:
            while sent < total and stream in conn.streams and not answered:
                room = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size, total - sent)
                if room <= 0:
                    break
                chunk = prefix[sent:sent + room]
                conn.send_data(stream, chunk + filler[:room - len(chunk)])
                sent += room
            self._writer.write(conn.data_to_send())
            await self._writer.drain()
            try:
                raw = await asyncio.wait_for(self._reader.read(_READ_BYTES), patience_s)
            except TimeoutError:
                break
            if not raw:
                break
            try:
                events = conn.receive_data(raw)
            except h2.exceptions.ProtocolError:
                break
            for event in events:
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    headers.update((str(k), str(v)) for k, v in event.headers)
                if isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    answered = True
            self._writer.write(conn.data_to_send())
        status = headers.get("grpc-status")
        return RawAnswer(sent=sent, status=int(status) if status is not None else None,
                         message=headers.get("grpc-message", ""), headers=headers)

    @property
    def send_window(self) -> int:
        """The connection's flow-control window the server granted: how much DATA it lets this peer send now."""
        return int(self._conn.outbound_flow_control_window)

    async def server_settings(self, within_s: float = 0.5) -> dict[int, int]:
        """The HTTP/2 settings the server announced (what it sent within ``within_s``, acknowledged)."""
        try:
            async with asyncio.timeout(within_s):
                while raw := await self._reader.read(_READ_BYTES):
                    self._conn.receive_data(raw)
                    self._writer.write(self._conn.data_to_send())
        except TimeoutError:
            pass
        return {int(code): value for code, value in self._conn.remote_settings.items()}

    async def closed_by_server(self, within_s: float) -> bool:
        """Whether the server closes this connection within ``within_s`` (reading whatever it sends till then)."""
        try:
            async with asyncio.timeout(within_s):
                while await self._reader.read(_READ_BYTES):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True


class DeafPeer:
    """An HTTP/2 connection that sends and never reads: whatever the server answers stays in the server's buffers.

    Its receive buffer is the kernel's smallest, so the server's answers back up after a few kilobytes.
    """

    def __init__(self, sock: socket.socket, host: str) -> None:
        self._sock = sock
        self._conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self._conn.initiate_connection()
        self.host = host
        #: bytes sent so far
        self.sent = 0

    @classmethod
    async def connect(cls, host: str, port: int) -> DeafPeer:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _DEAF_RECEIVE_BYTES)  # before connect: the window
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        peer = cls(sock, host)
        await peer._send(peer._conn.data_to_send())
        return peer

    @property
    def port(self) -> int:
        """This end's port (the server sees the connection come from it)."""
        return int(self._sock.getsockname()[1])

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    async def call(self, path: str, token: str, message: bytes = b"") -> None:
        """Send a whole unary call of ``path`` with ``token``: its headers and ``message`` (a gRPC frame, prefix
        included; none: an empty message), and end the stream."""
        conn = self._conn
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", self.host), ("content-type", "application/grpc+proto"),
                                   ("te", "trailers"), ("authorization", f"Bearer {token}")])
        conn.send_data(stream, message or b"\x00\x00\x00\x00\x00", end_stream=True)
        await self._send(conn.data_to_send())

    async def pings(self, total: int, *, chunk: int = 64 << 10) -> bool:
        """Send PINGs, ``chunk`` bytes at a time, until ``total`` bytes went or the server closed the connection;
        True: it closed it."""
        frames = _PING * max(1, chunk // len(_PING))
        while self.sent < total:
            try:
                await self._send(frames)
            except OSError:  # reset, or a broken pipe: the server let the connection go
                return True
        return False

    async def _send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self._sock, data)
        self.sent += len(data)
