"""The job token on the wire: every RPC carries ``authorization: Bearer <token>``.

The server checks the token of every call through a grpclib event listener, so no
service can forget to; the client adds it the same way. The token itself (making
one, its file, the verifier the store keeps) is :mod:`stead.core.tokenfile`.
"""

from __future__ import annotations

import hmac
import os
from typing import NoReturn

import structlog
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.events import RecvRequest, SendRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from stead.core.tokenfile import check_token

__all__ = ["AUTH_METADATA_KEY", "attach_token", "require_token"]

log = structlog.get_logger()

#: the metadata key that carries ``Bearer <token>``
AUTH_METADATA_KEY = "authorization"
_BEARER = "Bearer "


def require_token(server: Server, token: str, *, token_file: str | os.PathLike[str] | None = None) -> None:
    """Make ``server`` answer UNAUTHENTICATED to every call without ``Bearer <token>``."""
    expected = (_BEARER + check_token(token)).encode("ascii")
    where = f"stead writes it to {token_file}" if token_file is not None else \
        "the job's master writes it to a file (mode 0600) when it starts"
    missing = (f"missing job token: send metadata '{AUTH_METADATA_KEY}: Bearer <token>'; "
               f"pass the job's token file: {where}")
    wrong = f"wrong job token: this server belongs to another job or was restarted; pass the job's token file: {where}"

    async def authenticate(event: RecvRequest) -> None:
        values = event.metadata.getall(AUTH_METADATA_KEY, [])
        if not values:
            _reject(event, "missing", missing)
        presented = values[0]
        raw = presented.encode("utf-8", "surrogateescape") if isinstance(presented, str) else presented
        if len(values) != 1 or not hmac.compare_digest(raw, expected):
            _reject(event, "wrong", wrong)

    listen(server, RecvRequest, authenticate)


def _reject(event: RecvRequest, reason: str, message: str) -> NoReturn:
    log.warning("rpc_unauthenticated", method=event.method_name, peer=str(event.peer.addr()), reason=reason)
    raise GRPCError(Status.UNAUTHENTICATED, message)


def attach_token(channel: Channel, token: str) -> None:
    """Make every call on ``channel`` carry ``Bearer <token>``."""
    value = _BEARER + check_token(token)

    async def add_token(event: SendRequest) -> None:
        event.metadata[AUTH_METADATA_KEY] = value

    listen(channel, SendRequest, add_token)
