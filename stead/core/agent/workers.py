"""The agent's worker processes: start one per local rank, learn of each exit at once, stop them all.

Workers are forked by the warm :class:`~stead.core.agent.zygote.Zygote` when it is ready
(milliseconds) and spawned as fresh interpreters otherwise (seconds: ``import torch``).
Either way each worker

- leads its own process group, so a stop also reaches its children (dataloader workers),
  and whatever is left of the group is killed when the worker exits;
- dies with the agent, even a SIGKILLed one: a parent-death signal is set in the child
  (by the zygote for forks, by a tiny exec shim for spawns) and checked against the race;
- has its stderr read through a pipe: forwarded to the redirect file and/or the agent's
  stderr, and its last lines kept for the :class:`WorkerExit` report.

Exits are event driven, never polled: a pidfd per worker reaps a spawned one and marks the
moment a forked one ends (even while its zygote is busy importing), whose exit status the
zygote's reap report gives.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TextIO

import anyio
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from stead.core.agent.zygote import Zygote, ZygoteUnavailable
from stead.core.config import Settings
from stead.core.errors import InvalidRequest, PlatformError
from stead.core.procs import zombie_failure
from stead.core.rpc.backend import MAX_ERROR_TAIL_CHARS

__all__ = ["WorkerExit", "WorkerGroup", "WorkerSpec"]

log = structlog.get_logger()

#: sets the parent-death signal, checks the parent is still the agent, then execs the worker
_SHIM = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0) != 0 or os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    os.write(2, f'stead: cannot execute {sys.argv[2]!r}: {exc}\\n'.encode(errors='replace'))\n"
    "    os._exit(127)\n"
)
_READ_BYTES = 1 << 16
#: a stderr "line" longer than this is cut, so that output without newlines cannot grow the tail unbounded
_MAX_LINE_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker process: the full command, its environment and where its output goes."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | Path
    local_rank: int
    stdout_path: Path | None = None
    stderr_path: Path | None = None
    #: also copy the output to the agent's stdout/stderr, each line prefixed ``[rankN]:``
    tee: bool = False

    @property
    def prefix(self) -> bytes:
        return f"[rank{self.env.get('RANK', self.local_rank)}]:".encode()


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """A worker process ended: with ``exit_code``, or killed by ``signal``."""

    local_rank: int
    pid: int
    exit_code: int | None
    signal: int | None
    #: the last lines the worker wrote to stderr
    error_tail: str
    #: wall-clock time the agent saw the process end
    at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class _Output:
    """One worker output pipe: forwards what arrives, keeps the last lines for the exit report."""

    def __init__(self, fd: int, *, file: BinaryIO | None, console: int | None, prefix: bytes | None,
                 tail_lines: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._file = file
        self._console = console
        self._prefix = prefix
        self._tail: collections.deque[bytes] = collections.deque(maxlen=max(tail_lines, 1))
        self._tail_partial = b""
        self._console_partial = b""
        self._keep_tail = tail_lines > 0
        self._tail_lines = max(tail_lines, 1)

    async def pump(self) -> None:
        """Forward everything until the last writer closes the pipe."""
        try:
            while self.fd >= 0:
                await anyio.wait_readable(self.fd)
                if not self.drain():
                    break
        finally:
            self.close()

    def drain(self) -> bool:
        """Read what is buffered in the pipe without blocking; False at end of file."""
        while self.fd >= 0:
            try:
                data = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                return True
            if not data:
                self._flush_partials()
                return False
            self._feed(data)
        return False

    def tail(self) -> str:
        lines = list(self._tail)
        if self._tail_partial:
            lines.append(self._tail_partial)
        text = b"\n".join(lines[-self._tail_lines:]).decode(errors="replace")
        return text[-MAX_ERROR_TAIL_CHARS:]  # a line without end may be long: its end is what explains

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._file is not None:
            self._file.close()
            self._file = None

    def _feed(self, data: bytes) -> None:
        if self._file is not None:
            self._file.write(data)
            self._file.flush()
        if self._console is not None:
            if self._prefix is None:
                _write_all(self._console, data)
            else:
                *lines, self._console_partial = (self._console_partial + data).split(b"\n")
                if lines:
                    _write_all(self._console, b"".join(self._prefix + line + b"\n" for line in lines))
                self._console_partial = self._console_partial[-_MAX_LINE_BYTES:]
        if self._keep_tail:
            *lines, self._tail_partial = (self._tail_partial + data).split(b"\n")
            self._tail.extend(line[-_MAX_LINE_BYTES:] for line in lines)
            self._tail_partial = self._tail_partial[-_MAX_LINE_BYTES:]

    def _flush_partials(self) -> None:
        if self._console is not None and self._prefix is not None and self._console_partial:
            _write_all(self._console, self._prefix + self._console_partial + b"\n")
            self._console_partial = b""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
        except OSError:  # the agent's own console is gone: the file and the tail still get the output
            return


def _pidfd_or_none(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1


class _Worker:
    """The agent's handle on one running worker (mutable, owned by the group)."""

    def __init__(self, spec: WorkerSpec, pid: int, via: str, stderr: _Output, stdout: _Output | None,
                 popen: subprocess.Popen[bytes] | None) -> None:
        self.spec = spec
        self.pid = pid
        self.via = via
        self.stderr = stderr
        self.stdout = stdout
        self.popen = popen
        #: a spawned worker's, to reap it; a forked one's (the zygote reaps it), to see the moment it ends
        #: even while the zygote is busy importing: -1 when it is gone already
        self.pidfd = os.pidfd_open(pid) if popen is not None else _pidfd_or_none(pid)
        self.exited = anyio.Event()
        self.result: WorkerExit | None = None

    def signal(self, signum: int) -> None:
        """Signal the worker's whole process group (falls back to the pid before its setsid)."""
        try:
            os.killpg(self.pid, signum)
            return
        except ProcessLookupError:
            pass
        except PermissionError:
            pass
        try:
            if self.pidfd >= 0:
                signal.pidfd_send_signal(self.pidfd, signum)
            else:
                os.kill(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


class WorkerGroup:
    """``async with WorkerGroup(settings, zygote=z) as group``: the agent's workers, one per local rank.

    ``await group.start(specs)`` starts a round of workers; ``group.exits()`` yields a
    :class:`WorkerExit` the moment each one ends and finishes when all of them have;
    ``await group.stop()`` ends them (SIGTERM, then SIGKILL after the grace period).
    Leaving the context stops every worker. A group can run many rounds, one at a time.
    """

    def __init__(self, settings: Settings | None = None, *, zygote: Zygote | None = None) -> None:
        self._settings = settings or Settings()
        self._zygote = zygote
        self._tg: TaskGroup | None = None
        self._workers: dict[int, _Worker] = {}
        self._results: dict[int, WorkerExit] = {}
        self._exits_in: MemoryObjectSendStream[WorkerExit] | None = None
        self._exits_out: MemoryObjectReceiveStream[WorkerExit] | None = None
        self._lock = anyio.Lock()  # start and stop never interleave

    async def __aenter__(self) -> WorkerGroup:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        try:
            with anyio.CancelScope(shield=True):
                await self.stop()
        finally:
            self._tg.cancel_scope.cancel()
            if self._exits_out is not None:
                self._exits_out.close()
        return await self._tg.__aexit__(exc_type, exc, tb)

    # -- state ---------------------------------------------------------------------------

    @property
    def alive(self) -> int:
        """How many workers of the current round have not exited yet."""
        return sum(1 for w in self._workers.values() if w.result is None)

    @property
    def pids(self) -> dict[int, int]:
        """local rank -> pid of the current round's workers (exited ones included)."""
        return {rank: w.pid for rank, w in self._workers.items()}

    @property
    def results(self) -> dict[int, WorkerExit]:
        """local rank -> exit of the current round's workers that have ended."""
        return dict(self._results)

    # -- operations ----------------------------------------------------------------------

    async def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Start one worker per spec (a new round); forks from the zygote when it is ready."""
        async with self._lock:
            await self._start(specs)

    async def stop(self, grace_s: float | None = None) -> list[WorkerExit]:
        """SIGTERM every running worker's process group, SIGKILL after ``grace_s``; wait for all."""
        async with self._lock:
            return await self._stop(grace_s)

    async def _start(self, specs: Sequence[WorkerSpec]) -> None:
        if self._tg is None:
            raise InvalidRequest("WorkerGroup.start() called outside `async with WorkerGroup(...)`; "
                                 "enter the group first")
        if self.alive:
            raise InvalidRequest(f"{self.alive} workers of the previous round are still running; "
                                 "await group.stop() before starting new ones")
        _validate(specs)
        if self._exits_out is not None:
            self._exits_out.close()
        self._exits_in, self._exits_out = anyio.create_memory_object_stream[WorkerExit](math.inf)
        self._workers, self._results = {}, {}
        zygote = self._zygote
        if zygote is not None and zygote.starting:  # the first round: forking soon beats importing torch twice
            log.info("zygote_wait", grace_s=self._settings.zygote_wait_s)
            with anyio.move_on_after(self._settings.zygote_wait_s):
                await zygote.wait_ready()
        use_zygote = zygote is not None and zygote.ready
        try:
            for spec in specs:
                worker = None
                if use_zygote:
                    try:
                        worker = await self._fork(spec)
                    except ZygoteUnavailable as exc:
                        log.warning("zygote_fork_failed", local_rank=spec.local_rank, error=str(exc))
                        use_zygote = False
                if worker is None:
                    worker = self._spawn(spec)
                self._workers[spec.local_rank] = worker
                self._tg.start_soon(self._pump, worker.stderr)
                if worker.stdout is not None:
                    self._tg.start_soon(self._pump, worker.stdout)
                self._tg.start_soon(self._watch, worker, self._exits_in.clone())
                log.info("worker_started", local_rank=spec.local_rank, pid=worker.pid, via=worker.via)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop(0)
            raise
        finally:
            self._exits_in.close()

    def exits(self) -> AsyncIterator[WorkerExit]:
        """Each exit of the current round as it happens; ends when every worker has exited.

        The round is the one started last when this is called; the iterator also ends when
        a later round starts. Exits caused by :meth:`stop` are delivered too. One consumer
        per round.
        """
        stream = self._exits_out
        if stream is None:
            raise InvalidRequest("WorkerGroup.exits() called before start(); start workers first")
        return _drain_exits(stream)

    async def _stop(self, grace_s: float | None) -> list[WorkerExit]:
        grace = self._settings.worker_stop_grace_s if grace_s is None else grace_s
        running = [w for w in self._workers.values() if w.result is None]
        if running:
            log.info("workers_stopping", count=len(running), grace_s=grace)
            for worker in running:
                worker.signal(signal.SIGTERM)
            with anyio.move_on_after(grace):
                for worker in running:
                    await worker.exited.wait()
            for worker in running:
                if worker.result is None:
                    log.warning("worker_kill", local_rank=worker.spec.local_rank, pid=worker.pid, grace_s=grace)
                    worker.signal(signal.SIGKILL)
            for worker in running:
                await worker.exited.wait()
        return [w.result for w in self._workers.values() if w.result is not None]

    # -- internals -----------------------------------------------------------------------

    def _outputs(self, spec: WorkerSpec) -> tuple[int | None, int, _Output | None, _Output]:
        """(stdout fd for the child or None to inherit, stderr fd for the child, readers)."""
        opened: list[int] = []
        try:
            stdout_target: int | None = None
            stdout_reader = None
            if spec.tee:
                read_fd, stdout_target = os.pipe()
                opened += [read_fd, stdout_target]
                stdout_reader = _Output(read_fd, file=_open_log(spec.stdout_path), console=_fileno(sys.__stdout__, 1),
                                        prefix=spec.prefix, tail_lines=0)
            elif spec.stdout_path is not None:
                stdout_target = os.open(spec.stdout_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                                        0o644)
                opened.append(stdout_target)
            read_fd, stderr_target = os.pipe()
            opened += [read_fd, stderr_target]
            console = _fileno(sys.__stderr__, 2) if spec.tee or spec.stderr_path is None else None
            stderr_reader = _Output(read_fd, file=_open_log(spec.stderr_path), console=console,
                                    prefix=spec.prefix if spec.tee else None,
                                    tail_lines=self._settings.error_tail_lines)
        except OSError as exc:
            for fd in opened:
                os.close(fd)
            raise InvalidRequest(f"worker {spec.local_rank}: cannot open its output ({exc}); "
                                 "check that the log directory exists and is writable") from exc
        return stdout_target, stderr_target, stdout_reader, stderr_reader

    async def _fork(self, spec: WorkerSpec) -> _Worker:
        assert self._zygote is not None
        stdout_target, stderr_target, stdout_reader, stderr_reader = self._outputs(spec)
        try:
            forked = await self._zygote.fork(spec.argv, spec.env, str(spec.cwd),
                                             1 if stdout_target is None else stdout_target, stderr_target)
        except BaseException:
            stderr_reader.close()
            if stdout_reader is not None:
                stdout_reader.close()
            raise
        finally:
            os.close(stderr_target)
            if stdout_target is not None:
                os.close(stdout_target)
        if forked.mode == "exec":
            log.info("zygote_exec", local_rank=spec.local_rank, reason=forked.reason)
        return _Worker(spec, forked.pid, f"zygote-{forked.mode}", stderr_reader, stdout_reader, None)

    def _spawn(self, spec: WorkerSpec) -> _Worker:
        stdout_target, stderr_target, stdout_reader, stderr_reader = self._outputs(spec)
        command = [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), *spec.argv]
        try:
            popen = subprocess.Popen(command, env=dict(spec.env), cwd=spec.cwd, stdin=subprocess.DEVNULL,
                                     stdout=stdout_target, stderr=stderr_target, start_new_session=True)
        except OSError as exc:
            stderr_reader.close()
            if stdout_reader is not None:
                stdout_reader.close()
            raise PlatformError(f"could not start worker {spec.local_rank} ({' '.join(spec.argv)}): {exc}; "
                                "check the command, the working directory and the process limits") from exc
        finally:
            os.close(stderr_target)
            if stdout_target is not None:
                os.close(stdout_target)
        return _Worker(spec, popen.pid, "spawn", stderr_reader, stdout_reader, popen)

    async def _pump(self, output: _Output) -> None:
        await output.pump()

    async def _watch(self, worker: _Worker, exits: MemoryObjectSendStream[WorkerExit]) -> None:
        async with exits:
            if worker.popen is not None:
                await anyio.wait_readable(worker.pidfd)
                worker.signal(signal.SIGKILL)  # leftovers of its group; the pid is not reaped yet, so not reused
                code = worker.popen.wait()
                os.close(worker.pidfd)
                worker.pidfd = -1
                exit_code, signum = (code, None) if code >= 0 else (None, -code)
                ended = time.time()
            else:
                assert self._zygote is not None
                ended, status = math.inf, None
                try:
                    if worker.pidfd >= 0:  # the end itself, not the zygote's (maybe later) report of it
                        await anyio.wait_readable(worker.pidfd)
                        ended = time.time()
                        status = zombie_failure(worker.pid, worker.pidfd)
                    exit_code, signum = status or await self._zygote.wait_exit(worker.pid)
                finally:
                    if worker.pidfd >= 0:
                        os.close(worker.pidfd)
                        worker.pidfd = -1
                ended = min(ended, time.time())
                if not self._zygote.ready:  # the zygote kills a group when it reaps its leader, unless it died
                    worker.signal(signal.SIGKILL)
            worker.stderr.drain()  # everything the worker wrote is in the pipe by now
            result = WorkerExit(local_rank=worker.spec.local_rank, pid=worker.pid, exit_code=exit_code,
                                signal=signum, error_tail=worker.stderr.tail(), at=ended)
            worker.result = result
            self._results[result.local_rank] = result
            worker.exited.set()
            log.info("worker_exited", local_rank=result.local_rank, pid=result.pid, exit_code=exit_code,
                     signal=signum)
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                exits.send_nowait(result)  # unbounded: never blocks; a consumer that left does not matter


