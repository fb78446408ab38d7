"""The effect executor: what the job machine's effects mean in the world.

Nodes are launched and killed through the platform; workers are started and
stopped, and nodes told to exit, through the agents' command streams (:mod:`.command_streams`).
The reactor's effect journal (:mod:`.journal`) claims each effect before it calls
:meth:`Executor.run` and turns an exception into an ``EffectFailed`` event; here an
effect either happens or raises.
A command's effect is done once its command is queued: the command itself
stays in force in the job state until its agent acknowledges it, and a new master
gives it again from there (see :mod:`stead.core.statemachine.commands`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import structlog

from stead.core.errors import EffectDeclined, PlatformError
from stead.core.master.command_streams import CommandStreams
from stead.core.master.rdzv_stores import HEALTH_STORE_ROUND, RoundStores
from stead.core.platform import WARM_FIRST_ENV, NodeSpec, Platform
from stead.core.statemachine import (
    CheckHealth,
    DumpStacks,
    Effect,
    Emit,
    KillNode,
    LaunchNode,
    StartTimer,
    StartWorkers,
    StopNode,
    StopWorkers,
)

__all__ = ["Executor", "NodeSpecFactory"]

log = structlog.get_logger("stead.executor")

NodeSpecFactory = Callable[[str, int, str, str], NodeSpec]
"""(node_id, incarnation, master address, token file) -> NodeSpec"""


class Executor:
    """Runs effects for one master: ``platform`` may be None (nodes are started by hand with `stead agent`)."""

    def __init__(self, *, platform: Platform | None, node_spec: NodeSpecFactory | None, commands: CommandStreams,
                 rounds: RoundStores, address: Callable[[], str], token_file: Path) -> None:
        self.platform = platform
        self.node_spec = node_spec
        self.commands = commands
        self.rounds = rounds
        self._address = address
        self._token_file = token_file

    def spec_for(self, node_id: str, incarnation: int) -> NodeSpec | None:
        """How the platform starts (or, after a master restart, adopts) this node incarnation; None without a
        node spec factory."""
        if self.node_spec is None:
            return None
        return self.node_spec(node_id, incarnation, self._address(), str(self._token_file.resolve()))

    async def run(self, effect: Effect) -> None:
        match effect:
            case LaunchNode():
                if self.platform is None or self.node_spec is None:
                    log.info("node_wanted", node=effect.node_id, incarnation=effect.incarnation,
                             hint="start its agent with `stead agent`")
                    raise EffectDeclined(f"no platform launches {effect.node_id} here")
                spec = self.spec_for(effect.node_id, effect.incarnation)
                assert spec is not None
                if effect.avoid_hosts:
                    spec = dataclasses.replace(spec, avoid_hosts=effect.avoid_hosts)
                if effect.warm_first:
                    spec = dataclasses.replace(spec, env={**spec.env, WARM_FIRST_ENV: "1"})
                if effect.resources:
                    spec = dataclasses.replace(spec, resources={**spec.resources, **dict(effect.resources)})
                try:
                    await self.platform.launch(spec)
                except OSError as exc:
                    raise PlatformError(f"could not launch {effect.node_id} on the {self.platform.name} platform: "
                                        f"{exc}") from exc
            case KillNode():
                if self.platform is not None:
                    await self.platform.kill(effect.node_id, effect.incarnation)
            case StartWorkers():
                self.commands.send(effect, store_addr=await self.rounds.for_round(effect.round))
            case StopWorkers() | StopNode() | DumpStacks():
                self.commands.send(effect)
            case CheckHealth():  # every check rendezvous in the store of "round 0" (rounds count from 1)
                self.commands.send(effect, store_addr=await self.rounds.for_round(HEALTH_STORE_ROUND))
            case Emit() | StartTimer():
                raise PlatformError(f"{effect.kind} effects are the reactor's own, not the executor's: {effect!r}")
