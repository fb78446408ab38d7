"""The worker-side samplers with an unchanged DataLoader, against a real master on loopback."""

from __future__ import annotations

import collections
import functools
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch.utils.data import DataLoader

from stead.core.config import Settings
from stead.core.errors import ConfigError, InvalidRequest
from stead.core.master import Master, MasterConfig
from stead.core.rpc import new_token
from stead.data import ShardedSampler, StreamSampler
from stead.plugins.sharding.order import SampleOrder
from stead.plugins.sharding.settings import ShardingSettings

pytestmark = pytest.mark.anyio

#: the sampler's calls block: tests run them in a thread (anyio.to_thread), never on the master's loop
FAST_SHARDS = ShardingSettings(wait_s=0.2, report_interval_s=0.2)
FAST = Settings(retry_initial_s=0.05, retry_max_s=0.2,
                retry_deadline_s=20)
N = 60


def _config(tmp_path: Path, token: str, port: int = 0) -> MasterConfig:
    return MasterConfig(job="data", store_url=f"sqlite:///{tmp_path / 'state.db'}", plugins=["sharding"],
                        tcp_store=False, token=token, token_file=str(tmp_path / "token"), port=port)


@pytest.fixture
async def master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Master]:
    async with Master(_config(tmp_path, new_token())) as m:
        for name, value in (("STEAD_MASTER_ADDR", m.address), ("STEAD_TOKEN_FILE", str(tmp_path / "token")),
                            ("STEAD_ROUND", "1"), ("STEAD_NODE_ID", "node-0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
        yield m


def _sampler(**kw: Any) -> ShardedSampler:
    args: dict[str, Any] = {"size": N, "shard_size": 4, "seed": 5, "epochs": 2, "settings": FAST,
                            "sharding": FAST_SHARDS, "prefetch": 2}
    return ShardedSampler("ids", **{**args, **kw})


def _batches(loader: DataLoader[int], limit: int | None = None, delay: float = 0.0) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(batch.tolist())
        time.sleep(delay)
        if limit is not None and len(out) == limit:
            break
    return out


def _exactly_once(ids: list[int]) -> bool:
    return sorted(ids) == list(range(N))


async def test_without_lockstep_ranks_read_on_demand_and_every_sample_once_per_epoch(master: Master) -> None:
    samplers = [await anyio.to_thread.run_sync(functools.partial(_sampler, rank=r, world_size=2, lockstep=False))
                for r in (0, 1)]
    seen: dict[int, list[list[list[int]]]] = {0: [], 1: []}

    def read(rank: int) -> None:
        loader = DataLoader(list(range(N)), batch_size=3, sampler=samplers[rank])
        for _ in range(2):
            seen[rank].append(_batches(loader, delay=0.0 if rank == 0 else 0.02))

    try:
        async with anyio.create_task_group() as tg:
            for rank in (0, 1):
                tg.start_soon(anyio.to_thread.run_sync, read, rank)
    finally:
        for sampler in samplers:
            await anyio.to_thread.run_sync(sampler.close)
    for epoch in (0, 1):
        epoch_ids = [i for rank in (0, 1) for batch in seen[rank][epoch] for i in batch]
        assert _exactly_once(epoch_ids)
    fast, slow = (sum(len(b) for e in seen[r] for b in e) for r in (0, 1))
    assert fast > slow  # the faster rank leased more shards
    assert samplers[0].epoch == samplers[1].epoch == 2


async def test_in_lockstep_a_slow_rank_reads_as_many_samples_as_the_fast_ones(master: Master) -> None:
    """3 ranks, one 3x slower, 60 samples: 20 each per epoch, every sample once; a 4th rank-less sample is none."""
    world = 3
    samplers = [await anyio.to_thread.run_sync(functools.partial(_sampler, rank=r, world_size=world))
                for r in range(world)]
    seen: dict[int, list[list[int]]] = {r: [] for r in range(world)}

    def read(rank: int) -> None:
        loader = DataLoader(list(range(N)), batch_size=3, sampler=samplers[rank])
        for _ in range(2):
            seen[rank].append([i for b in _batches(loader, delay=0.006 if rank == 1 else 0.002) for i in b])

    try:
        async with anyio.create_task_group() as tg:
            for rank in range(world):
                tg.start_soon(anyio.to_thread.run_sync, read, rank)
    finally:
        for sampler in samplers:
            await anyio.to_thread.run_sync(sampler.close)
    for epoch in (0, 1):
        assert [len(seen[r][epoch]) for r in range(world)] == [N // world] * world
        assert _exactly_once([i for r in range(world) for i in seen[r][epoch]])


async def test_state_dict_before_restore_is_the_whole_dataset_and_the_restore_still_works(
        master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order a script may well write: build the checkpoint's state (sampler cursor included), then load."""
    def first_round() -> dict[str, Any]:
        sampler = _sampler(epochs=1)
        fresh = sampler.state_dict()  # before anything: needs no master round, starts nothing
        assert fresh["remaining"] == [[0, 0, N]]
        ids = [i for _, i in zip(range(12), sampler, strict=False)]
        saved = sampler.state_dict()
        sampler.close()
        assert len(ids) == 12
        return saved

    saved = await anyio.to_thread.run_sync(first_round)
    monkeypatch.setenv("STEAD_ROUND", "2")

    def second_round() -> list[int]:
        sampler = _sampler(epochs=1)
        state = {"sampler": sampler.state_dict()}  # as the old README recipe did, before the restore
        assert state["sampler"]["remaining"] == [[0, 0, N]]
        sampler.load_state_dict(saved)
        try:
            return list(sampler)
        finally:
            sampler.close()

    rest = await anyio.to_thread.run_sync(second_round)
    assert len(rest) == N - 12


async def test_a_crash_restores_the_cursor_and_the_surviving_steps_read_each_sample_once(
        master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    first = await anyio.to_thread.run_sync(lambda: _sampler(epochs=1))
    loader = DataLoader(list(range(N)), batch_size=5, sampler=first)

    def run_until_crash() -> tuple[list[list[int]], dict[str, Any]]:
        batches, state = [], None
        for step, batch in enumerate(loader, start=1):
            batches.append(batch.tolist())
            if step == 3:
                state = json.loads(json.dumps(first.state_dict()))  # a checkpoint: JSON round trip
            if step == 5:
                break  # the worker dies here: steps 4 and 5 are lost with it
        assert state is not None
        return batches, state

    batches, state = await anyio.to_thread.run_sync(run_until_crash)
    assert state["epoch"] == 0 and state["remaining"][0] == [0, 15, N]  # mid-shard: slot 15 of shard [12, 16)
    monkeypatch.setenv("STEAD_ROUND", "2")

    def restart() -> list[list[int]]:
        second = _sampler(epochs=1)
        second.load_state_dict(state)
        try:
            return _batches(DataLoader(list(range(N)), batch_size=5, sampler=second))
        finally:
            second.close()
            first.close()

    after = await anyio.to_thread.run_sync(restart)
    order = SampleOrder(size=N, shard_size=4, seed=5, shuffle=True)
    surviving = [i for b in batches[:3] for i in b] + [i for b in after for i in b]
    assert surviving == order.samples(0, 0, N)  # exactly once, and in the same order as without a crash


async def test_with_dataloader_workers_the_cursor_counts_what_the_loop_used(
        master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    first = await anyio.to_thread.run_sync(lambda: _sampler(epochs=1))
    loader = DataLoader(list(range(N)), batch_size=4, sampler=first, num_workers=2, prefetch_factor=2)

    def run() -> tuple[list[int], dict[str, Any]]:
        used: list[int] = []
        for batch in loader:
            used += batch.tolist()
            if len(used) == 12:
                break
        assert first.consumed > 12  # the workers prefetched more than the loop took
        return used, first.state_dict(consumed=12)

    used, state = await anyio.to_thread.run_sync(run)
    monkeypatch.setenv("STEAD_ROUND", "2")

    def restart() -> list[int]:
        second = _sampler(epochs=1)
        second.load_state_dict(state)
        try:
            rest = [i for b in _batches(DataLoader(list(range(N)), batch_size=4, sampler=second)) for i in b]
            with pytest.raises(InvalidRequest, match="consumed=99 must be between 0 and"):
                second.state_dict(consumed=99)
            return rest
        finally:
            second.close()
            first.close()

    assert _exactly_once(used + await anyio.to_thread.run_sync(restart))


async def test_the_sampler_rides_out_a_master_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second master listens on the first one's port, as a restarted master would for its agents."""
    token = new_token()
    async with Master(_config(tmp_path, token)) as m:
        port = int(m.address.rsplit(":", 1)[1])
        for name, value in (("STEAD_MASTER_ADDR", m.address), ("STEAD_TOKEN_FILE", str(tmp_path / "token")),
                            ("STEAD_ROUND", "1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
        sampler = await anyio.to_thread.run_sync(lambda: _sampler(epochs=1, prefetch=1, shard_size=2))
        ids: list[int] = []
        half, done = threading.Event(), threading.Event()

        def read() -> None:
            for i in sampler:
                ids.append(i)
                if len(ids) == N // 2:
                    half.set()
                time.sleep(0.005)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, read)
            assert await anyio.to_thread.run_sync(half.wait, 60)
            await m.__aexit__(None, None, None)  # the master goes away mid-epoch ...
            async with Master(_config(tmp_path, token, port=port)):  # ... and comes back on the same store
                assert await anyio.to_thread.run_sync(done.wait, 60)
                await anyio.to_thread.run_sync(sampler.close)
    assert _exactly_once(ids)


async def test_a_streaming_source_is_read_as_records_arrive_until_it_is_closed(master: Master) -> None:
    sampler = await anyio.to_thread.run_sync(
        lambda: StreamSampler("events", partitions={0: (100, 103), 1: (0, 2)}, shard_size=2, settings=FAST,
                              sharding=FAST_SHARDS))
    got: list[tuple[int, int]] = []
    first, done = threading.Event(), threading.Event()

    def read() -> None:
        for record in sampler:
            got.append(record)
            if len(got) == 5:
                first.set()
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, read)
        assert await anyio.to_thread.run_sync(first.wait, 30)
        assert not await anyio.to_thread.run_sync(done.wait, 0.3)  # the source is open: the reader waits
        await anyio.to_thread.run_sync(lambda: sampler.extend({0: (100, 106), 2: (7, 8)}))
        with pytest.raises(InvalidRequest, match="went backwards"):
            await anyio.to_thread.run_sync(lambda: sampler.extend({1: (0, 1)}))
        await anyio.to_thread.run_sync(lambda: sampler.extend({}, closed=True))
    await anyio.to_thread.run_sync(sampler.close)
    expected = [(0, o) for o in range(100, 106)] + [(1, 0), (1, 1), (2, 7)]
    assert sorted(got) == expected and len(got) == len(expected)


async def test_misuse_is_refused_with_what_to_do(master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    def misuse() -> None:
        sampler = _sampler()
        saved = sampler.state_dict()
        next(iter(sampler))
        with pytest.raises(InvalidRequest, match="after it began iterating; restore the checkpoint before"):
            sampler.load_state_dict(saved)
        monkeypatch.setenv("STEAD_ROUND", "2")
        other = _sampler()
        with pytest.raises(InvalidRequest, match="the cursor is for dataset 'x', not 'ids'"):
            other.load_state_dict({**saved, "dataset": "x"})
        with pytest.raises(InvalidRequest, match="that is malformed"):
            other.load_state_dict({**saved, "remaining": [[1, 2]]})
        with pytest.raises(InvalidRequest, match="already registered as a size=60"):
            _sampler(size=61)  # this process's reader of round 2 checks it
        monkeypatch.setenv("STEAD_ROUND", "3")
        with pytest.raises(InvalidRequest, match="already registered as a size=60"):
            _sampler(size=61)  # a new reader: refused, and its thread stopped
        monkeypatch.setenv("STEAD_ROUND", "2")
        two = _sampler(rank=1, world_size=2)
        two.load_state_dict(saved)
        with pytest.raises(InvalidRequest, match=r"with torch\.distributed: call init_process_group"):
            two.state_dict()
        for each in (sampler, other, two):
            each.close()
        assert not [t for t in threading.enumerate() if t.name.startswith("stead-data-")]

    await anyio.to_thread.run_sync(misuse)
    monkeypatch.delenv("STEAD_MASTER_ADDR")
    with pytest.raises(ConfigError, match="needs a stead master to hand out records: run the script with `stead run`"):
        StreamSampler("events", partitions={0: (0, 4)}, shard_size=2, rank=0, world_size=2)


def test_without_stead_one_process_reads_the_same_order_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STEAD_MASTER_ADDR", "STEAD_ROUND", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    sampler = ShardedSampler("local", size=N, shard_size=7, seed=1, epochs=2)
    epochs = [list(sampler), list(sampler), list(sampler)]
    sampler.close()
    order = SampleOrder(size=N, shard_size=7, seed=1, shuffle=True)
    assert epochs == [order.samples(0, 0, N), order.samples(1, 0, N), []]
    assert collections.Counter(epochs[0]) == collections.Counter(range(N))
    assert isinstance(torch.tensor(epochs[0][:3]), torch.Tensor)
