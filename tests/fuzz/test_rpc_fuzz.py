"""Fuzz every RPC of every service a master serves: random well-typed messages and oversized ones.

A real master (RPC server, reactor, store, every bundled plugin) runs in a thread of its
own; hypothesis builds request messages from the protobuf schema itself (every field,
with boundary numbers, NaN and infinities, long and odd strings, long lists). For each
call: the answer is OK or a status that says the caller was wrong (never INTERNAL or
UNKNOWN), a refused call changes nothing in the store, and afterwards the master still
serves and its memory did not grow without bound. ``STEAD_FUZZ_EXAMPLES`` sets the cases
per method (``make chaos`` runs more).

Then the cases a tester found by hand: a value one character over its bound in every
string field of every method (and NaN in every float field), one entry over its bound in
every repeated field of every method (refused before it is decoded), a length prefix that
claims 4 GiB, and thousands of connections that never authenticate. The master's peak RSS over
the run is sampled and printed (``pytest -s``, or ``make chaos``) and held to a generous
bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import resource
import threading
import typing
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.from_thread
import psutil
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stead.core.config import Settings
from stead.core.events import JobSubmitted
from stead.core.master import Master, MasterConfig
from stead.core.platform import NodeSpec
from stead.core.rpc import COUNT_BOUNDS, FIELD_BOUNDS, MAX_TEXT_CHARS, MasterClient, RegisterInfo, attach_token
from stead.plugin import proto
from stead.plugins.ckpt import proto as ckpt_proto
from stead.plugins.scaler import proto as scaler_proto
from stead.plugins.sharding import proto as sharding_proto
from stead.testing.platforms import RecordingPlatform
from tests.support.h2peer import RawAnswer, RawPeer
from tests.support.wire import body_with, grpc_frame, repeated_fields

EXAMPLES = int(os.environ.get("STEAD_FUZZ_EXAMPLES", "120"))
#: over every string field's bound (the longest, a stack dump, is 64 Ki characters) and over the cheapest list one
#: entry over its bound (the longest, a cursor's 2**18 + 1 empty ranges, is 512 KiB)
MAX_MESSAGE = 1 << 20
#: the fuzz master's: the idle-connections case waits this long (and some) for the master to let them go
AUTH_TIMEOUT_S = 1.0
#: what this process's memory may grow by over the whole fuzz run: generous, the master runs in it beside
#: hypothesis and the test's own clients (the 4 GiB-prefix probe alone took 290 MiB before the message limit was
#: checked on the prefix; its own test holds it to far less)
PEAK_GROWTH_BOUND = 512 << 20
#: connections the idle-connections case opens (fewer where this process may not open that many files)
IDLE_CONNECTIONS = 2000
JOB = "fuzz"
#: statuses that say the caller sent something wrong or came at the wrong time, each with a message
CALLER_ERRORS = {Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED, Status.FAILED_PRECONDITION, Status.NOT_FOUND,
                 Status.UNAVAILABLE, Status.OUT_OF_RANGE, Status.ALREADY_EXISTS}

ROUTES: dict[str, Handler] = {}
for base in (proto.AgentServiceBase, ckpt_proto.CheckpointServiceBase, sharding_proto.ShardServiceBase,
             scaler_proto.ScalerServiceBase):
    ROUTES.update(base().__mapping__())  # type: ignore[abstract]

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-2, 12), st.sampled_from([low, high, low + 1, high - 1, 2**20, 2**31 - 1]).filter(
        lambda v: low <= v <= high), st.integers(low, high))


_TEXT = st.one_of(
    st.sampled_from(["", "node-0", "node-1", "ids", "a/b", " ", "\x00", "é" * 3]),
    st.text(max_size=40),
    st.text(alphabet="ab-0", min_size=200, max_size=2000),
)
_DOUBLE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e300, 5.0]))
_SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "int32": _ints(*_INT32), "sint32": _ints(*_INT32), "sfixed32": _ints(*_INT32),
    "int64": _ints(*_INT64), "sint64": _ints(*_INT64), "sfixed64": _ints(*_INT64),
    "uint32": _ints(0, 2**32 - 1), "fixed32": _ints(0, 2**32 - 1),
    "uint64": _ints(0, 2**64 - 1), "fixed64": _ints(0, 2**64 - 1),
    "double": _DOUBLE, "float": st.floats(width=32, allow_nan=True, allow_infinity=True),
    "bool": st.booleans(), "string": _TEXT, "bytes": st.binary(max_size=64),
}


def _inner(hint: Any) -> Any:
    """``X`` from ``list[X]`` or ``X | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return _inner(args[0]) if args else hint


