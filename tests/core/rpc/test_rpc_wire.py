"""Counts are bounded on the wire before a request is decoded; a request over a bound is not retried."""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, cast

import betterproto2
import psutil
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from hypothesis import given, settings
from hypothesis import strategies as st

from stead.core.config import Settings
from stead.core.errors import InvalidRequest
from stead.core.rpc import (
    COUNT_BOUNDS,
    MAX_ENTRIES,
    MAX_UNKNOWN_FIELDS,
    AgentServicer,
    HeartbeatInfo,
    MasterClient,
    Refusal,
    RefusalCodec,
    RpcServer,
    check_wire,
    retrying,
)
from stead.core.rpc.backend import MAX_BATCH_BEATS, AgentBackend
from stead.plugin import proto as pb
from stead.plugins.ckpt import SLOTS
from stead.plugins.ckpt import proto as ckpt_pb
from stead.plugins.scaler import proto as scaler_pb
from stead.plugins.sharding import proto as sharding_pb
from tests.support.h2peer import RawPeer
from tests.support.wire import body_with, grpc_frame, repeated_fields

pytestmark = pytest.mark.anyio

#: every request type a master serves (the bundled plugins' included)
REQUESTS = sorted({h.request_type for base in (pb.AgentServiceBase, ckpt_pb.CheckpointServiceBase,
                                                sharding_pb.ShardServiceBase, scaler_pb.ScalerServiceBase)
                   for h in base().__mapping__().values()}, key=lambda cls: cls.__name__)  # type: ignore[abstract]
#: every message of stead's protocols and of the bundled plugins', by name (COUNT_BOUNDS names them so)
MESSAGES: dict[str, type] = {name: cls for module in (pb, ckpt_pb, sharding_pb, scaler_pb)
                             for name, cls in vars(module).items()
                             if isinstance(cls, type) and issubclass(cls, betterproto2.Message)}
#: (request type, path of the field, its bound's key) for every bounded field a request can hold
BOUNDED = [(cls, path, owner) for cls in REQUESTS for path, owner in repeated_fields(cls)]
BEAT = HeartbeatInfo(node_id="node-0", incarnation=1, round=0, step=None, workers_alive=2)
#: what the master's memory may grow by while it refuses a 4 MiB message (it reads the message: 4 MiB, in chunks)
REFUSAL_GROWTH_BOUND = 12 << 20


def _refusal(data: bytes, cls: type, **kwargs: Any) -> GRPCError:
    with pytest.raises(GRPCError) as caught:
        check_wire(data, cls, **kwargs)
    return caught.value


def test_the_bounds_table_names_each_field_by_its_number_and_covers_every_repeated_field_of_every_request() -> None:
    for (message, number), bound in COUNT_BOUNDS.items():
        meta = MESSAGES[message]._betterproto  # type: ignore[attr-defined]
        assert meta.field_name_by_number[number] == bound.field, (message, number)
    reachable = {owner for _, _, owner in BOUNDED}
    assert reachable == set(COUNT_BOUNDS), "a repeated field without a bound, or a bound of no field"


def test_a_checkpoint_rank_s_held_steps_fit_their_bound() -> None:
    assert COUNT_BOUNDS["RankSaved", 3].most >= SLOTS and COUNT_BOUNDS["RankSaved", 4].most >= SLOTS


@pytest.mark.parametrize(("cls", "path", "owner"), BOUNDED, ids=[".".join((c.__name__, *p)) for c, p, _ in BOUNDED])
def test_every_bounded_field_passes_at_its_bound_and_is_refused_one_over(cls: type, path: tuple[str, ...],
                                                                         owner: tuple[str, int]) -> None:
    most = COUNT_BOUNDS[owner].most
    check_wire(body_with(cls, path, most), cls)
    error = _refusal(body_with(cls, path, most + 1), cls)
    assert error.status is Status.RESOURCE_EXHAUSTED and error.details == Refusal(over_limit=True)
    assert f".{path[-1]} has {most + 1} entries or more: send at most {most} (" in (error.message or "")


def test_a_list_with_one_entry_per_rank_is_bounded_by_the_job_s_world() -> None:
    body = body_with(sharding_pb.SaveCursorRequest, ("consumed",), 9)
    check_wire(body, sharding_pb.SaveCursorRequest)  # no job known: the static bound
    check_wire(body, sharding_pb.SaveCursorRequest, world_size=9)
    error = _refusal(body, sharding_pb.SaveCursorRequest, world_size=8)
    assert "SaveCursorRequest.consumed has 9 entries or more: send at most 8 (one per rank, and this job's world" \
        in (error.message or "")


def test_packed_numbers_are_counted_however_long_and_however_split() -> None:
    at_bound = bytes(pb.FailureReport(exited_ok_ranks=list(range(10**6, 10**6 + 1024))))  # 3 bytes each
    check_wire(at_bound, pb.FailureReport)
    half = bytes(pb.FailureReport(exited_ok_ranks=list(range(513))))
    error = _refusal(half + half, pb.FailureReport)  # two packed chunks of one field
    assert "FailureReport.exited_ok_ranks has 1026 entries or more: send at most 1024" in (error.message or "")
    unpacked = b"\x68\x00" * 1024  # field 13 one varint at a time
    check_wire(unpacked, pb.FailureReport)
    assert _refusal(unpacked + b"\x68\x00", pb.FailureReport).status is Status.RESOURCE_EXHAUSTED


