"""Python stacks of running workers, for the hang detector's evidence.

A worker started through the agent's bootstrap has faulthandler registered on
:data:`~stead.core.worker.progress.STACKS_SIGNAL`, writing to its own file next to
its progress file. faulthandler writes from the signal handler in C, without the
GIL, so a worker blocked in a collective, a sleep or a C extension still answers
(a stopped one, SIGSTOP, does not: it is reported with an empty stack). A worker
without the handler (started with ``--no-python``, or exec'd) is never signalled:
the signal's default action would kill it.

py-spy is not used: it needs ptrace rights a container rarely has, and on this
project's CI machine it cannot read the interpreter at all; faulthandler needs
nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

import anyio

from stead.core.worker.progress import STACKS_SIGNAL, stacks_path

__all__ = ["MAX_STACK_CHARS", "dump_stacks"]

#: a dump is cut to this many characters (the innermost frames come first, so the cut loses the least useful)
MAX_STACK_CHARS = 32 * 1024
_POLL_S = 0.02
#: a dump that has not grown for this long is complete
_QUIET_S = 0.1


async def dump_stacks(pids: Mapping[int, int], progress_paths: Mapping[int, str | Path], *,
                      timeout_s: float) -> tuple[dict[int, str], str]:
    """local rank -> the worker's stacks ("" when it did not answer), and a note on what went wrong."""
    offsets: dict[int, tuple[Path, int]] = {}
    problems: list[str] = []
    for rank, pid in pids.items():
        path = stacks_path(progress_paths[rank], pid)
        try:
            offsets[rank] = (path, path.stat().st_size)
        except FileNotFoundError:
            problems.append(f"local rank {rank} has no stack-dump handler (not started by stead's bootstrap)")
            continue
        try:
            os.kill(pid, STACKS_SIGNAL)
        except ProcessLookupError:
            problems.append(f"local rank {rank} (pid {pid}) has exited")
            del offsets[rank]
    stacks = {rank: "" for rank in pids}
    sizes = {rank: -1 for rank in offsets}
    quiet_since = {rank: 0.0 for rank in offsets}
    deadline = time.monotonic() + timeout_s
    while offsets and time.monotonic() < deadline:
        await anyio.sleep(_POLL_S)
        now = time.monotonic()
        for rank, (path, start) in list(offsets.items()):
            size = path.stat().st_size if path.exists() else start
            if size != sizes[rank]:
                sizes[rank], quiet_since[rank] = size, now
            elif size > start and now - quiet_since[rank] >= _QUIET_S:
                stacks[rank] = _read(path, start)
                del offsets[rank]
    for rank, (path, start) in offsets.items():  # silent until the deadline: stopped, or its handler is gone
        stacks[rank] = _read(path, start)
        if not stacks[rank]:
            problems.append(f"local rank {rank} wrote no stack within {timeout_s:g} s (stopped?)")
    return stacks, "; ".join(problems)


def _read(path: Path, start: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(MAX_STACK_CHARS).decode(errors="replace")
    except OSError:
        return ""
