"""Processes on this machine: signalling groups, tying a child to its parent's life, finding children.

Linux gives three tools that stead uses and that nothing else in the standard
library wraps:

- ``PR_SET_PDEATHSIG``: a child gets a signal when its parent dies. It is set by a
  tiny exec shim (``python -I -S -c SHIM``) rather than a ``preexec_fn``, which runs
  Python between fork and exec and can deadlock in a parent with threads.
- ``PR_SET_CHILD_SUBREAPER``: processes orphaned below a subreaper are re-parented
  to it instead of to init, so ``stead run`` keeps the agents a crashed master
  left behind as its own children (to reap them, and to stop them at the end).
- ``pidfd_open``: a file descriptor that becomes readable when a process exits,
  for processes that are not our children (agents adopted from a dead master).

And one thing asyncio does that stead must sometimes undo: a child started through
asyncio is killed when its transport is closed (or collected). :func:`let_go`
keeps a child that must outlive this process (an agent, the rendezvous host, left
to the next master) from being killed that way.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import structlog

__all__ = ["DEATH_SIGNAL_SUPPORTED", "become_subreaper", "children", "cmdline", "descendants", "is_alive",
           "let_go", "signal_group", "signal_leader", "tied_argv", "wait_exit", "zombie_failure"]

log = structlog.get_logger("stead.procs")

DEATH_SIGNAL_SUPPORTED = sys.platform.startswith("linux")

_PR_SET_CHILD_SUBREAPER = 36

# argv: -c PARENT_PID SIGNAL COMMAND [ARGS...]. PR_SET_PDEATHSIG is 1. The getppid check closes the race where
# the parent died between fork and prctl: the death signal would then never come.
_SHIM = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, int(sys.argv[2]), 0, 0, 0) != 0:
    sys.exit("stead: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as exc:
    sys.stderr.write("stead: cannot run %r: %s\\n" % (sys.argv[3], exc))
    os._exit(127)
"""


def tied_argv(command: tuple[str, ...] | list[str], sig: signal.Signals) -> list[str]:
    """The argv that runs ``command`` so that it gets ``sig`` when this process dies (unchanged off Linux).

    Linux sends the death signal when the *thread* that forked the child exits: fork from a thread that lives
    as long as the process (the main thread, or the event loop's).
    """
    if not DEATH_SIGNAL_SUPPORTED:
        return list(command)
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), str(int(sig)), *command]


def become_subreaper() -> bool:
    """Have orphaned descendants re-parented to this process instead of init; False where unsupported."""
    if not DEATH_SIGNAL_SUPPORTED:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("subreaper_refused", error=os.strerror(ctypes.get_errno()))
        return False
    return True


def let_go(process: object) -> None:
    """Let a child started through asyncio (``asyncio.subprocess.Process`` or anyio's wrapper of one) outlive its
    transport: asyncio kills a running child when the transport is closed or garbage-collected, which would take
    down what a failing master means to leave running. Its pipes are closed as ``close()`` would close them.

    Relies on asyncio's ``BaseSubprocessTransport`` (``_pipes``, ``_closed``): a closed transport kills nothing.
    """
    transport = getattr(getattr(process, "_process", process), "_transport", None)
    if transport is None or getattr(transport, "_closed", True):
        return
    for protocol in getattr(transport, "_pipes", {}).values():
        if protocol is not None:
            protocol.pipe.close()
    transport._closed = True


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to a process group; a group that is already gone is fine."""
    _send(os.killpg, pgid, sig, "signal_group_refused")


def signal_leader(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to one process; a process that is already gone is fine."""
    _send(os.kill, pid, sig, "signal_process_refused")


def _send(kill: Callable[[int, int], None], target: int, sig: signal.Signals, refused: str) -> None:
    if target <= 1 or target == os.getpid():  # 0 would be our own group, 1 init: never what was meant
        log.warning(refused, target=target, signal=sig.name, reason="not a process stead started")
        return
    try:
        kill(target, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning(refused, target=target, signal=sig.name)


def _parents() -> dict[int, list[int]]:
    """Live (non-zombie) processes by parent pid, read from /proc."""
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] not in ("Z", "X"):
            found.setdefault(int(fields[1]), []).append(int(entry.name))
    return found


def children(pid: int | None = None) -> set[int]:
    """The live direct children of ``pid`` (default: this process)."""
    return set(_parents().get(os.getpid() if pid is None else pid, []))


def descendants(pid: int | None = None) -> set[int]:
    """Every live (non-zombie) process below ``pid`` (default: this process)."""
    parents = _parents()
    found: set[int] = set()
    stack = [os.getpid() if pid is None else pid]
    while stack:
        for child in parents.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cmdline(pid: int) -> tuple[str, ...]:
    """The argv of ``pid`` (empty when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ()
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0")[:-1])


def zombie_failure(pid: int, pidfd: int) -> tuple[int | None, int | None] | None:
    """An ended, unreaped process's ``(exit_code, signal)`` if it failed, or None (running, reaped, or exited 0).

    A forked worker's parent is its zygote, which may be busy (importing) for seconds before it
    reaps and reports it; the kernel shows an unreaped child's wait status in ``/proc/PID/stat``
    to anyone. Only a failure is taken from there (a status that reads 0 may be hidden by ptrace
    rules); ``pidfd`` (the process's), still signalling, proves the pid was not reaped and reused
    while it was read.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        signal.pidfd_send_signal(pidfd, 0)
    except (OSError, IndexError):
        return None
    if len(fields) < 50 or fields[0] != b"Z" or not (status := int(fields[49])):
        return None
    return (None, status & 0x7F) if status & 0x7F else ((status >> 8) & 0xFF, None)


async def wait_exit(pid: int) -> None:
    """Until ``pid``, which need not be our child, has exited (a pidfd; a look every 0.1 s before Linux 5.3)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:
        while is_alive(pid):  # noqa: ASYNC110 (not our child: nothing to wait on)
            await anyio.sleep(0.1)
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)
