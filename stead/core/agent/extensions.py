"""Agent extensions: how plugins take part in a node's life without the core importing them.

A plugin that needs the node side (flash checkpoint owns shared memory there;
data sharding may prefetch) registers a factory in the ``stead.agent_extensions``
entry-point group, under the plugin's name: it gets the plugin's typed settings
(the same ``settings_class`` and namespace). The agent calls every extension's
hooks with keyword arguments only; a failing hook is logged and skipped, never
fatal to the agent.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import structlog

from stead.core.config import Settings
from stead.core.entrypoints import installed, load_group
from stead.core.rpc import MasterClient, StartWorkersCmd

__all__ = ["AgentContext", "AgentExtension", "Extensions", "RoundInfo", "load_extensions"]

GROUP = "stead.agent_extensions"
log = structlog.get_logger("stead.agent.extensions")


S = TypeVar("S")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentContext:
    job: str
    node_id: str
    incarnation: int
    nproc: int
    #: stead's settings (the extension's own arrived with its factory)
    settings: Settings
    client: MasterClient
    master_address: str
    token_file: str
    #: a private directory of the agent, removed when it exits
    workdir: Path


#: what a round is for this node (round, node_rank, nnodes, nproc_per_node, world_size, restart_count, ...)
RoundInfo = StartWorkersCmd


class AgentExtension(Generic[S]):
    """Base class of the node side of a plugin; every hook is optional, async and keyword-only.

    - ``start(*, ctx)``: the agent registered; allocate what the node keeps across rounds.
    - ``worker_env(*, round, local_rank) -> Mapping[str, str]``: variables for one worker.
    - ``before_round(*, round)``: new workers are about to start (the old ones are stopped).
    - ``after_failure(*, round, local_rank, exit_code, signal)``: a worker of ``round`` failed.
    - ``warned(*, reason)``: the node will be stopped soon (Slurm's time-limit warning, SIGUSR1): save what must
      survive now; the workers go on.
    - ``stop(*, job_ended)``: the agent exits; ``job_ended`` when the job is over (free everything).
    - ``cleanup(*, job, node_id, incarnation)``: that agent was killed and no later one of its node started:
      free what it left on this machine (``stead agent --cleanup`` calls it when the platform closes).
    """

    #: the plugin's name (the entry point's name and the settings' namespace)
    name: ClassVar[str] = ""
    settings_class: ClassVar[type | None] = None

    def __init__(self, *, settings: S) -> None:
        self.settings = settings


def load_extensions(settings: Settings, *, plugins: Sequence[str] | None = None,
                    disabled: Sequence[str] = ()) -> list[Any]:
    """Instantiate the agent extensions of the job's plugins (``--plugins``/``--no-plugin`` apply here too).

    One that fails to load is logged and skipped: the node runs without it.
    """
    from stead.core.plugins import instantiate

    names = installed(GROUP)
    enabled = None if plugins is None else [name for name in plugins if name in names]
    return load_group(GROUP, what="agent extension", enabled=enabled, disabled=disabled,
                      validate=lambda name, factory, source: instantiate(name, factory, source, settings))


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
