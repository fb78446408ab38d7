"""A refusal for a limit is a permanent error; a master shedding load is retried after the time it sends as data."""

from __future__ import annotations

from typing import Any

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.errors import InvalidRequest, Overloaded, RpcUnavailable
from stead.core.rpc import AgentServicer, MasterClient, Refusal, RefusalCodec, RegisterInfo, RpcServer

pytestmark = pytest.mark.anyio

REGISTER = RegisterInfo(node_id="node-0", incarnation=1, host="h", pid=1, nproc=1)


@pytest.mark.parametrize("refusal", [Refusal(over_limit=True), Refusal(retry_after_s=8.0),
                                     Refusal(over_limit=True, retry_after_s=0.25)])
def test_a_refusal_travels_as_google_rpc_status_details(refusal: Refusal) -> None:
    codec = RefusalCodec()
    data = codec.encode(Status.RESOURCE_EXHAUSTED, "refused", refusal)
    assert codec.decode(Status.RESOURCE_EXHAUSTED, "refused", data) == refusal


@pytest.mark.parametrize("data", [b"", b"\x08\x08", b"\x1a\xff", b"\x1a\x02\x0a\x00", b"\x07"])
def test_details_without_a_refusal_or_that_are_not_a_status_read_as_none(data: bytes) -> None:
    assert RefusalCodec().decode(Status.RESOURCE_EXHAUSTED, "refused", data) is None


async def test_a_request_over_the_message_limit_is_a_permanent_error(backend: Any, token: str) -> None:
    async with RpcServer([AgentServicer(backend)], token=token, max_message_bytes=64 << 10) as server, \
            MasterClient(server.address, token, call_timeout_s=10) as client:
        too_big = RegisterInfo(node_id="node-0", incarnation=1, host="h" * (65 << 10), pid=1, nproc=1)
        with pytest.raises(InvalidRequest, match=r"setting rpc_max_message_bytes.*refused every time"):
            await client.register(too_big)
    assert backend.calls == 0


async def test_a_shedding_master_s_retry_after_is_carried_as_data(backend: Any, client: MasterClient) -> None:
    # the master's words say 99 s; what it sends as data says 1.5 s: the client goes by the data
    backend.error = Overloaded("the master is busy (it said: retry after 99 s)", retry_after_s=1.5)
    with pytest.raises(RpcUnavailable, match="RESOURCE_EXHAUSTED") as caught:
        await client.register(REGISTER)
    assert caught.value.retry_after_s == 1.5


async def test_a_resource_exhausted_without_a_hint_is_retryable(backend: Any, client: MasterClient) -> None:
    backend.error = GRPCError(Status.RESOURCE_EXHAUSTED, "some quota ran out")
    with pytest.raises(RpcUnavailable, match="some quota ran out") as caught:
        await client.register(REGISTER)
    assert caught.value.retry_after_s == 0.0
