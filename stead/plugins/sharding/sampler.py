"""Samplers that read the shards the master leases: drop-in for ``DataLoader(sampler=...)``.

:class:`ShardedSampler` yields sample ids of a dataset of ``size`` samples;
:class:`StreamSampler` yields ``(partition, offset)`` pairs of a streaming source.
Both take the stream's place from the environment stead gives each worker
(``STEAD_MASTER_ADDR``, ``STEAD_TOKEN_FILE``, ``STEAD_ROUND``, ``RANK``,
``WORLD_SIZE``); a script run by plain ``python`` (one process, no master) reads the
same samples in the same order from an in-process ledger, and each rank of a script
run by plain ``torchrun`` (no master) reads its static share of each epoch
(:class:`~.client.StaticBackend`), with the same API and the same cursors.

The cursor API, for checkpoints::

    state = sampler.state_dict()        # every rank together (it all-gathers); small, JSON-able
    ...                                 # save it with the model, e.g. in a FlashCheckpointer state dict
    sampler.load_state_dict(state)      # every rank, before iterating: the round restarts from it
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from torch.utils.data import Sampler

from stead.core.worker.skipping import watch_samples
from stead.plugin import ConfigError, InvalidRequest, Settings, client_tls, load_settings, read_token_file
from stead.plugins.sharding.client import ShardBackend, ShardClient, StaticBackend
from stead.plugins.sharding.intervals import SlotMap
from stead.plugins.sharding.ledger import UNBOUNDED, CursorState, DatasetSpec, Range
from stead.plugins.sharding.ops import decode_ranges
from stead.plugins.sharding.order import SampleOrder
from stead.plugins.sharding.reader import Connect, Reader, local_backend
from stead.plugins.sharding.service import StreamId
from stead.plugins.sharding.settings import ShardingSettings
from stead.plugins.sharding.steps import step_samples, track_loaders

__all__ = ["CURSOR_VERSION", "ShardedSampler", "StreamSampler"]

#: the version of the dict state_dict() returns
CURSOR_VERSION = 1

T = TypeVar("T")
P = TypeVar("P")
_READERS: dict[tuple[int, str, int, int], Reader] = {}
_READERS_LOCK = threading.Lock()


def _close_all() -> None:
    with _READERS_LOCK:
        readers = [r for key, r in _READERS.items() if key[0] == os.getpid()]
        _READERS.clear()
    for reader in readers:
        reader.close()


atexit.register(_close_all)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _connect(settings: Settings, sharding: ShardingSettings, address: str) -> Connect:
    if address:
        token_file = os.environ.get("STEAD_TOKEN_FILE")
        if not token_file:
            raise ConfigError("STEAD_MASTER_ADDR is set but STEAD_TOKEN_FILE is not: run the script with `stead run`")
        token = read_token_file(token_file)
        tls = client_tls(settings)
        return lambda: ShardClient(address, token, call_timeout_s=settings.rpc_timeout_s, tls=tls)
    return lambda: local_backend(sharding)


def _static(backend: ShardBackend) -> StaticBackend:
    assert isinstance(backend, StaticBackend), f"{backend!r} is not a static partition"
    return backend


class _ShardedBase:
    """What both samplers share: the stream, the epoch and the cursor API."""

    def __init__(self, spec: DatasetSpec, *, prefetch: int, rank: int | None, world_size: int | None,
                 partitions: Mapping[int, tuple[int, int]] | None = None, closed: bool = False,
                 settings: Settings | None = None, sharding: ShardingSettings | None = None) -> None:
        if prefetch < 1:
            raise ConfigError(f"prefetch={prefetch} must be at least 1 (shards leased ahead of reading)")
        self.settings = settings or Settings.from_env()
        self.sharding = sharding or load_settings(ShardingSettings, "sharding")
        self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
        self.rank = rank if rank is not None else _env_int("RANK", 0)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside the world of {self.world_size}; "
                              "pass 0 <= rank < world_size")
        self.spec = spec
        address = os.environ.get("STEAD_MASTER_ADDR", "")
        #: a multi-rank script without a master (plain torchrun): each rank reads its static share
        self.static = not address and self.world_size > 1
        if self.static and spec.streaming:
            raise ConfigError(f"a streaming sampler with world_size={self.world_size} needs a stead master to hand "
                              "out records: run the script with `stead run` (plain python or torchrun have none)")
        connect = ((lambda: local_backend(self.sharding, static=True)) if self.static
                   else _connect(self.settings, self.sharding, address))
        round_ = _env_int("STEAD_ROUND", 1)
        key = (os.getpid(), spec.name, round_, self.rank)
        with _READERS_LOCK:
            reader = _READERS.get(key)
            shared = reader is not None
            if reader is None:
                who = StreamId(spec.name, round_, self.rank, self.world_size,
                               os.environ.get("STEAD_NODE_ID") or socket.gethostname(), os.urandom(8).hex())
                reader = _READERS[key] = Reader(
                    spec=spec, who=who, settings=self.settings, sharding=self.sharding, prefetch=prefetch,
                    partitions=partitions, closed=closed,
                    connect=connect)
        self._reader = reader
        # a skipped step names its samples (see .steps): what the training loop received from the DataLoader
        track_loaders()
        watch_samples(step_samples)
        if shared:  # a second sampler of this process's stream: the master checks that the definition matches
            reader.call(lambda b: b.register(spec, partitions or {}, closed), what="register")

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (advances when an iteration runs out)."""
        return self._reader.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` next (as DistributedSampler.set_epoch; not needed, the sampler counts epochs)."""
        if epoch < 0:
            raise ConfigError(f"epoch {epoch} must be >= 0")
        self._reader.epoch = epoch

    @property
    def consumed(self) -> int:
        """Samples this rank has taken from the sampler in this round (its position in its stream)."""
        return self._reader.consumed

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The cursor of a checkpoint taken now: every sample not consumed by the steps it holds.

        Call it on every rank at the same step (it all-gathers every rank's progress with
        torch.distributed when world_size > 1, then asks the master); before the sampler
        has read or restored anything it is the whole dataset and needs nobody. The result is the
        same small JSON-able dict on every rank. ``consumed``: the samples the training
        loop has really used in this round (default: those a DataLoader handed the loop, not
        those it prefetched, see :mod:`.steps`; without a DataLoader every sample handed out).
        """
        reader = self._reader
        mine = reader.steps.received_to() if consumed is None else consumed
        if not 0 <= mine <= reader.consumed:
            raise InvalidRequest(f"consumed={mine} must be between 0 and the {reader.consumed} samples this "
                                 "sampler has handed out in this round")
        # the epoch the loop is in: a DataLoader that pulled ahead past the epoch's end has moved the sampler's on
        at = reader.steps.part_at(mine) if mine < reader.consumed and not self.spec.streaming else None
        epoch = reader.epoch if at is None else min(reader.epoch, at)
        if not self.spec.streaming and not reader.started_reading and not reader.declared:
            # nothing read and nothing restored yet (a script that builds its checkpoint's state before restoring
            # it): the cursor is where the round would start. Asking the master would start the round from the
            # beginning, and the restore that follows would be refused.
            cursor = CursorState(self.spec.fingerprint(), reader.epoch,
                                 tuple((e, 0, self.spec.size) for e in range(reader.epoch, self.spec.epochs)))
        elif self.static:
            cursor = self._static_cut(mine, epoch)
        else:
            progress = _gather(self.rank, (mine, epoch), self.world_size)
            cursor = reader.save([c for c, _ in progress], [e for _, e in progress])
        return {
            "version": CURSOR_VERSION,
            "dataset": self.spec.name,
            "fingerprint": cursor.fingerprint,
            "epoch": cursor.epoch,
            "remaining": [[p, s, None if e >= UNBOUNDED else e] for p, s, e in cursor.remaining],
        }

    def _static_cut(self, consumed: int, epoch: int) -> CursorState:
        reader = self._reader
        who = reader.who
        mine = reader.call(lambda b: _static(b).heads(who, consumed), what="save")
        everyone = _gather(self.rank, (epoch, mine.to_json()), self.world_size)
        read = SlotMap()
        for _, ranges in everyone:
            read.update(SlotMap(decode_ranges(ranges)))
        epochs = [epoch for epoch, _ in everyone]
        return reader.call(lambda b: _static(b).cursor_after(who, read, epochs), what="save")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restart this round from a checkpoint's cursor; call it on every rank before iterating."""
        reader = self._reader
        if reader.started_reading:
            raise InvalidRequest(f"load_state_dict() on the sampler of {self.spec.name!r} after it began "
                                 "iterating; restore the checkpoint before the first iteration")
        cursor = _cursor_from_state(state, self.spec.name)
        reader.restore(cursor)
        reader.epoch = cursor.epoch

    def close(self) -> None:
        """Give back the shards leased but not read and stop the background thread (also done at exit)."""
        with _READERS_LOCK:
            for key, reader in list(_READERS.items()):
                if reader is self._reader:
                    del _READERS[key]
        self._reader.close()

    def _iterate(self, epoch: int, samples: Callable[[int, int, int], list[T]]) -> Iterator[T]:
        reader = self._reader
        step = self.spec.shard_size
        entry = reader.entry
        stale = not self.spec.streaming and entry is not None and entry[0] != epoch  # read in another epoch
        unread = reader.chunk_index < len(reader.chunk) or (entry is not None and reader.entry_pos < entry[2])
        reader.begin(epoch, leftovers=stale and unread)
        if stale:
            reader.entry, reader.chunk, reader.chunk_index = None, [], 0
        while True:
            chunk: list[T] = reader.chunk
            while reader.chunk_index < len(chunk):
                index = reader.chunk_index
                reader.chunk_index = index + 1
                reader.consumed += 1
                yield chunk[index]
            entry = reader.entry
            if entry is None or reader.entry_pos >= entry[2]:
                entry = reader.next_range(epoch)
                if entry is None:
                    break
                reader.entry, reader.entry_pos = entry, entry[1]
            start = reader.entry_pos
            stop = min(entry[2], (start // step + 1) * step)
            reader.chunk, reader.chunk_index, reader.entry_pos = samples(entry[0], start, stop), 0, stop
        if reader.epoch == epoch:
            reader.epoch = epoch + 1


class ShardedSampler(_ShardedBase, Sampler[int]):
    """Sample ids ``0 .. size-1`` of dataset ``name``, leased shard by shard from the master.

    One iteration reads one epoch (the next one each time, or the one
    :meth:`set_epoch` names), ``prefetch`` shards ahead.

    ``lockstep=True`` (the default, for DDP and FSDP): every rank reads the same
    number of samples in each epoch, so every rank takes the same number of steps.
    Each round splits what is left of each epoch into equal blocks, one per rank;
    the last ``remaining % world_size`` samples of an epoch are left out of it (as
    ``DistributedSampler(drop_last=True)``; fewer than ``world_size``, other ones
    each epoch as the order is reshuffled). ``lockstep=False`` (asynchronous or
    independent workers): shards are leased on demand, a faster rank reads more,
    nothing is left out, and ranks may get different numbers of samples.
    """

    def __init__(self, name: str, *, size: int, shard_size: int, seed: int = 0, epochs: int = 1,
                 shuffle: bool = True, lockstep: bool = True, prefetch: int = 4, rank: int | None = None,
                 world_size: int | None = None, settings: Settings | None = None,
                 sharding: ShardingSettings | None = None) -> None:
        spec = DatasetSpec(name=name, shard_size=shard_size, size=size, seed=seed, epochs=epochs, shuffle=shuffle,
                           lockstep=lockstep)
        super().__init__(spec, prefetch=prefetch, rank=rank, world_size=world_size, settings=settings,
                         sharding=sharding)
        self._order = SampleOrder(size=size, shard_size=shard_size, seed=seed, shuffle=shuffle)

    def __iter__(self) -> Iterator[int]:
        return self._iterate(self._reader.epoch, self._order.samples)

    def __repr__(self) -> str:
        return f"ShardedSampler({self.spec.name!r}, rank={self.rank}/{self.world_size}, epoch={self.epoch})"


class StreamSampler(_ShardedBase, Sampler[tuple[int, int]]):
    """``(partition, offset)`` pairs of streaming source ``name``, leased in ranges from the master.

    ``partitions`` maps each partition to ``(start, end)``: the first offset to read and
    one past the last record that exists now. :meth:`extend` announces new records;
    iteration waits for records while the source is open and ends once it is
    ``closed`` and read.
    """

    def __init__(self, name: str, *, partitions: Mapping[int, tuple[int, int]], shard_size: int,
                 closed: bool = False, prefetch: int = 4, rank: int | None = None, world_size: int | None = None,
                 settings: Settings | None = None, sharding: ShardingSettings | None = None) -> None:
        spec = DatasetSpec(name=name, shard_size=shard_size, streaming=True)
        super().__init__(spec, prefetch=prefetch, rank=rank, world_size=world_size, partitions=partitions,
                         closed=closed, settings=settings, sharding=sharding)

    def extend(self, partitions: Mapping[int, tuple[int, int]], *, closed: bool = False) -> None:
        """New partitions, or new end offsets of known ones (never lower); ``closed``: no more records."""
        spec = self.spec
        self._reader.call(lambda b: b.register(spec, partitions, closed), what="register")

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return self._iterate(0, _offsets)

    def __repr__(self) -> str:
        return f"StreamSampler({self.spec.name!r}, rank={self.rank}/{self.world_size})"


def _offsets(partition: int, start: int, stop: int) -> list[tuple[int, int]]:
    return [(partition, offset) for offset in range(start, stop)]


def _gather(rank: int, mine: P, world_size: int) -> list[P]:
    """Every rank's ``mine``, ordered by rank."""
    if world_size == 1:
        return [mine]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidRequest(f"state_dict() of a sampler with world_size={world_size} collects every rank's "
                             "progress with torch.distributed: call init_process_group() first")
    if dist.get_world_size() != world_size:
        raise InvalidRequest(f"the sampler's world_size={world_size} differs from torch.distributed's "
                             f"{dist.get_world_size()}; give the sampler the process group's size")
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (rank, mine))
    ranks = [r for r, _ in gathered]
    if sorted(ranks) != list(range(world_size)):
        raise InvalidRequest(f"the ranks of the sampler are {sorted(ranks)}, not 0..{world_size - 1}; "
                             "give each process its own rank")
    return [payload for _, payload in sorted(gathered, key=lambda pair: int(pair[0]))]


def _cursor_from_state(state: Mapping[str, Any], name: str) -> CursorState:
    problem = "not a dict"
    if isinstance(state, Mapping):
        problem = ""
        if state.get("version") != CURSOR_VERSION:
            problem = f"version {state.get('version')!r} is not {CURSOR_VERSION}"
        elif state.get("dataset") != name:
            raise InvalidRequest(f"the cursor is for dataset {state.get('dataset')!r}, not {name!r}; pass each "
                                 "sampler its own dataset's state_dict()")
    if not problem:
        try:
            remaining = tuple(_range(item) for item in state["remaining"])
            return CursorState(str(state["fingerprint"]), int(state["epoch"]), remaining)
        except (KeyError, TypeError, ValueError) as exc:
            problem = f"malformed ({exc!r})"
    raise InvalidRequest(f"load_state_dict() got a cursor of {name!r} that is {problem}; pass the dict "
                         "state_dict() returned, unchanged")


def _range(item: Any) -> Range:
    part, start, end = item
    return int(part), int(start), UNBOUNDED if end is None else int(end)
