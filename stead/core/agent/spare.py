"""A spare agent: started warm before any node needs it, it becomes a node's agent when told which.

A cold agent spends seconds before its node can train: a Python interpreter, stead's
imports, a zygote that imports torch (and torch._dynamo, which DDP needs). A platform
that keeps a spare (``spare_agents``, the local platform) skips all of it for a lost
node's replacement: the spare has done that work already and waits, reading its stdin,
for one JSON line ``{"node_id": "node-1", "incarnation": 2}``. It then takes that node's
identity (its process title, :func:`stead.core.platform.agent_title`, which a later master
adopting it by pid checks) and runs as that node's agent, with its warm zygote.

EOF before that line (the job ended, or the master that kept the spare died) ends the
spare cleanly, having joined nothing.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

import anyio
import structlog

from stead.core.agent.main import (
    ZYGOTE_LATE_PRELOAD,
    ZYGOTE_PRELOAD,
    load_run_config,
    run_agent,
    zygote_env,
)
from stead.core.agent.warned import WarningSource
from stead.core.agent.zygote import Zygote
from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.platform import AGENT_IDENTITY_ENV, agent_title
from stead.core.rpc import read_token_file, tls_files

__all__ = ["parse_identity", "run_spare_agent"]

log = structlog.get_logger("stead.agent")


def parse_identity(line: str) -> tuple[str, int]:
    """``(node_id, incarnation)`` from the line a platform writes to a spare; ConfigError saying what is wrong."""
    try:
        found = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"a spare agent read {line.strip()[:200]!r}, not JSON: {exc}; the platform must write "
                          '{"node_id": ..., "incarnation": ...}') from exc
    node_id = found.get("node_id") if isinstance(found, Mapping) else None
    incarnation = found.get("incarnation") if isinstance(found, Mapping) else None
    if not isinstance(node_id, str) or not node_id or not isinstance(incarnation, int) or incarnation < 1:
        raise ConfigError(f"a spare agent read {line.strip()[:200]!r}: it needs a non-empty string node_id and an "
                          "incarnation >= 1")
    return node_id, incarnation


async def run_spare_agent(*, master: str, token_file: str, settings: Settings,
                          warning_source: WarningSource | None = None) -> int:
    """Start warm, wait for a node identity on stdin, then run as that node's agent (0 on EOF: not needed);
    ``warning_source``: who sends the SIGUSR1 warning (see :class:`~stead.core.agent.main.Agent`)."""
    config = load_run_config()
    read_token_file(token_file)  # a bad token file fails now, not when a node is waiting for this spare
    tls_files(config.settings)  # so do bad TLS settings
    preload = () if config.no_python else (*ZYGOTE_PRELOAD, *ZYGOTE_LATE_PRELOAD)
    async with Zygote(config.settings, preload=preload, env=zygote_env(config)) as zygote:
        log.info("spare_agent_waiting", job=config.job_name, pid=os.getpid())
        line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        if not line.strip():
            log.info("spare_agent_not_needed", job=config.job_name)
            return 0
        node_id, incarnation = parse_identity(line)
        _take_identity(config.job_name, node_id, incarnation)
        log.info("spare_agent_assigned", node=node_id, incarnation=incarnation, zygote_ready=zygote.ready)
        return await run_agent(master=master, token_file=token_file, node_id=node_id, incarnation=incarnation,
                               settings=settings, config=config, zygote=zygote, warning_source=warning_source)


def _take_identity(job: str, node_id: str, incarnation: int) -> None:
    os.environ[AGENT_IDENTITY_ENV] = f"{job}/{node_id}/{incarnation}"  # what the workers inherit, as from a launch
    try:
        import setproctitle
    except ImportError:  # pragma: no cover - a pinned dependency
        return
    setproctitle.setproctitle(agent_title(job, node_id, incarnation))
