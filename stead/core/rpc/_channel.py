"""grpclib's client channel, which keeps why TLS broke its last connection.

A server that refuses this client's certificate does so after the handshake (TLS 1.3
checks the client's certificate last), and a TLS server hangs up on a plain-text client:
asyncio's server closes either connection without a word, and grpclib reports
"Connection lost". A stead master always speaks first (its HTTP/2 SETTINGS), so a
connection it closed before sending a byte was most likely refused by TLS; but a master at
its connection limit also closes a newcomer at once, and the reset can lose the SETTINGS
and GOAWAY it sent. :class:`Channel` keeps what broke the last connection: ``tls_failure``
(an SSL error: TLS failed, certainly) and ``hung_up`` (no byte heard: likely TLS, possibly
the limit), so that the client says what to check instead of "the master may be restarting",
and retries the second.

Relies on grpclib 0.4.9's ``Channel._protocol_factory`` and the arguments it passes
to ``H2Protocol``.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import grpclib.client
from grpclib.protocol import H2Protocol

__all__ = ["Channel"]

_REFUSED = ("the master hung up right after the TLS handshake, before it sent anything: it refused this client's "
            "certificate (tls_cert_file is not signed by the master's tls_ca_file), or it was at its connection "
            "limit (rpc_max_connections)")
_PLAIN = ("the master hung up before it sent anything: it serves TLS and this client does not (set tls_ca_file, "
          "tls_cert_file and tls_key_file here as on the master's host), or it was at its connection limit "
          "(rpc_max_connections)")


class _Protocol(H2Protocol):
    def __init__(self, *args: Any, channel: Channel) -> None:
        super().__init__(*args)
        self._channel = channel
        self._heard = False
        self._tls = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tls = transport.get_extra_info("sslcontext") is not None
        self._channel.tls_failure = self._channel.hung_up = None
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._heard = True
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        # a stead master speaks first (its SETTINGS) unless TLS failed; its TLS layer closes the connection (or
        # resets it, or the client's next write finds it closed)
        if not self._heard and (exc is None or isinstance(exc, ConnectionError)):
            self._channel.hung_up = _REFUSED if self._tls else _PLAIN
        elif isinstance(exc, ssl.SSLError):
            self._channel.tls_failure = f"the TLS connection broke ({exc.reason or exc})"
        super().connection_lost(exc)


class Channel(grpclib.client.Channel):
    """A grpclib channel whose ``tls_failure`` says why TLS broke its last connection (None: it did not), and
    ``hung_up`` what a connection the master closed before it said anything most likely means (TLS refused it;
    but a master at its connection limit also hangs up, its GOAWAY lost to the reset)."""

    tls_failure: str | None = None
    hung_up: str | None = None

    def _protocol_factory(self) -> H2Protocol:
        return _Protocol(grpclib.client.Handler(), self._config, self._h2_config, channel=self)
