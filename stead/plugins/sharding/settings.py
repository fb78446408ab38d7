"""Data sharding's settings: ``--set sharding.<name>=value`` or ``STEAD_SHARDING_<NAME>``."""

from __future__ import annotations

import dataclasses

from stead.plugin import setting

__all__ = ["ShardingSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingSettings:
    lease_timeout_s: float = setting(60.0, help="a shard leased to a worker that neither completes nor renews it "
                                                "within this time returns to the queue (0: never)")
    report_interval_s: float = setting(1.0, min=0.001, help="how often a worker's sampler reports its progress to "
                                                             "the master (which renews its leases)")
    wait_s: float = setting(1.0, max=60.0, help="how long the master holds a lease call that finds nothing yet (a "
                                                "round waiting for its ranks, a stream waiting for records) before "
                                                "the worker asks again")
    snapshot_every: int = setting(500, min=1, help="the ledger is written whole every this many journal records")
