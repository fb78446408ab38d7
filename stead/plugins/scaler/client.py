"""Asking a running job's master for another size: what `stead scale` and the embedding API call."""

from __future__ import annotations

import dataclasses
import ssl

from stead.plugin import RpcConnection
from stead.plugins.scaler._proto.stead import v1 as proto

__all__ = ["ScaleResult", "request_scale"]


@dataclasses.dataclass(frozen=True)
class ScaleResult:
    """The target the scaler decided, the one before, and why (e.g. capped by the platform's capacity)."""

    target: int
    previous: int
    reason: str


async def request_scale(address: str, token: str, *, nodes: int, by: str, reason: str = "",
                        timeout_s: float = 10.0, tls: ssl.SSLContext | None = None) -> ScaleResult:
    """Ask the master at ``address`` for ``nodes`` nodes; a refusal raises InvalidRequest saying why. ``tls``:
    the client context of a master that serves TLS (``client_tls(settings)``)."""
    conn = RpcConnection(address, token, timeout_s, tls=tls)
    conn.open()
    try:
        with conn.errors("ScalerService.Scale"):
            reply = await proto.ScalerServiceStub(conn.channel).scale(
                proto.ScaleRequest(nodes=nodes, by=by, reason=reason), timeout=timeout_s)
    finally:
        conn.close()
    return ScaleResult(target=reply.target, previous=reply.previous, reason=reply.reason)
