"""ShardService over real grpclib on loopback: bad input, and the plugin inside a real master."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.config import Settings
from stead.core.errors import InvalidRequest
from stead.core.events import JobSubmitted, WorkerFailed
from stead.core.events.log import EventLog
from stead.core.master import Master, MasterConfig
from stead.core.rpc import RpcServer, attach_token, new_token
from stead.core.store import StateStore, open_store
from stead.plugins.sharding import proto as sharding_proto
from stead.plugins.sharding.client import ShardClient
from stead.plugins.sharding.ledger import CursorState, DatasetSpec, Range
from stead.plugins.sharding.service import ShardService, StreamId
from stead.plugins.sharding.servicer import ShardServicer
from stead.plugins.sharding.settings import ShardingSettings

pytestmark = pytest.mark.anyio

SPEC = DatasetSpec(name="ids", shard_size=4, size=40, seed=2, epochs=1)
STREAM = DatasetSpec(name="events", shard_size=10, streaming=True)


def _who(rank: int, world: int = 1, dataset: str = "ids", round_: int = 1) -> StreamId:
    return StreamId(dataset, round_, rank, world, f"node-{rank}", f"nonce-{rank}")


@pytest.fixture
async def served() -> AsyncIterator[tuple[ShardService, ShardClient, str, str]]:
    store = await open_store("memory://")
    service = ShardService(store, prefix="/stead/jobs/t/plugins/sharding/v1", settings=ShardingSettings(),
                           max_world_size=lambda: 4)
    token = new_token()
    async with RpcServer([ShardServicer(service)], token=token) as server, \
            ShardClient(server.address, token, call_timeout_s=10) as client:
        yield service, client, server.address, token
    await store.close()


def _state(service: ShardService) -> dict[str, Any]:
    return {name: ds.ledger.to_json() for name, ds in service._datasets.items()}


async def test_bad_input_is_invalid_argument_saying_what_to_do_and_changes_nothing(
        served: tuple[ShardService, ShardClient, str, str]) -> None:
    service, client, address, token = served
    await client.register(SPEC, {}, False)
    await client.register(STREAM, {0: (0, 50)}, False)
    lease = await client.lease(_who(0), epoch=0, have=0, count=1, consumed=0, wait_s=1)
    assert lease.ranges == ((0, 0, 4),)
    bad: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: client.register(DatasetSpec(name="ids", shard_size=4, size=41, seed=2), {}, False),
         "already registered as a size=40, shard_size=4, seed=2, epochs=1, shuffle=True, lockstep=False, not size=41"),
        (lambda: client.register(DatasetSpec(name="ids", shard_size=4, size=40, seed=3), {}, False),
         "register it as it was .* or give the new definition another name"),
        (lambda: client.lease(_who(0, dataset="other"), epoch=0, have=0, count=1, consumed=0, wait_s=0),
         "dataset 'other' is not registered; create the sampler"),
        (lambda: client.report(_who(0), consumed=5, epoch=0, release_rest=False),
         "reports 5 samples of dataset 'ids' consumed, but only 4 were leased to it"),
        (lambda: client.report(_who(0, world=1, round_=1, dataset="events"), consumed=1, epoch=0,
                               release_rest=False), "round 1 of dataset 'events' has not started"),
        (lambda: client.register(STREAM, {0: (0, 40)}, False),
         "partition 0 of streaming source 'events' went backwards: its end offset is 50, the update says 40"),
        (lambda: client.restore(_who(0, round_=2), CursorState("f00", 0, ())), "another definition of dataset"),
        (lambda: client.lease(_who(0), epoch=0, have=1, count=-1, consumed=0, wait_s=0), "ask for 1 to"),
        (lambda: client.lease(_who(0, world=2**31 - 1, round_=3), epoch=0, have=0, count=1, consumed=0, wait_s=0),
         r"world_size=2147483647 of dataset 'ids' is not a world this job can have; pass the data-parallel world "
         r"size, 1 to 4 \(the job's MAX nodes x processes per node\)"),
        (lambda: client.save(_who(0, world=5, round_=3), consumed=[0] * 5, epochs=[0] * 5, wait_s=0),
         "world_size=5 of dataset 'ids' is not a world"),
        (lambda: client.restore(_who(0, world=0, round_=3), CursorState("", 0, ())),
         "world_size=0 of dataset 'ids' is not a world"),
    ]
    before = _state(service)
    for call, message in bad:
        with pytest.raises(InvalidRequest, match=message):
            await call()
        assert _state(service) == before
    channel = Channel(*address.rsplit(":", 1))  # the status on the wire is INVALID_ARGUMENT
    attach_token(channel, token)
    try:
        with pytest.raises(GRPCError) as caught:
            await sharding_proto.ShardServiceStub(channel).lease_shards(
                sharding_proto.LeaseShardsRequest(dataset="no such", node_id="node-0", nonce="n0", count=1), timeout=10)
    finally:
        channel.close()
    assert caught.value.status == Status.INVALID_ARGUMENT and "is not a valid name" in (caught.value.message or "")


async def test_a_cursor_made_over_rpc_restores_a_later_round(
        served: tuple[ShardService, ShardClient, str, str]) -> None:
    _, client, _, _ = served
    await client.register(SPEC, {}, False)
    first = await client.lease(_who(0), epoch=0, have=0, count=2, consumed=0, wait_s=1)
    saved = await client.save(_who(0), consumed=[5], epochs=[0], wait_s=1)
    assert saved.cursor is not None and saved.cursor.remaining == ((0, 5, 40),)
    assert first.ranges == ((0, 0, 8),)
    await client.restore(_who(0, round_=2), saved.cursor)
    again = await client.lease(_who(0, round_=2), epoch=0, have=0, count=1, consumed=0, wait_s=1)
    assert again.ranges == ((0, 5, 8),)
    with pytest.raises(InvalidRequest, match="round 1 of dataset 'ids' is over"):
        await client.lease(_who(0), epoch=0, have=1, count=1, consumed=0, wait_s=0)


@pytest.fixture(params=["sqlite", "etcd"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    url: str = request.getfixturevalue("etcd_url")
    return url


async def _drain(client: ShardClient, who: StreamId, held: list[Range]) -> None:
    """Lease until the epoch is exhausted, appending to ``held`` (the stream's ranges so far)."""
    while not (answer := await client.lease(who, epoch=0, have=len(held), count=3, consumed=0, wait_s=1)).exhausted:
        held.extend(answer.ranges)


async def test_the_plugin_in_a_master_survives_a_master_restart_on_the_same_store_mid_epoch(
        store_url: str, tmp_path: Path) -> None:
    job = f"shards-{uuid.uuid4().hex[:8]}"
    token = new_token()

    def config() -> MasterConfig:
        return MasterConfig(job=job, store_url=store_url, plugins=["sharding"], tcp_store=False, token=token,
                            token_file=str(tmp_path / "token"),
                            settings=Settings.from_mapping({"snapshot_every": 4, "sharding.snapshot_every": 4}))

    held: dict[int, list[Range]] = {0: [], 1: []}
    async with Master(config()) as master, ShardClient(master.address, token, call_timeout_s=10) as client:
        await master.submit_job(JobSubmitted(job=job, min_nodes=2, max_nodes=2, nproc_per_node=1))
        await client.register(SPEC, {}, False)
        await asyncio.gather(*(client.lease(_who(r, world=2), epoch=0, have=0, count=1, consumed=0, wait_s=5)
                               for r in (0, 1)))
        for rank in (0, 1):
            for _ in range(2):
                held[rank] += (await client.lease(_who(rank, world=2), epoch=0, have=len(held[rank]), count=1,
                                                  consumed=0, wait_s=1)).ranges
        # rank 1's worker fails: the master's plugin gives its unread leases back
        await client.report(_who(1, world=2), consumed=3, epoch=0, release_rest=False)
        await master.submit(WorkerFailed(node_id="node-1", round=1, local_rank=0, rank=1, exit_code=17))
        await master.plugin_host.drain()  # type: ignore[union-attr]
    async with Master(config()) as master, ShardClient(master.address, token, call_timeout_s=10) as client:
        retried = await client.lease(_who(0, world=2), epoch=0, have=len(held[0]) - 1, count=1, consumed=0,
                                     wait_s=1)
        assert retried.ranges == (held[0][-1],)  # a retried call: the last range again, nothing new
        await _drain(client, _who(0, world=2), held[0])
        store = master.store
        records = await EventLog(store, job).read()
    slots = sorted(i for _, s, e in held[0] for i in range(s, e))
    rank1 = sorted(i for _, s, e in held[1] for i in range(s, e))
    assert sorted(slots + rank1[:3]) == list(range(40))  # rank 1 read 3 before it failed: nobody reads them again
    kinds = [r.event.type_name for r in records]
    assert kinds.count("shard.round_started") == 1 and "shard.released" in kinds
    assert len([k for k in kinds if k.startswith("shard.")]) == 3  # registered, round started, released: not a lease
    await _cleanup(store_url, job)


async def _cleanup(url: str, job: str) -> None:
    store: StateStore = await open_store(url)
    try:
        await store.delete_prefix(f"/stead/jobs/{job}/")
    finally:
        await store.close()
