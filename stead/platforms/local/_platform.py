"""LocalPlatform: every node's agent is an OS process on this machine."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import Self

import anyio
import anyio.abc
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from stead.core.config import Settings
from stead.core.errors import PlatformError
from stead.core.events import NodeExited, NodeStarted
from stead.core.platform import NodeSpec, PlatformEvent
from stead.platforms.local._spawn import agent_argv, signal_group, signal_leader

__all__ = ["LocalPlatform"]

log = structlog.get_logger()

_Key = tuple[str, int]


@dataclasses.dataclass(eq=False, kw_only=True)
class _Node:
    """One launched agent; mutable bookkeeping owned by the platform."""

    spec: NodeSpec
    process: anyio.abc.Process
    reported: bool = False


class LocalPlatform:
    """Runs each node's agent as a process in its own session on this machine.

    Use as ``async with LocalPlatform(settings) as platform``. ``events()`` yields
    NodeStarted right after a launch and NodeExited the moment the agent exits
    (the event loop's child watcher, no polling); it ends after the platform is
    closed. It is meant for one consumer: two iterators would split the events.
    When the agent exits, what is left of its process group gets SIGKILL before
    NodeExited is reported, so a relaunched node never meets its predecessor's
    workers. Closing sends
    SIGTERM to every running agent (which stops its own workers), waits
    ``shutdown_grace_s``, then SIGKILLs the process groups still there.
    """

    name = "local"

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings if settings is not None else Settings()
        self._nodes: dict[_Key, _Node] = {}
        # created on entering, so that a platform never entered holds nothing to close
        self._send: MemoryObjectSendStream[PlatformEvent]
        self._receive: MemoryObjectReceiveStream[PlatformEvent]
        self._task_group: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._launch_lock = anyio.Lock()
        self._exit_stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Self:
        if self._task_group is not None or self._closed:
            raise PlatformError("this LocalPlatform was already started; create a new one")
        self._send, self._receive = anyio.create_memory_object_stream[PlatformEvent](math.inf)
        async with contextlib.AsyncExitStack() as stack:
            self._task_group = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._stop_all)  # runs before the task group waits for the watchers
            self._exit_stack = stack.pop_all()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        self._closed = True
        return await self._exit_stack.__aexit__(exc_type, exc, tb)

    async def launch(self, spec: NodeSpec) -> None:
        key = (spec.node_id, spec.incarnation)
        async with self._launch_lock:  # closing takes the lock too: no launch slips past a close
            task_group = self._running_task_group()
            if key in self._nodes:
                log.debug("node_launch_repeated", node=spec.node_id, incarnation=spec.incarnation)
                return
            if spec.avoid_hosts:  # one host is all there is: the relaunch runs here, and the log says so
                log.warning("node_host_not_avoidable", node=spec.node_id, incarnation=spec.incarnation,
                            avoid=list(spec.avoid_hosts), hint="the local platform has this machine only")
            process = await _spawn(spec)
            node = _Node(spec=spec, process=process)
            self._nodes[key] = node
            log.info("node_launched", job=spec.job, node=spec.node_id, incarnation=spec.incarnation,
                     pid=process.pid)
            self._send.send_nowait(NodeStarted(node_id=spec.node_id, incarnation=spec.incarnation,
                                               host="localhost", pid=process.pid))
            task_group.start_soon(self._watch, node, name=f"watch node {spec.node_id}/{spec.incarnation}")

    async def kill(self, node_id: str, incarnation: int) -> None:
        node = self._nodes.get((node_id, incarnation))
        if node is None or node.process.returncode is not None:
            log.debug("node_kill_ignored", node=node_id, incarnation=incarnation, known=node is not None)
            return
        log.info("node_killed", node=node_id, incarnation=incarnation, pid=node.process.pid)
        signal_group(node.process.pid, signal.SIGKILL)

    def events(self) -> AsyncGenerator[PlatformEvent, None]:
        self._running_task_group()
        # the clone is taken now, not at the first iteration, so that it still reads after close()
        return _iterate(self._receive.clone())

    def _running_task_group(self) -> anyio.abc.TaskGroup:
        if self._task_group is None or self._closed:
            raise PlatformError("the local platform is not running; launch nodes inside `async with platform:`")
        return self._task_group

    async def _watch(self, node: _Node) -> None:
        await node.process.wait()
        self._report_exit(node)

    def _report_exit(self, node: _Node) -> None:
        """Kill what is left of the node's process group and report NodeExited, once."""
        if node.reported:
            return
        node.reported = True
        returncode = node.process.returncode
        assert returncode is not None
        signal_group(node.process.pid, signal.SIGKILL)
        exit_code, sig = (None, -returncode) if returncode < 0 else (returncode, None)
        log.info("node_exited", node=node.spec.node_id, incarnation=node.spec.incarnation, pid=node.process.pid,
                 exit_code=exit_code, signal=sig)
        self._send.send_nowait(NodeExited(node_id=node.spec.node_id, incarnation=node.spec.incarnation,
                                          exit_code=exit_code, signal=sig))

    async def _stop_all(self) -> None:
        # shielded: a cancelled master must still take its agents down before it returns
        with anyio.CancelScope(shield=True):
            async with self._launch_lock:
                running = [node for node in self._nodes.values() if node.process.returncode is None]
                for node in running:
                    signal_leader(node.process.pid, signal.SIGTERM)
                with anyio.move_on_after(self._settings.shutdown_grace_s):
                    await self._wait_all(running)
                for node in running:
                    if node.process.returncode is None:
                        log.warning("node_stop_timed_out", node=node.spec.node_id,
                                    incarnation=node.spec.incarnation, grace_s=self._settings.shutdown_grace_s)
                        signal_group(node.process.pid, signal.SIGKILL)
                await self._wait_all(running)
                for node in self._nodes.values():
                    self._report_exit(node)
                self._send.close()
                self._receive.close()  # readers from events() hold clones and drain what is left

    async def _wait_all(self, nodes: list[_Node]) -> None:
        async def wait_one(node: _Node) -> None:
            await node.process.wait()
            self._report_exit(node)

        async with anyio.create_task_group() as task_group:
            for node in nodes:
                task_group.start_soon(wait_one, node)


async def _spawn(spec: NodeSpec) -> anyio.abc.Process:
    where = f"node {spec.node_id} (incarnation {spec.incarnation})"
    if not spec.command:
        raise PlatformError(f"cannot launch {where}: its command is empty; give the agent's argv")
    env = {**os.environ, **spec.env}
    _check_executable(spec.command[0], env, spec.cwd, where)
    try:
        # shielded: a cancellation between fork and return would leave a process nobody watches
        with anyio.CancelScope(shield=True):
            process = await anyio.open_process(agent_argv(spec.command), stdin=subprocess.DEVNULL, stdout=None,
                                               stderr=None, cwd=spec.cwd, env=env, start_new_session=True)
    except OSError as exc:
        raise PlatformError(f"cannot launch {where}: {exc}; check its command and working directory") from exc
    return process


def _check_executable(program: str, env: dict[str, str], cwd: str | None, where: str) -> None:
    if os.sep in program:
        path = os.path.join(cwd or os.getcwd(), program)
        if not os.access(path, os.X_OK) or os.path.isdir(path):
            raise PlatformError(f"cannot launch {where}: {program!r} is not an executable file; check the path")
    elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise PlatformError(f"cannot launch {where}: {program!r} not found on PATH; give its full path")


async def _iterate(receive: MemoryObjectReceiveStream[PlatformEvent]) -> AsyncGenerator[PlatformEvent, None]:
    with receive:
        async for event in receive:
            yield event