def message(cls: type, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of ``cls`` with every field drawn from its protobuf type."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in dataclasses.fields(cls):
        meta = field.metadata["betterproto"]
        kind = meta.proto_type
        if kind == "message":
            if depth > 2:
                continue
            one: st.SearchStrategy[Any] = message(_inner(hints[field.name]), depth + 1)
        elif kind == "enum":
            enum = _inner(hints[field.name])
            one = st.sampled_from(list(enum))
        elif field.name == "wait_s":  # a long wait is honoured (up to a cap): the fuzz keeps waits short
            one = st.one_of(st.floats(0.0, 0.05), st.floats(max_value=-1e-9), st.just(float("nan")))
        elif kind in _SCALARS:
            one = _SCALARS[kind]
        else:
            continue
        if meta.repeated:
            one = st.lists(one, max_size=6) | st.lists(one, min_size=200, max_size=400, unique_by=id)
        elif meta.optional or kind == "message":
            one = st.none() | one
        fields[field.name] = one
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: cls(**values))


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    return NodeSpec(job=JOB, node_id=node_id, incarnation=incarnation, command=("true",))


class PeakRss:
    """This process's resident memory (the master runs in it), sampled in a thread of its own; its peak."""

    def __init__(self, every_s: float = 0.02) -> None:
        self.start = self.peak = _rss()
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="fuzz-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._every_s):
            self.peak = max(self.peak, _rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


@dataclasses.dataclass
class Running:
    portal: anyio.from_thread.BlockingPortal
    master: Master
    channel: Channel
    rss: PeakRss


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("fuzz")
    # no background writer (diagnosis's watch, the scaler's figures): what a call changes in the store is what the
    # call did
    settings_ = Settings(heartbeat_timeout_s=600.0, rpc_max_message_bytes=MAX_MESSAGE,
                         rpc_auth_timeout_s=AUTH_TIMEOUT_S,
                         plugin_values={"diagnosis": {"hang_detection": "false", "stragglers": "false"},
                                        "scaler": {"sample_every_s": "86400", "policy_every_s": "86400"}})
    config = MasterConfig(job=JOB, store_url="memory://", settings=settings_, platform=RecordingPlatform(),
                          node_spec=_spec, token_file=str(tmp / "fuzz.token"), tcp_store=False)
    with anyio.from_thread.start_blocking_portal() as portal, \
            portal.wrap_async_context_manager(Master(config)) as master:
        portal.call(master.submit_job, JobSubmitted(job=JOB, min_nodes=2, max_nodes=2, nproc_per_node=2))
        portal.call(_register, master)  # one live node, so that some random calls reach the backends
        host, port = master.address.rsplit(":", 1)
        channel = portal.call(_channel, host, int(port), master.token)
        rss = PeakRss()
        try:
            yield Running(portal, master, channel, rss)
        finally:
            rss.stop()
            portal.call(_close, channel)


async def _channel(host: str, port: int, token: str) -> Channel:
    channel = Channel(host, port)
    attach_token(channel, token)
    return channel


async def _close(channel: Channel) -> None:
    channel.close()


async def _register(master: Master) -> None:
    async with MasterClient(master.address, master.token, call_timeout_s=10) as client:
        await client.register(RegisterInfo(node_id="node-0", incarnation=1, host="localhost", pid=1, nproc=2))


async def _revision(master: Master) -> int:
    """The store's revision: any write moves it."""
    return await master.store.revision()


async def _call(channel: Channel, route: str, handler: Handler, request: Any) -> GRPCError | None:
    try:
        async with channel.request(route, handler.cardinality, handler.request_type, handler.reply_type,
                                   timeout=10) as stream:
            await stream.send_message(request, end=True)
            if handler.cardinality is Cardinality.UNARY_STREAM:
                with anyio.move_on_after(0.2):  # a command stream that is valid stays open: one look is enough
                    await stream.recv_message()
                    return None
                await stream.cancel()
            else:
                reply = await stream.recv_message()
                if getattr(reply, "error", ""):  # a HeartbeatStream refuses a heartbeat in its reply
                    return GRPCError(Status.INVALID_ARGUMENT, reply.error)
    except GRPCError as exc:
        return exc
    except StreamTerminatedError:  # the stream cancelled above
        return None
    return None


def check_one(running: Running, route: str, request: Any) -> GRPCError | None:
    before = running.portal.call(_revision, running.master)
    error = running.portal.call(_call, running.channel, route, ROUTES[route], request)
    if error is not None:
        assert error.status in CALLER_ERRORS, f"{route} answered {error.status.name}: {error.message} ({request!r})"
        assert error.message, f"{route} answered {error.status.name} without saying why"
        assert running.portal.call(_revision, running.master) == before, f"{route} was refused but wrote the store"
    return error


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_random_well_typed_requests_are_answered_as_the_caller_s_error_and_refused_ones_change_nothing(
        running: Running, route: str) -> None:
    rss_before = psutil.Process().memory_info().rss

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=message(ROUTES[route].request_type))
    def fuzz(request: Any) -> None:
        check_one(running, route, request)

    fuzz()
    grown = psutil.Process().memory_info().rss - rss_before
    assert grown < 256 << 20, f"{EXAMPLES} calls of {route} grew the master's process by {grown >> 20} MiB"
    assert running.master.state.spec is not None  # the master still has its job, and serves:
    assert check_one(running, "/stead.v1.AgentService/Heartbeat", ROUTES["/stead.v1.AgentService/Heartbeat"]
                     .request_type(node_id="node-0", incarnation=1, round=0, step=-1, workers_alive=0)) is None


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_an_oversized_request_is_resource_exhausted_and_changes_nothing(running: Running, route: str) -> None:
    handler = ROUTES[route]
    text = [f.name for f in dataclasses.fields(handler.request_type)
            if f.metadata["betterproto"].proto_type == "string" and not f.metadata["betterproto"].repeated]
    if not text:
        pytest.skip(f"{handler.request_type.__name__} has no string field to grow")
    request = handler.request_type(**{text[0]: "x" * (MAX_MESSAGE + 1)})
    error = check_one(running, route, request)
    assert error is not None and error.status is Status.RESOURCE_EXHAUSTED, error


