"""A warm process that has imported torch, so a restarted worker starts in milliseconds.

Starting ``python train.py`` costs 1-2 s of interpreter start-up and ``import torch``
before the first step; torchrun pays it on every restart. The agent instead keeps a
zygote: a child that imported torch (and any preloaded modules) but never ran a torch
op, and that forks each worker on request (see :mod:`.zygote_main` for the child side).

The chain of parent-death signals holds when the agent is SIGKILLed: the zygote dies
with the agent, and its workers die with the zygote. Start-up is not awaited:
``async with Zygote()`` returns at once and the imports finish in the background, so
a first start that comes before :attr:`Zygote.ready` simply spawns.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from stead.core.agent.zygote_main import MAX_MESSAGE_BYTES, STARTUP_ENV, decode, encode
from stead.core.config import Settings
from stead.core.errors import RetryableError

#: re-exported: the variables an agent gives its zygote so that its workers can be forked, not exec'd
__all__ = ["STARTUP_ENV", "Forked", "Zygote", "ZygoteUnavailable"]

log = structlog.get_logger()

#: the zygote's command: remember the interpreter's own sys.path (minus the '' of -c),
#: make stead importable whatever the environment, then serve
_BOOT = (
    "import sys; _base = list(sys.path[1:]); sys.path.insert(0, sys.argv[1]); "
    "from stead.core.agent.zygote_main import main; main(_base, sys.argv[2:])"
)
_STEAD_ROOT = str(Path(__file__).resolve().parents[3])
_READ_BYTES = 1 << 16


class ZygoteUnavailable(RetryableError):
    """The zygote cannot fork this worker now (not started, died, or refused the request).

    Callers fall back to spawning a fresh interpreter.
    """


@dataclasses.dataclass(frozen=True)
class Forked:
    """A worker the zygote forked: its pid, and how it runs it (script, module or exec)."""

    pid: int
    mode: str
    reason: str


class _Reply:
    def __init__(self) -> None:
        self.event = anyio.Event()
        self.message: dict[str, Any] | None = None


class _ExitSlot:
    def __init__(self) -> None:
        self.event = anyio.Event()
        self.status: tuple[int | None, int | None] = (None, None)


class Zygote:
    """``async with Zygote(settings) as z``: a warm forker of workers, see the module docstring."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        preload: Sequence[str] = ("torch",),
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self._settings = settings or Settings()
        self._preload = tuple(preload)
        self._env = dict(os.environ if env is None else env)
        self._python = python
        self._proc: subprocess.Popen[bytes] | None = None
        self._pidfd = -1
        self._sock: socket.socket | None = None
        self._tg: TaskGroup | None = None
        self._ids = itertools.count(1)
        self._replies: dict[int, _Reply] = {}
        self._abandoned: set[int] = set()
        self._exits: dict[int, _ExitSlot] = {}
        self._send_lock = anyio.Lock()
        self._settled = anyio.Event()
        self._ready_info: dict[str, Any] | None = None
        #: preload requests not answered yet (even if their caller gave up): the zygote imports, and reads no
        #: request (nor EOF) until it is done
        self._preloading: set[int] = set()
        self._dead: str | None = None
        self._closing = False

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Zygote:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [self._python, "-c", _BOOT, _STEAD_ROOT, str(os.getpid()), str(theirs.fileno()),
                   ",".join(self._preload)]
        try:
            # Popen only forks and execs here; it never waits for the zygote
            self._proc = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,  # noqa: ASYNC220
                                          start_new_session=True, env=self._env)
        except OSError as exc:
            ours.close()
            self._mark_dead(f"could not start: {exc}")
            log.warning("zygote_start_failed", error=str(exc), python=self._python)
            return self
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self._pidfd = os.pidfd_open(self._proc.pid)
        log.info("zygote_starting", pid=self._proc.pid, preload=list(self._preload))
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._read_replies)
        self._tg.start_soon(self._watch_process)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._closing = True
        try:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
                return await self._tg.__aexit__(exc_type, exc, tb)
            return None
        finally:
            with anyio.CancelScope(shield=True):
                await self._shutdown()

    async def _shutdown(self) -> None:
        self._mark_dead("closed")
        if self._sock is not None:
            self._sock.close()  # the zygote reads EOF, kills what is left of its children and exits
            self._sock = None
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None and (self._ready_info is None or self._preloading):
            # still importing: it would read the EOF only after the imports (seconds). Nothing to clean up:
            # before it was ready it forked no worker, and the worker groups stopped theirs before we close
            proc.kill()
        if proc.poll() is None:
            with anyio.move_on_after(self._settings.worker_stop_grace_s):
                await anyio.wait_readable(self._pidfd)
            if proc.poll() is None:
                proc.kill()
                await anyio.wait_readable(self._pidfd)
        proc.wait()
        os.close(self._pidfd)
        self._pidfd = -1
        log.info("zygote_stopped", pid=proc.pid, returncode=proc.returncode)

    # -- state ---------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def ready(self) -> bool:
        """True once the preloads are imported and until the zygote dies or is closed."""
        return self._ready_info is not None and self._dead is None

    @property
    def info(self) -> Mapping[str, Any]:
        """The zygote's ready report: pid, failed imports, thread count, start-up seconds."""
        return dict(self._ready_info or {})

    @property
    def starting(self) -> bool:
        """Started and still importing its preloads (neither ready nor dead)."""
        return self._proc is not None and self._ready_info is None and self._dead is None

    async def wait_ready(self) -> bool:
        """Wait until the zygote is ready (True) or has died (False)."""
        await self._settled.wait()
        return self.ready

    # -- requests ------------------------------------------------------------------------

    async def fork(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdout_fd: int,
                   stderr_fd: int) -> Forked:
        """Fork one worker with ``stdout_fd``/``stderr_fd`` as its fds 1 and 2 (they are sent, not closed)."""
        reply = await self._request({"op": "fork", "argv": list(argv), "env": dict(env), "cwd": str(cwd)},
                                    [stdout_fd, stderr_fd])
        if reply["op"] != "forked":
            raise ZygoteUnavailable(f"the zygote could not fork {list(argv)!r}: {reply.get('error')}; "
                                    "the worker is spawned instead")
        pid = int(reply["pid"])
        self._exit_slot(pid)
        return Forked(pid=pid, mode=str(reply["mode"]), reason=str(reply.get("reason", "")))

    async def wait_exit(self, pid: int) -> tuple[int | None, int | None]:
        """``(exit_code, signal)`` of a forked worker, the moment the zygote reaps it.

        If the zygote dies first its workers die of SIGKILL (parent-death signal), which
        is what is returned.
        """
        slot = self._exit_slot(pid)
        await slot.event.wait()
        self._exits.pop(pid, None)
        return slot.status

    async def preload(self, modules: Sequence[str]) -> dict[str, str]:
        """Import more modules in the zygote; returns the ones that failed, with the error."""
        reply = await self._request({"op": "preload", "modules": list(modules)}, [], busy=self._preloading)
        failed = {str(k): str(v) for k, v in reply.get("failed", {}).items()}
        if failed:
            log.warning("zygote_preload_failed", failed=failed)
        return failed

    async def _request(self, message: dict[str, Any], fds: list[int], *, busy: set[int] | None = None
                       ) -> dict[str, Any]:
        """Send one request and wait for its reply; ``busy`` holds the request's id until the reply arrives."""
        if self._dead is not None or self._sock is None:
            raise ZygoteUnavailable(f"the zygote is not running ({self._dead or 'not started'}); "
                                    "workers are spawned instead")
        request_id = next(self._ids)
        reply = self._replies[request_id] = _Reply()
        if busy is not None:
            busy.add(request_id)
        try:
            await self._send({**message, "id": request_id}, fds)
            await reply.event.wait()
        finally:
            self._replies.pop(request_id, None)
            if reply.message is None:  # cancelled: a worker forked for it anyway is killed on arrival
                self._abandoned.add(request_id)
        if reply.message is None:
            raise ZygoteUnavailable(f"the zygote stopped before answering ({self._dead}); "
                                    "workers are spawned instead")
        return reply.message

    async def _send(self, message: dict[str, Any], fds: list[int]) -> None:
        data = encode(message)
        if len(data) > MAX_MESSAGE_BYTES:
            raise ZygoteUnavailable(f"request of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}; "
                                    "shrink the worker environment or spawn")
        async with self._send_lock:
            while True:
                sock = self._sock
                if sock is None:
                    raise ZygoteUnavailable("the zygote was closed; workers are spawned instead")
                try:
                    if fds:
                        socket.send_fds(sock, [data], fds)
                    else:
                        sock.send(data)
                    return
                except BlockingIOError:
                    await anyio.wait_writable(sock)
                except OSError as exc:
                    raise ZygoteUnavailable(f"could not send to the zygote: {exc}; "
                                            "the worker is spawned instead") from exc

    # -- background tasks ----------------------------------------------------------------

    async def _read_replies(self) -> None:
        assert self._sock is not None
        sock = self._sock
        try:
            while True:
                await anyio.wait_readable(sock)
                try:
                    data = sock.recv(_READ_BYTES)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._mark_dead("closed its socket")
                    return
                try:
                    self._dispatch(decode(data))
                except (ValueError, KeyError, TypeError) as exc:  # a protocol bug: stop trusting this zygote
                    log.error("zygote_bad_message", error=str(exc), message=data[:200])
                    self._mark_dead("sent a bad message")
                    if self._proc is not None and self._proc.poll() is None:
                        self._proc.kill()  # its workers die with it (parent-death signal)
                    return
        finally:
            self._mark_dead("closed")

    async def _watch_process(self) -> None:
        assert self._proc is not None
        await anyio.wait_readable(self._pidfd)
        code = self._proc.wait()
        if not self._closing:
            log.warning("zygote_died", pid=self._proc.pid, returncode=code,
                        hint="workers are spawned from now on; check the agent's stderr for the cause")
        self._mark_dead(f"exited with {code}")

    def _dispatch(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "exit":
            slot = self._exit_slot(int(message["pid"]))
            slot.status = (message.get("exit_code"), message.get("signal"))
            slot.event.set()
        elif op == "ready":
            self._ready_info = message
            self._settled.set()
            log.info("zygote_ready", pid=message.get("pid"), seconds=message.get("seconds"),
                     threads=message.get("threads"), failed=message.get("failed"))
            if message.get("failed"):
                log.warning("zygote_preload_failed", failed=message["failed"])
        elif op == "error":
            log.warning("zygote_error", error=message.get("error"))
        else:
            request_id = int(message.get("id") or 0)
            self._preloading.discard(request_id)
            reply = self._replies.get(request_id)
            if reply is not None:
                reply.message = message
                reply.event.set()
            elif request_id in self._abandoned:
                self._abandoned.discard(request_id)
                if op == "forked":
                    _kill_group(int(message["pid"]))

    def _exit_slot(self, pid: int) -> _ExitSlot:
        slot = self._exits.get(pid)
        if slot is None:
            slot = self._exits[pid] = _ExitSlot()
            if self._dead is not None:
                slot.status = (None, signal.SIGKILL)
                slot.event.set()
        return slot

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        self._settled.set()
        for reply in self._replies.values():
            reply.event.set()
        for slot in self._exits.values():
            if not slot.event.is_set():
                slot.status = (None, signal.SIGKILL)
                slot.event.set()


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            continue
        except PermissionError:
            return
