"""Find what a test or job left behind: child processes, listening sockets, shared memory.

Linux only (reads /proc). Used by the test suite's autouse fixture and by the
demo to prove that nothing outlives a job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from stead.core.procs import descendants, signal_leader

__all__ = ["LONG_LIVED", "SHM_NAMESPACE_ENV", "Leaks", "descendants", "listening_ports", "remove", "shm_segments",
           "snapshot",
           "wait_clean"]

#: processes that session-wide fixtures own on purpose (a shared etcd server); never reported
LONG_LIVED: set[int] = set()


def listening_ports() -> set[int]:
    """TCP ports this process is listening on."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # 0A = LISTEN
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


#: the ``ckpt.shm_namespace`` of this process's jobs: set it (``STEAD_CKPT_SHM_NAMESPACE``) to look only at those
SHM_NAMESPACE_ENV = "STEAD_CKPT_SHM_NAMESPACE"


def shm_segments() -> set[str]:
    """stead's shared-memory segments (only this process's namespace when ``STEAD_CKPT_SHM_NAMESPACE`` is set)."""
    namespace = os.environ.get(SHM_NAMESPACE_ENV, "")
    try:
        names = {p.name for p in Path("/dev/shm").iterdir() if "stead" in p.name.lower()}
    except OSError:
        return set()
    return {n for n in names if n.startswith(f"stead-ckpt-{namespace}.")} if namespace else names


class Leaks:
    def __init__(self, processes: set[int], ports: set[int], shm: set[str]) -> None:
        self.processes, self.ports, self.shm = processes, ports, shm

    def __bool__(self) -> bool:
        return bool(self.processes or self.ports or self.shm)

    def __str__(self) -> str:
        parts = []
        if self.processes:
            cmds = []
            for pid in sorted(self.processes):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    cmds.append(f"{pid}: {cmdline[:120]}")
                except OSError:
                    cmds.append(str(pid))
            parts.append("processes " + "; ".join(cmds))
        if self.ports:
            parts.append(f"listening ports {sorted(self.ports)}")
        if self.shm:
            parts.append(f"shared memory {sorted(self.shm)}")
        return ", ".join(parts)


def remove(leaks: Leaks) -> None:
    """Kill the processes and unlink the segments ``leaks`` names: a failed test must not leave them to the machine
    (or to the next suite). Ports close with their processes."""
    for pid in leaks.processes:
        signal_leader(pid, signal.SIGKILL)
    for name in leaks.shm:
        with contextlib.suppress(OSError):
            (Path("/dev/shm") / name).unlink()


def snapshot() -> tuple[set[int], set[int], set[str]]:
    return descendants(), listening_ports(), shm_segments()


def wait_clean(before: tuple[set[int], set[int], set[str]], *, timeout_s: float = 10.0) -> Leaks:
    """What is still there after ``timeout_s`` that was not there ``before``."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs, ports, shm = snapshot()
        leaks = Leaks(procs - before[0] - LONG_LIVED, ports - before[1], shm - before[2])
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.05)