def test_a_repeated_field_no_bound_names_holds_at_most_max_entries() -> None:
    body = body_with(pb.HeartbeatBatchReply, ("unknown",), MAX_ENTRIES)
    check_wire(body, pb.HeartbeatBatchReply)
    assert _refusal(body + body_with(pb.HeartbeatBatchReply, ("unknown",), 1), pb.HeartbeatBatchReply).status \
        is Status.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(("body", "said"), [
    (b"\x12\x03\x01\x02\x03", "HeartbeatRequest.incarnation comes length-delimited, where its type is sent a varint"),
    (b"\x0a\x01x\x0a\x01y", "HeartbeatRequest.node_id comes 2 times: a field that is not repeated is sent once"),
    (b"\x40\x01", "HeartbeatRequest.phase comes a varint, where its type is sent length-delimited"),
    (b"\xf8\x01\x01" * (MAX_UNKNOWN_FIELDS + 1), f"more than {MAX_UNKNOWN_FIELDS} fields this master does not know"),
    (b"\x0b", "wire type 3"),
    (b"\x0a\x05ab", "field 1 runs past the end of its message"),
    (b"\x10" + b"\x80" * 11 + b"\x01", "a varint is cut off or longer than 10 bytes"),
], ids=["packed-singular", "singular-twice", "string-as-varint", "unknown-fields", "group", "cut-off", "long-varint"])
def test_what_no_valid_message_holds_is_invalid_argument_before_it_is_decoded(body: bytes, said: str) -> None:
    error = _refusal(body, pb.HeartbeatRequest)
    assert error.status is Status.INVALID_ARGUMENT and said in (error.message or ""), error.message


def test_a_newer_client_s_few_unknown_fields_pass() -> None:
    check_wire(bytes(pb.HeartbeatRequest(node_id="n", incarnation=1)) + b"\xf8\x01\x01" * MAX_UNKNOWN_FIELDS,
               pb.HeartbeatRequest)


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.binary(max_size=64), cls=st.sampled_from(REQUESTS))
def test_any_bytes_are_passed_or_refused_with_a_status(data: bytes, cls: type) -> None:
    try:
        check_wire(data, cls)
    except GRPCError as exc:
        assert exc.status in (Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED) and exc.message


class _Beats:
    """The one backend method a batch of heartbeats reaches."""

    def __init__(self) -> None:
        self.batched = 0

    async def heartbeats(self, beats: Sequence[HeartbeatInfo]) -> Sequence[str]:
        self.batched += len(beats)
        return []


@pytest.fixture
def beats() -> _Beats:
    return _Beats()


@contextlib.contextmanager
def _peak_growth() -> Iterator[list[int]]:
    """How much this process's resident memory grew at its peak inside the block (sampled): ``[bytes]``."""
    process, stop = psutil.Process(), threading.Event()
    before = peak = process.memory_info().rss
    grown = [0]

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.005):
            peak = max(peak, process.memory_info().rss)

    thread = threading.Thread(target=sample, name="peak-rss", daemon=True)
    thread.start()
    try:
        yield grown
    finally:
        stop.set()
        thread.join()
        grown[0] = max(peak, process.memory_info().rss) - before


async def test_a_4_mib_batch_of_2_million_empty_heartbeats_is_refused_undecoded_and_one_at_the_bound_is_taken(
        beats: _Beats, token: str) -> None:
    frame = grpc_frame(b"\x0a\x00" * 2_000_000)  # 4 MB: under the default message limit of 4 MiB
    async with RpcServer([AgentServicer(cast(AgentBackend, beats))], token=token) as server:
        async with await RawPeer.connect(server.host, server.port) as peer:
            with _peak_growth() as growth:
                answer = await peer.call("/stead.v1.AgentService/Heartbeats", token, prefix=frame, total=len(frame))
        grown = growth[0]
        print(f"\n2 million empty heartbeats in {len(frame) >> 10} KiB: answered {answer.status}, RSS grew by at "
              f"most {grown / 2**20:.1f} MiB")
        assert answer.status == Status.RESOURCE_EXHAUSTED.value, answer
        assert (f"HeartbeatBatch.beats has {MAX_BATCH_BEATS + 1} entries or more: send at most {MAX_BATCH_BEATS} "
                "(MAX_BATCH_BEATS per call: split the batch)") in answer.message
        details = base64.b64decode(answer.headers["grpc-status-details-bin"] + "==")
        assert RefusalCodec().decode(Status.RESOURCE_EXHAUSTED, answer.message, details) == Refusal(over_limit=True)
        assert grown < REFUSAL_GROWTH_BOUND, f"refusing it took {grown >> 20} MiB"
        assert beats.batched == 0
        async with MasterClient(server.address, token, call_timeout_s=60) as client:
            assert await client.heartbeats([BEAT] * MAX_BATCH_BEATS) == []
    assert beats.batched == MAX_BATCH_BEATS


async def test_a_request_over_a_count_bound_is_a_permanent_error_and_is_not_retried(beats: _Beats,
                                                                                   token: str) -> None:
    async with RpcServer([AgentServicer(cast(AgentBackend, beats))], token=token) as server, \
            MasterClient(server.address, token, call_timeout_s=60) as client:
        calls = 0

        async def send() -> list[str]:
            nonlocal calls
            calls += 1
            return await client.heartbeats([BEAT] * (MAX_BATCH_BEATS + 1))

        with pytest.raises(InvalidRequest, match=r"over its limits .*send at most 10000 \(MAX_BATCH_BEATS"):
            await retrying(send, Settings(retry_deadline_s=30.0))
    assert calls == 1 and beats.batched == 0
