"""Start an agent so that it dies with the master, and signal its process group.

Each agent leads its own session, so one ``killpg`` reaches the agent and every
process it started. It also gets ``PR_SET_PDEATHSIG = SIGKILL``, so a master
killed with SIGKILL takes its agents along. The death signal is set by a tiny
exec shim (``python -I -S -c SHIM``), not a ``preexec_fn``: a ``preexec_fn`` runs
Python code between fork and exec, which can deadlock when another thread held a
lock at fork time, and the master runs threads. Linux sends the death signal
when the *thread* that forked the agent exits; stead forks from the event-loop
thread, which lives as long as the master.
"""

from __future__ import annotations

import os
import signal
import sys

import structlog

__all__ = ["PDEATHSIG_SUPPORTED", "agent_argv", "signal_group", "signal_leader"]

log = structlog.get_logger()

PDEATHSIG_SUPPORTED = sys.platform.startswith("linux")

# argv: -c MASTER_PID COMMAND [ARGS...]. PR_SET_PDEATHSIG is 1. The getppid check closes the race
# where the master died between fork and prctl: the death signal would then never come.
_SHIM = """\
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit("stead: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write("stead: cannot run %r: %s\\n" % (sys.argv[2], exc))
    os._exit(127)
"""


def agent_argv(command: tuple[str, ...]) -> tuple[str, ...]:
    """The argv that runs ``command`` with the parent-death signal set (unchanged where unsupported)."""
    if not PDEATHSIG_SUPPORTED:
        return command
    return (sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), *command)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to a process group; a group that is already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("signal_group_refused", pgid=pgid, signal=sig.name)


def signal_leader(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to one process; a process that is already gone is fine."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("signal_process_refused", pid=pid, signal=sig.name)
