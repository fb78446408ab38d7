"""Tiny ``python -c`` programs that stand in for agents, and helpers to watch them."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from _polling import until

from stead.core.platform import NodeSpec, PlatformEvent
from stead.core.procs import is_alive

#: a guard against a hung test, not a measured duration
TIMEOUT_S = 30.0

SLEEP = "import time; time.sleep(300)"
EXIT_3 = "import sys; sys.exit(3)"
#: starts a grandchild in the agent's process group, writes its pid to argv[1], then sleeps
SPAWN_CHILD = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "with open(sys.argv[1] + '.tmp', 'w') as f:\n"
    "    f.write(str(child.pid))\n"
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "time.sleep(300)\n"
)


def agent(code: str, *args: str, node: str = "n1", incarnation: int = 1, **fields: object) -> NodeSpec:
    return NodeSpec(job="contract", node_id=node, incarnation=incarnation,
                    command=(sys.executable, "-c", code, *args), **fields)  # type: ignore[arg-type]


async def next_event(events: AsyncIterator[PlatformEvent]) -> PlatformEvent:
    with anyio.fail_after(TIMEOUT_S):
        return await anext(events)


async def remaining_events(events: AsyncIterator[PlatformEvent]) -> list[PlatformEvent]:
    """The events up to the end of the stream (the platform was closed)."""
    with anyio.fail_after(TIMEOUT_S):
        return [event async for event in events]


#: whether ``pid`` runs; a zombie (exited, not yet reaped by init) counts as dead
alive = is_alive


# Polling below is deliberate: the processes and files watched belong to agents, not to the test,
# so there is nothing to wait on.


async def wait_dead(pid: int) -> None:
    await until(lambda: not alive(pid), f"the agent process {pid} ended")


async def wait_running(pid: int, code: str) -> None:
    """Until ``pid`` runs ``code`` (``python -c code``): a launched node's process is reported started before it
    has replaced the forked copy of its parent, whose environment does not name the node yet."""
    with anyio.fail_after(TIMEOUT_S):
        while code.encode() not in (await anyio.Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0"):  # noqa: ASYNC110
            await anyio.sleep(0.02)


async def wait_exists(path: Path) -> None:
    await until(path.exists, f"an agent wrote {path}")


async def read_pid(path: Path) -> int:
    """The pid an agent wrote (atomically) to ``path``."""
    await wait_exists(path)
    return int(await anyio.Path(path).read_text())
