"""The fake container runtime: one local process per container, and the status a kubelet reports for it.

A container is a process in its own session (so the whole tree is signalled as a group)
started with exactly the environment the kubelet computed, stdout and stderr appended to
its log file, and tied to this process (PR_SET_PDEATHSIG) so that a crashed test leaves
no pod running. Its state is kept in a :class:`ContainerRun` as the Kubernetes
``containerStatuses[]`` entry reads it: waiting, running or terminated (exit code
``128 + N`` for a process killed by signal N, as container runtimes report).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stead.core.procs import signal_group, tied_argv
from tests.support.kube._podenv import image_id

__all__ = ["ContainerRun", "LaunchPlan", "StartError", "exit_code", "kill", "log_tail", "phase", "start_process",
           "terminated_reason", "tree_rss"]

#: how much of a failed container's log becomes its termination message (FallbackToLogsOnError), as a kubelet
_MESSAGE_LINES = 80
_MESSAGE_BYTES = 2048


class StartError(Exception):
    """The runtime could not start the process (the container terminates with exit code 128, StartError)."""


@dataclass(frozen=True)
class LaunchPlan:
    """What a container's process is started with, paths already translated."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    log_path: Path
    memory_limit: int | None  # bytes, from limits.memory
    message_from_logs: bool  # terminationMessagePolicy FallbackToLogsOnError


@dataclass
class ContainerRun:
    name: str
    image: str
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    restart_count: int = 0
    container_id: str = ""
    process: asyncio.subprocess.Process | None = None
    started_at: str | None = None
    #: set before the kill that makes this exit an OOMKilled one
    oom: bool = False
    #: bytes, from ``limits.memory`` (None: no limit), for the memory monitor
    memory_limit: int | None = None
    #: set each time the process ends and its state is recorded
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return "running" in self.state

    @property
    def terminated(self) -> bool:
        return "terminated" in self.state

    def wait(self, reason: str, message: str | None = None) -> None:
        self.state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}

    def run(self, process: asyncio.subprocess.Process | None, now: str) -> None:
        self.process, self.started_at = process, now
        self.container_id = f"containerd://{uuid.uuid4().hex}{uuid.uuid4().hex}"
        self.state = {"running": {"startedAt": now}}
        self.oom = False
        self.exited = asyncio.Event()

    def end(self, code: int, now: str, message: str | None = None, reason: str | None = None) -> None:
        reason = reason or terminated_reason(code, self.oom)
        terminated: dict[str, Any] = {"exitCode": code, "reason": reason, "startedAt": self.started_at,
                                      "finishedAt": now, "containerID": self.container_id}
        if message:
            terminated["message"] = message
        self.state = {"terminated": terminated}
        self.process = None
        self.exited.set()

    def status(self) -> dict[str, Any]:
        started = self.running
        status = {"name": self.name, "image": self.image, "imageID": image_id(self.image) if self.container_id else "",
                  "ready": started, "started": started, "restartCount": self.restart_count, "state": self.state,
                  "lastState": self.last_state}
        if self.container_id:
            status["containerID"] = self.container_id
        return status


def terminated_reason(code: int, oom: bool) -> str:
    if oom:
        return "OOMKilled"
    return "Completed" if code == 0 else "Error"


def exit_code(returncode: int) -> int:
    """A container runtime's exit code: ``128 + N`` for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


async def start_process(plan: LaunchPlan) -> asyncio.subprocess.Process:
    """Start the plan's process in a session of its own; raises StartError when it cannot run at all."""
    executable = plan.argv[0]
    if os.sep not in executable and shutil.which(executable, path=plan.env.get("PATH", "")) is None:
        raise StartError(f'failed to create containerd task: failed to create shim task: OCI runtime create failed: '
                         f'exec: "{executable}": executable file not found in $PATH')
    plan.cwd.mkdir(parents=True, exist_ok=True)
    plan.log_path.parent.mkdir(parents=True, exist_ok=True)
    with plan.log_path.open("ab") as log_file:
        # shielded: a kubelet stopping while a process is being started must still get hold of it, to kill it
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *tied_argv(list(plan.argv), signal.SIGKILL), env=dict(plan.env), cwd=plan.cwd,
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True))
        try:
            return await asyncio.shield(spawn)
        except OSError as exc:
            raise StartError(f"failed to create containerd task: {exc}") from None
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                process = await spawn
                kill(process, signal.SIGKILL)
                await process.wait()
            raise


def kill(process: asyncio.subprocess.Process | None, sig: signal.Signals) -> None:
    """Signal a container's process group (its session); SIGKILL reaches every process the container started, in
    whatever session (a container runtime kills its whole cgroup); a process already gone is fine."""
    if process is None or process.returncode is not None:
        return
    if sig == signal.SIGKILL:
        # all at once, as a runtime's cgroup kill is: each group frozen first, so no process of the container sees
        # another's death and acts on it (an agent reporting its worker's SIGKILL) before its own kill lands
        signal_group(process.pid, signal.SIGSTOP)
        groups = sorted(_descendant_groups(process.pid) - {process.pid})
        for pgid in groups:
            signal_group(pgid, signal.SIGSTOP)
        for pgid in groups:
            signal_group(pgid, sig)
    signal_group(process.pid, sig)


def _descendant_groups(pid: int) -> set[int]:
    import psutil

    groups: set[int] = set()
    try:
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error, OSError):
                groups.add(os.getpgid(child.pid))
    except psutil.Error:
        pass
    return groups


def log_tail(path: Path) -> str:
    """The end of a log, as FallbackToLogsOnError puts it in the termination message."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _MESSAGE_BYTES))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-_MESSAGE_LINES:])


def tree_rss(pid: int) -> int:
    """Resident memory of a process and all its descendants, in bytes (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue
    return total


def phase(containers: Sequence[ContainerRun]) -> str:
    """The pod phase the containers add up to (terminal once every container has ended for good)."""
    if all(c.terminated for c in containers):
        return "Succeeded" if all(c.state["terminated"]["exitCode"] == 0 for c in containers) else "Failed"
    if any(c.running or c.restart_count for c in containers) or any(c.terminated for c in containers):
        return "Running"
    return "Pending"
