"""Helpers for the agent tests: scripts written to a temp dir, specs, and liveness by pid."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
from _polling import until, wait_until

from stead.core.agent.workers import WorkerSpec


def write(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def spec(
    argv: Iterable[str],
    cwd: Path,
    *,
    rank: int = 0,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> WorkerSpec:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return WorkerSpec(argv=tuple(argv), env=full_env, cwd=cwd, local_rank=rank, **kwargs)


def py(script: Path | str, *args: str) -> list[str]:
    return [sys.executable, "-u", str(script), *args]


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def wait_for_file(path: Path) -> str:
    """The content of ``path`` once a child has written it (ending with a newline)."""
    await until(lambda: path.exists() and path.read_text().endswith("\n"), f"a child wrote {path}")
    return await anyio.Path(path).read_text()


async def read_json(path: Path) -> Any:
    return json.loads(await wait_for_file(path))


def wait_dead(pids: Iterable[int], what: str) -> None:
    """Until none of ``pids`` runs; the test fails saying ``what`` (the processes that should have gone) if one
    still runs after the polls' patience."""
    pending = set(pids)
    wait_until(lambda: not any(alive(pid) for pid in pending), f"{what} ended (pids {sorted(pending)})")