def _field_paths(cls: type, kinds: frozenset[str], depth: int = 0) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every field of ``kinds`` in ``cls`` and the messages in it: (its path of field names, ``Owner.field``)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata["betterproto"]
        if meta.proto_type in kinds:
            yield (field.name,), f"{cls.__name__}.{field.name}"
        elif meta.proto_type == "message" and depth < 3:
            for path, owner in _field_paths(_inner(hints[field.name]), kinds, depth + 1):
                yield (field.name, *path), owner


def _request_with(cls: type, path: tuple[str, ...], value: Any) -> Any:
    """A ``cls`` message whose field at ``path`` holds ``value`` (a list of it where a field is repeated)."""
    name, rest = path[0], path[1:]
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    inner = _request_with(_inner(typing.get_type_hints(cls)[name]), rest, value) if rest else value
    return cls(**{name: [inner] if field.metadata["betterproto"].repeated else inner})


def _repeated(cls: type, path: tuple[str, ...]) -> bool:
    """Whether the field at ``path`` of ``cls`` is a list."""
    field = next(f for f in dataclasses.fields(cls) if f.name == path[0])
    if len(path) == 1:
        return bool(field.metadata["betterproto"].repeated)
    return _repeated(_inner(typing.get_type_hints(cls)[path[0]]), path[1:])


def _cases(kinds: frozenset[str]) -> list[tuple[str, tuple[str, ...], str]]:
    return [(route, path, owner) for route in sorted(ROUTES)
            for path, owner in _field_paths(ROUTES[route].request_type, kinds)]


STRING_FIELDS = _cases(frozenset({"string"}))
FLOAT_FIELDS = _cases(frozenset({"double", "float"}))


@pytest.mark.parametrize(("route", "path", "owner"), STRING_FIELDS,
                         ids=[f"{r.rsplit('/', 1)[1]}:{'.'.join(p)}" for r, p, _ in STRING_FIELDS])
def test_every_string_field_of_every_method_is_bounded(running: Running, route: str, path: tuple[str, ...],
                                                        owner: str) -> None:
    longest = FIELD_BOUNDS.get(owner, (MAX_TEXT_CHARS, ""))[0]
    request = _request_with(ROUTES[route].request_type, path, "x" * (longest + 1))
    error = check_one(running, route, request)
    assert error is not None and error.status is Status.INVALID_ARGUMENT, (route, path, error)
    index = "[0]" if _repeated(ROUTES[route].request_type, path) else ""  # a list's entry is named by its index
    assert f".{path[-1]}{index} has {longest + 1} characters: send at most {longest}" in (error.message or ""), error


@pytest.mark.parametrize(("route", "path", "owner"), FLOAT_FIELDS,
                         ids=[f"{r.rsplit('/', 1)[1]}:{'.'.join(p)}" for r, p, _ in FLOAT_FIELDS])
def test_every_float_field_of_every_method_must_be_finite(running: Running, route: str, path: tuple[str, ...],
                                                          owner: str) -> None:
    for value in (float("nan"), float("inf")):
        error = check_one(running, route, _request_with(ROUTES[route].request_type, path, value))
        assert error is not None and error.status is Status.INVALID_ARGUMENT, (route, path, value, error)
        assert f".{path[-1]} is {value!r}: send a finite number" in (error.message or ""), error


BOUNDED_FIELDS = [(route, path, owner) for route in sorted(ROUTES)
                  for path, owner in repeated_fields(ROUTES[route].request_type)]


@pytest.mark.parametrize(("route", "path", "owner"), BOUNDED_FIELDS,
                         ids=[f"{r.rsplit('/', 1)[1]}:{'.'.join(p)}" for r, p, _ in BOUNDED_FIELDS])