async def _drain_exits(stream: MemoryObjectReceiveStream[WorkerExit]) -> AsyncIterator[WorkerExit]:
    try:
        async for worker_exit in stream:
            yield worker_exit
    except anyio.ClosedResourceError:  # a new round started
        return


def _open_log(path: Path | None) -> BinaryIO | None:
    return open(path, "ab") if path is not None else None


def _fileno(stream: TextIO | None, default: int) -> int:
    """The fd of the agent's own stdout/stderr (the original ones, not a test's capture)."""
    try:
        return stream.fileno() if stream is not None else default
    except (OSError, ValueError):
        return default


def _validate(specs: Sequence[WorkerSpec]) -> None:
    ranks = [spec.local_rank for spec in specs]
    if len(set(ranks)) != len(ranks):
        raise InvalidRequest(f"worker specs repeat a local rank: {sorted(ranks)}; give each spec its own rank")
    for spec in specs:
        if not spec.argv:
            raise InvalidRequest(f"worker {spec.local_rank} has an empty command; pass the program to run")
        if not os.path.isdir(spec.cwd):
            raise InvalidRequest(f"worker {spec.local_rank}: working directory {str(spec.cwd)!r} does not exist; "
                                 "create it or choose another cwd")
        program = spec.argv[0]
        if os.sep in program:
            found = os.path.join(spec.cwd, program)
            if not (os.path.isfile(found) and os.access(found, os.X_OK)):
                raise InvalidRequest(f"worker {spec.local_rank}: {program!r} is not an executable file; "
                                     "check the path (relative paths start at the worker's cwd)")
        elif shutil.which(program, path=spec.env.get("PATH", os.defpath)) is None:
            raise InvalidRequest(f"worker {spec.local_rank}: {program!r} was not found on the worker's PATH; "
                                 "install it or give its full path")
