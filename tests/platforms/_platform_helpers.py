"""Tiny ``python -c`` programs that stand in for agents, and helpers to watch them."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from _polling import until

from stead.core.events import RoomFound
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

#: a host of a job over several machines (the hosts and Slurm platforms' rows), as its `stead run` is:
#: ``python -c HOST_STEP FOLDER ARGS_JSON`` offers itself to the master that ``ARGS_JSON`` (`stead run`'s multi-node
#: flags and script) names, with the token in ``STEAD_JOB_TOKEN``, and runs the nodes it is told to on this machine's
#: platform. The one difference: a node's agent runs the command the contract launched it with, which the master's
#: side wrote to ``FOLDER/NODE.INCARNATION.json`` (the master's Launch names the node only: a real host makes its
#: `stead agent` command itself)
HOST_STEP = (
    "import asyncio, json, os, sys\n"
    "from pathlib import Path\n"
    "from stead.cli.run_args import parse_run_args\n"
    "from stead.core.jobtoken import JOB_TOKEN_ENV\n"
    "from stead.core.platform import NodeSpec\n"
    "from stead.platforms.hosts import join_job\n"
    "from stead.platforms.local import LocalPlatform\n"
    "folder, args = Path(sys.argv[1]), json.loads(sys.argv[2])\n"
    "config = parse_run_args(args, environ={}, cwd=str(folder))\n"
    "def node_spec(node_id, incarnation, address, token_file):\n"
    "    path = folder / f'{node_id}.{incarnation}.json'\n"
    "    command = tuple(json.loads(path.read_text())) if path.exists() else ()  # (asked for a spare's: none)\n"
    "    return NodeSpec(job=config.job_name, node_id=node_id, incarnation=incarnation, command=command)\n"
    "sys.exit(asyncio.run(join_job(config, token=os.environ[JOB_TOKEN_ENV], local=LocalPlatform(config.settings),\n"
    "                              node_spec=node_spec, keepalive_s=float(os.environ['CONTRACT_KEEPALIVE_S']))))\n"
)


def agent(code: str, *args: str, node: str = "n1", incarnation: int = 1, **fields: object) -> NodeSpec:
    return NodeSpec(job="contract", node_id=node, incarnation=incarnation,
                    command=(sys.executable, "-c", code, *args), **fields)  # type: ignore[arg-type]


def _of_nodes(event: PlatformEvent) -> bool:
    """Whether ``event`` is of a node's life: not a platform's hint that it has room for one (RoomFound, which the
    hosts platform gives as hosts offer themselves or free up), which it may give at any time."""
    return not isinstance(event, RoomFound)


async def next_event(events: AsyncIterator[PlatformEvent]) -> PlatformEvent:
    """The next event of a node's life."""
    with anyio.fail_after(TIMEOUT_S):
        async for event in events:
            if _of_nodes(event):
                return event
    raise AssertionError("the platform's events ended")


async def remaining_events(events: AsyncIterator[PlatformEvent]) -> list[PlatformEvent]:
    """The events up to the end of the stream (the platform was closed)."""
    with anyio.fail_after(TIMEOUT_S):
        return [event async for event in events if _of_nodes(event)]


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
