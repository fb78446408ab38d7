"""What a refusal tells the client as data, beside its status: gRPC's status details, which the server controls.

RESOURCE_EXHAUSTED means two different things from a stead master, and a client must tell them apart:

- the request is over one of the master's limits (a message's size, a field's count): the same request is refused
  every time, so retrying it only repeats the refusal;
- the master sheds load for now: the same call will be taken later, after the time it asks the client to wait.

The server raises ``GRPCError(status, message, Refusal(...))``; :class:`RefusalCodec`, the status details codec of
both the server and the clients, carries the :class:`Refusal` in the ``grpc-status-details-bin`` trailer as gRPC's
richer error model does: a ``google.rpc.Status`` whose details are a ``google.rpc.ErrorInfo`` (reason
``OVER_LIMIT``, domain ``stead``) and a ``google.rpc.RetryInfo`` (the retry delay), so that any gRPC client can read
it. grpclib decodes the details on every path a refusal reaches a client (trailers, trailers only, a call reset
while it was still sending), so :mod:`.client` finds the :class:`Refusal` in the error's details and maps it to a
permanent or a retryable error. No client parses the human message.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NoReturn

from grpclib.const import Status
from grpclib.encoding.base import StatusDetailsCodecBase
from grpclib.exceptions import GRPCError

from stead.core.rpc._protowire import fields, length_delimited, varint_field

__all__ = ["ERROR_DOMAIN", "OVER_LIMIT", "Refusal", "RefusalCodec", "over_limit"]

#: google.rpc.ErrorInfo's domain for the reasons stead gives
ERROR_DOMAIN = "stead"
#: google.rpc.ErrorInfo's reason for a request over one of the master's limits: it is refused every time
OVER_LIMIT = "OVER_LIMIT"
_ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
_NANOS = 1_000_000_000


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a call was refused, as data (a ``GRPCError``'s details, on the server and on the client)."""

    #: the request is over a limit: sending it again is refused again
    over_limit: bool = False
    #: wait at least this long before calling again (a master shedding load); 0: no hint
    retry_after_s: float = 0.0


def over_limit(message: str) -> NoReturn:
    """Answer the call with RESOURCE_EXHAUSTED that says it will be refused every time; ``message`` names the limit
    (its setting or bound) and what to send instead."""
    raise GRPCError(Status.RESOURCE_EXHAUSTED, message, Refusal(over_limit=True))


class RefusalCodec(StatusDetailsCodecBase):
    """A :class:`Refusal` as a ``google.rpc.Status``'s details, and back (other details are not sent or read:
    stead raises none)."""

    def encode(self, status: Status, message: str | None, details: Any) -> bytes:
        infos = []  # google.protobuf.Any: its type's URL (1) and the message (2)
        if isinstance(details, Refusal) and details.over_limit:  # ErrorInfo: reason (1), domain (2)
            info = length_delimited(1, OVER_LIMIT.encode()) + length_delimited(2, ERROR_DOMAIN.encode())
            infos.append(length_delimited(1, _ERROR_INFO.encode()) + length_delimited(2, info))
        if isinstance(details, Refusal) and details.retry_after_s > 0:  # RetryInfo: a Duration (1) of s and ns
            seconds, nanos = divmod(round(details.retry_after_s * _NANOS), _NANOS)
            delay = varint_field(1, seconds) + varint_field(2, nanos)
            infos.append(length_delimited(1, _RETRY_INFO.encode()) + length_delimited(2, length_delimited(1, delay)))
        # google.rpc.Status: code (1), message (2), details (3)
        return (varint_field(1, status.value) + length_delimited(2, (message or "").encode())
                + b"".join(length_delimited(3, info) for info in infos))

    def decode(self, status: Status, message: str | None, data: bytes) -> Refusal | None:
        """The :class:`Refusal` in ``data``; None where it holds none, or is not a google.rpc.Status."""
        over, retry_after_s = False, 0.0
        try:
            for number, any_ in fields(data):
                if number != 3 or not isinstance(any_, bytes):
                    continue
                parts = dict(fields(any_))
                value = parts.get(2, b"")
                if parts.get(1) == _ERROR_INFO.encode() and isinstance(value, bytes):
                    info = dict(fields(value))
                    over = over or (info.get(1) == OVER_LIMIT.encode() and info.get(2) == ERROR_DOMAIN.encode())
                elif parts.get(1) == _RETRY_INFO.encode() and isinstance(value, bytes):
                    delay = dict(fields(value)).get(1, b"")
                    retry_after_s = _seconds(dict(fields(delay)) if isinstance(delay, bytes) else {})
        except ValueError:
            return None
        return Refusal(over_limit=over, retry_after_s=retry_after_s) if over or retry_after_s else None


def _seconds(duration: dict[int, int | bytes]) -> float:
    """A google.protobuf.Duration's seconds; 0 for one that is not a duration >= 0."""
    seconds, nanos = duration.get(1, 0), duration.get(2, 0)
    if not isinstance(seconds, int) or not isinstance(nanos, int) or seconds >= 1 << 63:
        return 0.0
    value = seconds + nanos / _NANOS
    return value if math.isfinite(value) and value >= 0 else 0.0
