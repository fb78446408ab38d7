"""Whether a SIGKILLed worker was killed for memory: the kernel's own record, never a guess.

A worker that dies by SIGKILL (or exits 137 under a shell wrapper) may have been OOM-killed,
or killed by a person, a stop that ran out of patience, or a scheduler. Only a record says
which, so the agent asks :class:`OomRecords` for evidence and reports what it finds. The
sources, most precise first:

1. The kernel log (``/dev/kmsg``): the ``Killed process <pid> (...)`` line names the very
   process, and the ``oom-kill:...,task_memcg=...,pid=<pid>`` line before it names its
   memory cgroup. Often unreadable inside containers; then it is skipped silently. Pids in
   the log are those of the kernel's initial pid namespace, so a match needs the agent to
   live in it (which is also where ``/dev/kmsg`` tends to be readable).
2. The memory cgroup's counters, read when the worker starts (a zombie's
   ``/proc/<pid>/cgroup`` already says ``/`` on cgroup v1) and again at its end:
   ``oom_kill`` in ``memory.events`` (v2) or ``memory.oom_control`` (v1, kernels >= 4.13),
   else ``memory.failcnt`` (v1), which only says the limit was hit. A counter covers the
   whole cgroup, not one process, and the text says so when the kernel log could have
   named the process and did not.

Everything here is best effort: a source that cannot be read means less evidence, never an
exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path
from signal import SIGKILL

__all__ = ["OOM_EXIT_CODE", "OomRecords", "killed_like_oom"]

#: the exit code of a SIGKILLed process as a shell reports it (128 + SIGKILL)
OOM_EXIT_CODE = 128 + SIGKILL

#: kernel OOM records kept for pids nobody asked about yet; older ones are dropped first
KERNEL_RECORDS_KEPT = 256
#: one read() of /dev/kmsg returns one record and fails with EINVAL if it does not fit
KMSG_READ_BYTES = 16 << 10
#: reads per drain, so a log that never stops growing cannot hold the agent; the rest waits
KMSG_READS_PER_DRAIN = 1 << 16
#: an unterminated tail of a plain text log longer than this is garbage, not a line to finish
PARTIAL_LINE_LIMIT = 64 << 10

#: /dev/kmsg's record prefix: ``priority,sequence,microseconds,flags;``
_KMSG_PREFIX = re.compile(r"^\d+,\d+,\d+,[^;]*;")
#: dmesg's ``[  123.456789] `` timestamp, as in a plain text copy of the log
_DMESG_TIMESTAMP = re.compile(r"^\[\s*\d+\.\d+\]\s*")
_KILLED_PROCESS = re.compile(r"\bKilled process (\d+) \(")
_OOM_KILL_FIELDS = re.compile(r"\boom-kill:(\S+)")
_FIELD_PID = re.compile(r"(?:^|,)pid=(\d+)(?:,|$)")
_FIELD_TASK_MEMCG = re.compile(r"(?:^|,)task_memcg=([^,]*)")


def killed_like_oom(exit_code: int | None, signal: int | None) -> bool:
    """Whether an exit looks like the OOM killer's work (SIGKILL, or 137 from a shell): evidence is worth asking for."""
    return signal == SIGKILL or exit_code == OOM_EXIT_CODE


@dataclasses.dataclass(frozen=True)
class KernelOomLine:
    """One kernel log line about an OOM kill: ``killed`` is the ``Killed process`` line, else the ``oom-kill:`` one."""

    pid: int
    message: str
    killed: bool
    task_memcg: str | None = None


def parse_kernel_line(line: str) -> KernelOomLine | None:
    """The OOM kill a kernel log line records (kmsg record, dmesg line or bare message), or None."""
    message = _DMESG_TIMESTAMP.sub("", _KMSG_PREFIX.sub("", line.rstrip("\r\n"), count=1), count=1)
    killed = _KILLED_PROCESS.search(message)
    if killed is not None:
        return KernelOomLine(pid=int(killed.group(1)), message=message, killed=True)
    fields = _OOM_KILL_FIELDS.search(message)
    if fields is None:
        return None
    pid = _FIELD_PID.search(fields.group(1))
    if pid is None:
        return None
    memcg = _FIELD_TASK_MEMCG.search(fields.group(1))
    return KernelOomLine(pid=int(pid.group(1)), message=message, killed=False,
                         task_memcg=memcg.group(1) if memcg is not None else None)