def test_every_repeated_field_of_every_method_is_refused_one_entry_over_its_bound(
        running: Running, route: str, path: tuple[str, ...], owner: tuple[str, int]) -> None:
    bound, spec = COUNT_BOUNDS[owner], running.master.state.spec
    assert spec is not None
    most = min(bound.most, spec.max_nodes * spec.nproc_per_node) if bound.per_rank else bound.most
    frame = grpc_frame(body_with(ROUTES[route].request_type, path, most + 1))
    host, port = running.master.address.rsplit(":", 1)
    before = running.portal.call(_revision, running.master)

    async def send() -> RawAnswer:
        async with await RawPeer.connect(host, int(port)) as peer:
            return await peer.call(route, running.master.token, prefix=frame, total=len(frame))

    answer = running.portal.call(send)
    assert answer.status == Status.RESOURCE_EXHAUSTED.value, (route, path, answer)
    assert f".{path[-1]} has {most + 1} entries or more: send at most {most} (" in answer.message, answer
    assert running.portal.call(_revision, running.master) == before, f"{route} was refused but wrote the store"


def test_a_length_prefix_that_claims_4_gib_is_refused_and_the_master_s_memory_stays_put(running: Running) -> None:
    host, port = running.master.address.rsplit(":", 1)
    before = _rss()

    async def lie() -> Any:
        async with await RawPeer.connect(host, int(port)) as peer:
            return await peer.call("/stead.v1.AgentService/Heartbeat", running.master.token,
                                   prefix=b"\x00\xff\xff\xff\xff", total=256 << 20)

    answer = asyncio.run(lie())
    after = _rss()
    print(f"\n4 GiB length prefix + up to 256 MiB of body: the master let {answer.sent >> 10} KiB in; "
          f"RSS {before >> 20} -> {after >> 20} MiB")
    assert answer.status == Status.RESOURCE_EXHAUSTED.value and "rpc_max_message_bytes" in answer.message, answer
    assert answer.sent <= 2 * MAX_MESSAGE, f"the master let {answer.sent} bytes in for a message it refused"
    assert after - before < 64 << 20, f"the master grew by {(after - before) >> 20} MiB"


def test_thousands_of_connections_that_never_authenticate_are_let_go(running: Running) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = min(IDLE_CONNECTIONS, (soft - 512) // 2)  # each is two descriptors here: the peer's and the master's
    host, port = running.master.address.rsplit(":", 1)
    before = _rss()

    async def hold() -> tuple[int, list[bool]]:
        peers = [await RawPeer.connect(host, int(port)) for _ in range(count)]
        try:
            await asyncio.sleep(0.2)  # the master has taken each in (its preface and settings)
            held = _rss()
            closed = await asyncio.gather(*(p.closed_by_server(within_s=AUTH_TIMEOUT_S + 30.0) for p in peers))
            return held, closed
        finally:
            for peer in peers:
                await peer.close()

    held, closed = asyncio.run(hold())
    after = _rss()
    print(f"\n{count} connections that never authenticate: RSS {before >> 20} -> {held >> 20} MiB while held, "
          f"{after >> 20} MiB after the master let them go ({sum(closed)} of {count} closed by the master)")
    assert all(closed), f"{closed.count(False)} of {count} unauthenticated connections were kept"
    assert check_one(running, "/stead.v1.AgentService/Heartbeat", ROUTES["/stead.v1.AgentService/Heartbeat"]
                     .request_type(node_id="node-0", incarnation=1, round=0, step=-1, workers_alive=0)) is None


def test_the_master_s_peak_memory_over_the_fuzz_run_is_bounded(running: Running,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    peak, start = running.rss.peak, running.rss.start
    with capsys.disabled():
        print(f"\nthe master's peak RSS over the fuzz run: {peak >> 20} MiB ({start >> 20} MiB at its start, "
              f"{EXAMPLES} examples per method)")
    assert peak - start < PEAK_GROWTH_BOUND, f"the master's memory grew by {(peak - start) >> 20} MiB"


def test_the_fuzz_strategies_fill_nested_messages() -> None:
    found = []

    @settings(max_examples=50, database=None)
    @given(message(proto.StacksReport))
    def probe(report: proto.StacksReport) -> None:
        found.append(len(report.workers))

    probe()
    assert max(found) > 0


def test_every_served_route_is_fuzzed() -> None:
    assert {r.rsplit("/", 1)[0] for r in ROUTES} == {"/stead.v1.AgentService", "/stead.v1.CheckpointService",
                                                     "/stead.v1.ShardService", "/stead.v1.ScalerService"}
    assert len(ROUTES) == 22  # AgentService.ReportWarned: a warning of the job's stop (Slurm's time limit)

