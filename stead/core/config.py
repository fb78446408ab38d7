"""One typed configuration object with defaults that work on a laptop.

Every timeout and interval stead uses is a named, documented setting here, never
a magic number in the code. Settings can be overridden from the command line
(``--set name=value``) or the ``STEAD_<NAME>`` environment variables.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from stead.core.errors import ConfigError

__all__ = ["Settings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    #: seconds between an agent's heartbeats
    heartbeat_interval_s: float = 0.5
    #: a node whose agent sent no heartbeat for this long is declared lost
    heartbeat_timeout_s: float = 5.0
    #: after MIN nodes joined, wait this long for more (up to MAX) before a round starts
    last_call_timeout_s: float = 1.0
    #: fail the job when fewer than MIN nodes joined within this time
    join_timeout_s: float = 600.0
    #: a plugin handler running longer than this is cancelled and counted as a failure
    plugin_timeout_s: float = 10.0
    #: a plugin that failed this many times in a row is disabled
    plugin_max_failures: int = 3
    #: write a snapshot of the folded state every this many events
    snapshot_every: int = 500
    #: after a snapshot, the store's change history older than this many revisions is compacted (0: never)
    store_history_keep: int = 100_000
    #: first delay when retrying an unavailable store or master; doubled up to the max
    retry_initial_s: float = 0.2
    retry_max_s: float = 5.0
    #: give up retrying an unavailable store or master after this long
    retry_deadline_s: float = 60.0
    #: a store call that takes longer than this counts as "store unavailable"
    store_timeout_s: float = 5.0
    #: an RPC to the master that takes longer than this counts as "master unavailable"
    rpc_timeout_s: float = 5.0
    #: polling interval of the sqlite watch (other processes' writes)
    sqlite_watch_poll_s: float = 0.05
    #: how long workers get between SIGTERM and SIGKILL when stopped
    worker_stop_grace_s: float = 3.0
    #: how many trailing lines of a failed worker's stderr are reported
    error_tail_lines: int = 40
    #: how often the agent samples step progress, and the master records it as an event
    progress_interval_s: float = 1.0
    #: how long `stead run` waits for nodes to exit after the job ended
    shutdown_grace_s: float = 5.0

    # -- flash checkpoint (stead.plugins.ckpt) --------------------------------------------------
    #: where checkpoints are persisted (a job's go under <ckpt_dir>/<job>); relative to the working directory
    ckpt_dir: str = ".stead/checkpoints"
    #: how many persisted checkpoints are kept per job
    ckpt_keep_last: int = 2
    #: how long save() waits for the previous save to be committed by every rank before it skips this one
    ckpt_commit_wait_s: float = 5.0
    #: how long an agent's long poll for a commit may stay open at the master
    ckpt_commit_poll_s: float = 10.0
    #: how long a worker waits for its agent to answer (allocating and pre-faulting shared memory included)
    ckpt_agent_timeout_s: float = 60.0
    #: how long load() waits for the agent to verify the checksums of the slot it restores
    ckpt_verify_wait_s: float = 30.0
    #: how long an exiting agent waits for persists still running before it frees the shared memory
    ckpt_persist_grace_s: float = 60.0
    #: 1: when a worker fails, the agent writes the newest committed step to disk (if not there yet); 0: never
    ckpt_persist_on_failure: int = 1

    # -- data sharding (stead.plugins.sharding) -------------------------------------------------
    #: a shard leased to a worker that neither completes nor renews it within this time returns to the queue
    shard_lease_timeout_s: float = 60.0
    #: how often a worker's sampler reports its progress to the master (which renews its leases)
    shard_report_interval_s: float = 1.0
    #: how long the master holds a lease call that finds nothing yet (a round waiting for its ranks,
    #: a streaming source waiting for records) before the worker asks again
    shard_wait_s: float = 1.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: Settings | None = None) -> Settings:
        """Settings with ``values`` (strings or typed) applied over ``base``."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        changes: dict[str, Any] = {}
        for name, raw in values.items():
            field = known.get(name)
            if field is None:
                raise ConfigError(f"unknown setting {name!r}; known settings: {', '.join(sorted(known))}")
            kind: type = {"float": float, "int": int, "str": str}.get(str(field.type), str)
            try:
                value = kind(raw)
            except (TypeError, ValueError):
                raise ConfigError(f"setting {name}={raw!r} is not a valid {kind.__name__}") from None
            if kind is not str and value < 0:
                raise ConfigError(f"setting {name}={raw!r} must not be negative")
            changes[name] = value
        return dataclasses.replace(base or cls(), **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        prefix = "STEAD_"
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k[len(prefix):].lower(): v for k, v in env.items()
                  if k.startswith(prefix) and k[len(prefix):].lower() in names}
        return cls.from_mapping(values)

    def to_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
