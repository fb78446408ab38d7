"""Dynamic data sharding: every sample consumed exactly once per epoch, across failures.

Master side, :class:`ShardingPlugin`: a worker registers a dataset (name, size, shard
size, shuffle seed, epochs) or a streaming source (partitions with offsets); the
master leases shards on demand (a faster worker asks sooner, so it gets more), keeps
its ledger in the state store (a journal, group-committed before any answer, so a
restarted master loses no lease) and gives a failed, lost or silent worker's unread
leases back to the queue (``shard_lease_timeout_s``). Worker side,
:class:`stead.data.ShardedSampler`: a ``DataLoader`` sampler that prefetches leases
and reports progress from a background thread (batched, off the training loop).

Exactly once, in four ideas:

1. *Slots and streams.* Epoch ``e`` of the dataset is the slots ``[0, size)`` in a
   fixed shuffled order (:mod:`.order`). Each rank of a round reads one *stream*: the
   ordered ranges leased to it. Its progress is one number, the slots it consumed.
2. *The cursor.* ``sampler.state_dict()`` runs on every rank at the checkpoint's
   step; it all-gathers the ranks' progress and the master computes the cursor:
   the slots the round started from, minus the first ``consumed[r]`` slots of each
   rank's stream. The cursor is that set of slots itself (a frontier per epoch plus
   the holes of shards in flight), so it is small, the same on every rank, and means
   the same thing to any later round, master or store.
3. *Rollback.* A round whose ranks call ``load_state_dict(cursor)`` starts from the
   cursor's slots; a round where no rank restores starts from the whole dataset
   (its model starts from scratch too). The master starts a round's leasing only
   once every rank has said which (restored, or began iterating), so a fast rank
   cannot start the round from scratch while another is restoring.
4. *Leases belong to a round.* A new round never reads the previous round's leases:
   what they held is either in the cursor (not consumed by the steps the checkpoint
   holds) or not (consumed by them). Calls from a stopped round are refused.

What that means in the cases that matter:

* a shard half read at the checkpoint: its unread tail is in the cursor and is
  leased first (in the same order) by the next round; the read half is not re-read;
* shards leased or prefetched but not read, and shards read *after* the checkpoint
  by the round that failed: in the cursor, so read again; the steps that read them
  were lost with the model state, so the surviving history reads them once;
* a rank that failed, moved to another node, or whose node was lost: its stream
  ends with its round; within a round its unread leases go back to the queue at once;
* the world shrank or grew: the cursor names slots, not ranks; the new round's
  ranks lease them on demand, whatever their number;
* restoring an older checkpoint (the newest is corrupt): every cursor stands alone;
* a round without a checkpoint to restore: from the beginning;
* a step skipped after a numerical fault (``numerics.on_nan=skip``): each rank's note names the slots its step held
  (:mod:`.steps`: what the training loop received, not what a DataLoader prefetched) and the ledger records them
  as skipped (read, trained on by no step), so that done + skipped is every sample (``Ledger.tally``).

DataLoader workers prefetch from the sampler ahead of the training loop; the cursor
counts the samples the DataLoader handed the loop (:mod:`.steps`), not those it pulled
ahead, unless ``state_dict(consumed=n)`` says how many the loop really used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stead.plugins.sharding import events as events  # registers the shard.* event kinds (cheap)

__all__ = ["ShardedSampler", "ShardingPlugin", "StreamSampler", "proto"]

if TYPE_CHECKING:
    from stead.plugins.sharding._proto.stead import v1 as proto
    from stead.plugins.sharding.plugin import ShardingPlugin
    from stead.plugins.sharding.sampler import ShardedSampler, StreamSampler


def __getattr__(name: str) -> Any:
    # lazy: the master does not import torch for the sampler, a worker not grpclib's server for the plugin
    if name == "ShardingPlugin":
        from stead.plugins.sharding.plugin import ShardingPlugin

        return ShardingPlugin
    if name in ("ShardedSampler", "StreamSampler"):
        from stead.plugins.sharding import sampler

        return getattr(sampler, name)
    if name == "proto":  # the plugin's wire messages (generated from proto/stead/plugins/sharding/v1)
        from stead.plugins.sharding._proto.stead import v1

        return v1
    raise AttributeError(f"module 'stead.plugins.sharding' has no attribute {name!r}")