@dataclasses.dataclass(frozen=True)
class _KernelRecord:
    """What the kernel log said about one pid so far."""

    killed_message: str | None = None
    oom_kill_message: str | None = None
    task_memcg: str | None = None


@dataclasses.dataclass(frozen=True)
class _CgroupBaseline:
    """A worker's memory cgroup and the counter read when it started."""

    cgroup: str  # as /proc/<pid>/cgroup names it
    directory: Path
    seen_at_mount_root: bool  # the cgroup's own directory is not visible here (cgroup namespace)
    counter_file: str  # memory.events, memory.oom_control or memory.failcnt
    value: int

    @property
    def counts_oom_kills(self) -> bool:
        return self.counter_file != "memory.failcnt"


class OomRecords:
    """The kernel's records of OOM kills, asked per worker pid: start with :meth:`open`, end with :meth:`close`."""

    def __init__(self, *, cgroup_root: Path = Path("/sys/fs/cgroup"), proc_root: Path = Path("/proc"),
                 kmsg: Path | None = Path("/dev/kmsg")) -> None:
        self._cgroup_root = cgroup_root
        self._proc_root = proc_root
        self._kmsg_path = kmsg
        self._kmsg_fd: int | None = None
        self._partial = b""
        self._kernel: dict[int, _KernelRecord] = {}
        self._baselines: dict[int, _CgroupBaseline] = {}

    @property
    def reads_kernel_log(self) -> bool:
        """Whether the kernel log is open, so a missing record for a pid means something."""
        return self._kmsg_fd is not None

    def open(self) -> None:
        """Open the kernel log at its end, so only kills from now on are read; silently none if unreadable."""
        if self._kmsg_path is None or self._kmsg_fd is not None:
            return
        try:
            fd = os.open(self._kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return
        try:
            os.lseek(fd, 0, os.SEEK_END)
        except OSError:
            os.close(fd)
            return
        self._kmsg_fd = fd

    def watch(self, pid: int) -> None:
        """A worker started: remember its memory cgroup and that cgroup's counter as the baseline."""
        self._drain_kernel_log()
        self._kernel.pop(pid, None)  # records for this pid so far were about an earlier process
        self._baselines.pop(pid, None)
        baseline = self._read_baseline(pid)
        if baseline is not None:
            self._baselines[pid] = baseline

    def evidence(self, pid: int) -> str:
        """One line naming the record of ``pid``'s OOM kill and its source, or "" if there is none; forgets ``pid``."""
        self._drain_kernel_log()
        kernel = self._kernel.pop(pid, None)
        baseline = self._baselines.pop(pid, None)
        counter = _counter_rise(baseline) if baseline is not None else None
        if kernel is not None:
            return _kernel_text(kernel, counter)
        if counter is None:
            return ""
        if self.reads_kernel_log and baseline is not None and baseline.counts_oom_kills:
            return f"{counter}; no kernel record names pid {pid}: another process in the cgroup may be the one killed"
        return counter

    def forget(self, pid: int) -> None:
        """A worker ended without needing evidence."""
        self._kernel.pop(pid, None)
        self._baselines.pop(pid, None)

    def close(self) -> None:
        """Close the kernel log and forget everything."""
        if self._kmsg_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._kmsg_fd)
            self._kmsg_fd = None
        self._partial = b""
        self._kernel.clear()
        self._baselines.clear()

    def _drain_kernel_log(self) -> None:
        """Read what the kernel logged since the last drain and keep the OOM kills."""
        fd = self._kmsg_fd
        if fd is None:
            return
        for _ in range(KMSG_READS_PER_DRAIN):
            try:
                chunk = os.read(fd, KMSG_READ_BYTES)
            except BlockingIOError:  # EAGAIN: nothing new
                return
            except BrokenPipeError:  # EPIPE: records were overwritten before we read them; go on from the oldest kept
                continue
            except OSError:
                return
            if not chunk:  # a regular file at its end
                return
            self._take(chunk)

    def _take(self, chunk: bytes) -> None:
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        if len(self._partial) > PARTIAL_LINE_LIMIT:
            self._partial = b""
        for raw in lines:
            if raw.startswith(b" "):  # a kmsg record's key=value continuation, not a message
                continue
            parsed = parse_kernel_line(raw.decode("utf-8", errors="replace"))
            if parsed is not None:
                self._remember(parsed)

    def _remember(self, line: KernelOomLine) -> None:
        record = self._kernel.pop(line.pid, _KernelRecord())
        if line.killed:
            record = dataclasses.replace(record, killed_message=line.message)
        else:
            record = dataclasses.replace(record, oom_kill_message=line.message, task_memcg=line.task_memcg)
        self._kernel[line.pid] = record  # re-inserted, so the oldest-touched pid is first to go
        while len(self._kernel) > KERNEL_RECORDS_KEPT:
            del self._kernel[next(iter(self._kernel))]

    def _read_baseline(self, pid: int) -> _CgroupBaseline | None:
        try:
            text = (self._proc_root / str(pid) / "cgroup").read_text()
        except (OSError, ValueError):
            return None
        try:
            located = _memory_cgroup_directory(text, self._cgroup_root)
        except (OSError, ValueError):  # a stat refused (permissions): no cgroup evidence for this worker
            return None
        if located is None:
            return None
        cgroup, directory, at_mount_root = located
        for counter_file in ("memory.events", "memory.oom_control", "memory.failcnt"):
            value = _read_counter(directory / counter_file)
            if value is not None:
                return _CgroupBaseline(cgroup=cgroup, directory=directory, seen_at_mount_root=at_mount_root,
                                       counter_file=counter_file, value=value)
        return None


