"""Agent extensions: how plugins take part in a node's life without the core importing them.

A plugin that needs the node side (flash checkpoint owns shared memory there;
data sharding may prefetch) registers a factory in the ``stead.agent_extensions``
entry-point group. The agent calls every extension's hooks with keyword arguments
only; a failing hook is logged and skipped, never fatal to the agent.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog

from stead.core.config import Settings
from stead.core.rpc import MasterClient, StartWorkersCmd

__all__ = ["AgentContext", "AgentExtension", "Extensions", "RoundInfo", "load_extensions"]

GROUP = "stead.agent_extensions"
log = structlog.get_logger("stead.agent.extensions")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentContext:
    job: str
    node_id: str
    incarnation: int
    nproc: int
    settings: Settings
    client: MasterClient
    master_address: str
    token_file: str
    #: a private directory of the agent, removed when it exits
    workdir: Path


#: what a round is for this node (round, node_rank, nnodes, nproc_per_node, world_size, restart_count, ...)
RoundInfo = StartWorkersCmd


@runtime_checkable
class AgentExtension(Protocol):
    """Every hook is optional except ``name``; all are ``async`` and keyword-only.

    - ``start(*, ctx)``: the agent registered; allocate what the node keeps across rounds.
    - ``worker_env(*, round, local_rank) -> Mapping[str, str]``: variables for one worker.
    - ``before_round(*, round)``: new workers are about to start (the old ones are stopped).
    - ``after_failure(*, round, local_rank, exit_code, signal)``: a worker of ``round`` failed.
    - ``stop(*, job_ended)``: the agent exits; ``job_ended`` when the job is over (free everything).
    """

    name: str


def load_extensions(settings: Settings) -> list[Any]:
    """Instantiate every installed agent extension; one that fails to load is logged and skipped."""
    loaded = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        try:
            loaded.append(ep.load()(settings=settings))
        except Exception as exc:
            log.warning("agent_extension_unavailable", extension=ep.name, error=repr(exc))
    return loaded


class Extensions:
    """Calls a hook on every extension that has it, guarded."""

    def __init__(self, extensions: list[Any]) -> None:
        self._items = extensions

    async def call(self, hook: str, **kwargs: Any) -> list[Any]:
        results = []
        for ext in self._items:
            fn = getattr(ext, hook, None)
            if fn is None:
                continue
            try:
                result = fn(**kwargs)
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:
                log.error("agent_extension_failed", extension=getattr(ext, "name", "?"), hook=hook, error=repr(exc),
                          exc_info=True)
                continue
            results.append(result)
        return results

    async def worker_env(self, *, round: int, local_rank: int) -> dict[str, str]:
        env: dict[str, str] = {}
        for part in await self.call("worker_env", round=round, local_rank=local_rank):
            if isinstance(part, Mapping):
                env.update({str(k): str(v) for k, v in part.items()})
        return env