def _memory_cgroup_directory(proc_cgroup: str, cgroup_root: Path) -> tuple[str, Path, bool] | None:
    """(cgroup path, its directory, whether that is the mount root as a fallback) from a /proc/<pid>/cgroup text."""
    v1_path: str | None = None
    v2_path: str | None = None
    for line in proc_cgroup.splitlines():
        hierarchy, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not sep or not sep2:
            continue
        if "memory" in controllers.split(","):
            v1_path = path
        elif hierarchy == "0" and not controllers:
            v2_path = path
    if v1_path is not None:  # hybrid systems list both; the memory controller is where a v1 line names it
        cgroup, mount = v1_path, cgroup_root / "memory"
    elif v2_path is not None:
        cgroup = v2_path
        mount = cgroup_root if (cgroup_root / "cgroup.controllers").exists() else cgroup_root / "unified"
    else:
        return None
    directory = mount / cgroup.lstrip("/")
    if directory.is_dir():
        return cgroup, directory, False
    return cgroup, mount, True  # a cgroup namespace shows its own root where /proc shows the full path


def _read_counter(path: Path) -> int | None:
    """``oom_kill N`` from memory.events / memory.oom_control, or the bare number in memory.failcnt; None if absent."""
    try:
        text = path.read_text()
    except (OSError, ValueError):
        return None
    if path.name == "memory.failcnt":
        try:
            return int(text.strip())
        except ValueError:
            return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value)
            except ValueError:
                return None
    return None  # a v1 kernel older than 4.13: fall back to memory.failcnt


def _counter_rise(baseline: _CgroupBaseline) -> str | None:
    """The counter's rise since the baseline, as text, or None when it did not rise or cannot be read."""
    now = _read_counter(baseline.directory / baseline.counter_file)
    if now is None or now <= baseline.value:
        return None
    where = f"memory cgroup {baseline.cgroup}"
    if baseline.seen_at_mount_root:
        where += " (read at the mount root, its own directory is not visible here)"
    if baseline.counts_oom_kills:
        return f"{where}: oom_kill {baseline.value} -> {now} ({baseline.counter_file})"
    return (f"{where}: memory.failcnt {baseline.value} -> {now} (the memory limit was hit; this kernel has no"
            " oom_kill counter, so this is weaker evidence than an OOM-kill record)")


def _kernel_text(record: _KernelRecord, counter: str | None) -> str:
    if record.killed_message is not None:
        text = f"kernel: {record.killed_message}"
        if record.task_memcg is not None:
            text += f" (task_memcg={record.task_memcg})"
    else:  # the Killed line was overwritten before it was read; the oom-kill line still names the pid
        text = f"kernel: {record.oom_kill_message}"
    if counter is not None:
        text += f" ({counter})"
    return text
