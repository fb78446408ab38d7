"""LocalPlatform: every node's agent is an OS process on this machine.

Agents are not tied to the master's life: a master that crashes leaves them
running (their workers keep stepping), and the next master :meth:`adopts
<LocalPlatform.adopt>` them by pid. An agent ends with its job: the master's stop
command, or its master gone for longer than ``master_gone_timeout_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncGenerator
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio
import anyio.abc
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from stead.core.config import Settings
from stead.core.errors import PlatformError
from stead.core.events import NodeExited, NodeStarted
from stead.core.platform import AGENT_IDENTITY_ENV, NodeSpec, PlatformEvent, agent_title
from stead.core.procs import is_alive, let_go, signal_group, signal_leader, wait_exit

__all__ = ["LocalPlatform"]

log = structlog.get_logger()

_Key = tuple[str, int]
#: what a spare can stand in for: nodes with the same spare command, environment and working directory
_SpareKey = tuple[tuple[str, ...], tuple[tuple[str, str], ...], str | None]

#: set in every agent's environment (``JOB/NODE/INCARNATION``): how a later master knows an agent it adopts by pid
NODE_ENV = AGENT_IDENTITY_ENV


@dataclasses.dataclass(eq=False, kw_only=True)
class _Node:
    """One agent, launched here or adopted; mutable bookkeeping owned by the platform."""

    spec: NodeSpec
    pid: int
    #: None for an agent adopted from an earlier master: not our child, its exit status is not ours to read
    process: anyio.abc.Process | None
    exited: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    reported: bool = False

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def incarnation(self) -> int:
        return self.spec.incarnation

    @property
    def running(self) -> bool:
        return not self.exited.is_set()

    @property
    def killed(self) -> bool:
        """Ended by a signal (or, adopted, in a way we cannot tell): it may have left things behind."""
        return not self.running and (self.process is None or (self.process.returncode or 0) < 0)

    async def wait(self) -> None:
        if self.process is not None:
            await self.process.wait()
        else:
            await wait_exit(self.pid)
        self.exited.set()


@dataclasses.dataclass(eq=False)
class _Spare:
    """A warm agent with no node yet (``stead agent --spare``), reading its node's identity from its stdin."""

    key: _SpareKey
    process: anyio.abc.Process


class LocalPlatform:
    """Runs each node's agent as a process in its own session on this machine.

    Use as ``async with LocalPlatform(settings) as platform``. ``events()`` yields
    NodeStarted right after a launch and NodeExited the moment the agent exits
    (the event loop's child watcher, no polling); it ends after the platform is
    closed. It is meant for one consumer: two iterators would split the events.
    When the agent exits, what is left of its process group gets SIGKILL before
    NodeExited is reported, so a relaunched node never meets its predecessor's
    workers. :meth:`adopt` takes over an agent an earlier master launched. Closing sends
    SIGTERM to every running agent (which stops its own workers), waits
    ``shutdown_grace_s``, then SIGKILLs the process groups still there; after
    :meth:`detach` (a master that fails and leaves the job to its successor) closing
    leaves the agents running and only stops the spares.
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
        self._detached = False
        self._launch_lock = anyio.Lock()
        self._exit_stack = contextlib.AsyncExitStack()
        self._spares: list[_Spare] = []
        #: bumped by every launch: a spare is started only after launches have been quiet for spare_delay_s
        self._launches = 0

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
            process = await self._take_spare(spec)
            warm = process is not None
            if process is None:
                process = await _spawn(spec)
            node = _Node(spec=spec, pid=process.pid, process=process)
            self._nodes[key] = node
            log.info("node_launched", job=spec.job, node=spec.node_id, incarnation=spec.incarnation,
                     pid=process.pid, spare=warm)
            self._send.send_nowait(NodeStarted(node_id=spec.node_id, incarnation=spec.incarnation,
                                               host="localhost", pid=process.pid))
            task_group.start_soon(self._watch, node, name=f"watch node {spec.node_id}/{spec.incarnation}")
            if spec.spare_command and self._settings.spare_agents > 0:
                self._launches += 1
                task_group.start_soon(self._keep_spares, spec, self._launches, name="start spare agents")

    # -- spares ---------------------------------------------------------------------

    async def _take_spare(self, spec: NodeSpec) -> anyio.abc.Process | None:
        """A running spare for ``spec``, told its node; None when there is none (the node starts cold)."""
        key = _spare_key(spec)
        while spare := next((s for s in self._spares if s.key == key), None):
            self._spares.remove(spare)
            identity = json.dumps({"node_id": spec.node_id, "incarnation": spec.incarnation}) + "\n"
            stdin = spare.process.stdin
            try:
                # a spare killed a moment ago may not be reaped yet, and a write to its pipe may not fail at once
                if spare.process.returncode is not None or stdin is None or not is_alive(spare.process.pid):
                    raise anyio.BrokenResourceError
                await stdin.send(identity.encode())
                await stdin.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                log.warning("spare_agent_gone", pid=spare.process.pid, node=spec.node_id)
                signal_group(spare.process.pid, signal.SIGKILL)
                continue
            log.info("spare_agent_used", node=spec.node_id, incarnation=spec.incarnation, pid=spare.process.pid)
            return spare.process
        return None

    async def keep_spares(self, spec: NodeSpec) -> None:
        """Start spares for ``spec``'s kind of node now, up to spare_agents, with no node launched: a host that
        waits as a job's spare (its `stead run` offered it while the job was at MAX) has a warm agent for the
        node that comes to it."""
        if not spec.spare_command or self._settings.spare_agents == 0:
            return
        async with self._launch_lock:
            self._launches += 1
            launch = self._launches
        self._running_task_group().start_soon(self._keep_spares, spec, launch, 0.0, name="start spare agents")

    async def _keep_spares(self, spec: NodeSpec, launch: int, delay_s: float | None = None) -> None:
        """Once launches have been quiet for ``delay_s`` (spare_delay_s), start spares for ``spec``'s kind of node
        up to spare_agents (a spare that dies is replaced by the next launch's call)."""
        await anyio.sleep(self._settings.spare_delay_s if delay_s is None else delay_s)
        key = _spare_key(spec)
        async with self._launch_lock:
            if launch != self._launches or self._closed:
                return  # a later launch will do it, or the platform is closing
            self._spares = [s for s in self._spares if s.process.returncode is None]
            task_group = self._running_task_group()
            for _ in range(self._settings.spare_agents - sum(1 for s in self._spares if s.key == key)):
                env = {k: v for k, v in {**os.environ, **spec.env}.items() if k != NODE_ENV}
                try:
                    with anyio.CancelScope(shield=True):
                        process = await anyio.open_process(spec.spare_command, stdin=subprocess.PIPE, stdout=None,
                                                           stderr=None, cwd=spec.cwd, env=env, start_new_session=True)
                except OSError as exc:
                    log.warning("spare_agent_start_failed", error=str(exc), command=list(spec.spare_command[:4]))
                    return
                spare = _Spare(key=key, process=process)
                self._spares.append(spare)
                log.info("spare_agent_started", job=spec.job, pid=process.pid)
                task_group.start_soon(self._reap_spare, spare, name=f"watch spare agent {process.pid}")

    async def _reap_spare(self, spare: _Spare) -> None:
        """Forget a spare that exits before it is used (and free its process group)."""
        await spare.process.wait()
        if spare in self._spares:
            self._spares.remove(spare)
            if not self._closed:
                log.warning("spare_agent_exited", pid=spare.process.pid, returncode=spare.process.returncode)
        signal_group(spare.process.pid, signal.SIGKILL)

    async def adopt(self, spec: NodeSpec, *, pid: int | None) -> bool:
        """Take over the agent of ``spec``'s node incarnation that an earlier master launched as ``pid``.

        Adopted, it is watched, killed and stopped like one launched here (its exit status is unknown: it is
        not this process's child). When ``pid`` is not that agent any more (it exited while no master ran, or
        the pid was reused), NodeExited is reported at once, so the master need not wait for the heartbeat
        timeout to notice. Returns whether the agent was adopted.
        """
        job, node_id, incarnation = spec.job, spec.node_id, spec.incarnation
        key = (node_id, incarnation)
        async with self._launch_lock:
            task_group = self._running_task_group()
            if key in self._nodes:
                return True
            if pid is None or not _runs_agent(pid, f"{job}/{node_id}/{incarnation}"):
                log.warning("node_adoption_failed", node=node_id, incarnation=incarnation, pid=pid,
                            reason="its agent is no longer running")
                gone = _Node(spec=spec, pid=pid or 0, process=None, reported=True)  # kept for the cleanup at close
                gone.exited.set()
                self._nodes[key] = gone
                self._send.send_nowait(NodeExited(node_id=node_id, incarnation=incarnation))
                return False
            node = _Node(spec=spec, pid=pid, process=None)
            self._nodes[key] = node
            log.info("node_adopted", job=job, node=node_id, incarnation=incarnation, pid=pid)
            task_group.start_soon(self._watch, node, name=f"watch adopted node {node_id}/{incarnation}")
            return True

    async def kill(self, node_id: str, incarnation: int) -> None:
        node = self._nodes.get((node_id, incarnation))
        if node is None or not node.running:
            log.debug("node_kill_ignored", node=node_id, incarnation=incarnation, known=node is not None)
            return
        log.info("node_killed", node=node_id, incarnation=incarnation, pid=node.pid)
        signal_group(node.pid, signal.SIGKILL)

    def events(self) -> AsyncGenerator[PlatformEvent, None]:
        self._running_task_group()
        # the clone is taken now, not at the first iteration, so that it still reads after close()
        return _iterate(self._receive.clone())

    def _running_task_group(self) -> anyio.abc.TaskGroup:
        if self._task_group is None or self._closed:
            raise PlatformError("the local platform is not running; launch nodes inside `async with platform:`")
        return self._task_group

    async def _watch(self, node: _Node) -> None:
        await node.wait()
        self._report_exit(node)

    def _report_exit(self, node: _Node) -> None:
        """Kill what is left of the node's process group and report NodeExited, once."""
        if node.reported:
            return
        node.reported = True
        signal_group(node.pid, signal.SIGKILL)
        exit_code = sig = None
        if node.process is not None:
            returncode = node.process.returncode
            assert returncode is not None
            exit_code, sig = (None, -returncode) if returncode < 0 else (returncode, None)
        log.info("node_exited", node=node.node_id, incarnation=node.incarnation, pid=node.pid, exit_code=exit_code,
                 signal=sig, adopted=node.process is None)
        self._send.send_nowait(NodeExited(node_id=node.node_id, incarnation=node.incarnation, exit_code=exit_code,
                                          signal=sig))

    def detach(self) -> None:
        """Leave the running agents running when this platform closes: the master goes away but the job does not,
        and the next master adopts them (spares are stopped: they hold nothing)."""
        self._detached = True

    async def _stop_all(self) -> None:
        # shielded: a cancelled master must still take its agents down before it returns
        with anyio.CancelScope(shield=True):
            async with self._launch_lock:
                for spare in self._spares:  # nothing to save: a spare has joined nothing
                    signal_group(spare.process.pid, signal.SIGKILL)
                for spare in self._spares:
                    await spare.process.wait()
                self._spares.clear()
                running = [node for node in self._nodes.values() if node.running]
                if self._detached:
                    self._leave(running)
                    return
                for node in running:
                    signal_leader(node.pid, signal.SIGTERM)
                with anyio.move_on_after(self._settings.shutdown_grace_s):
                    await self._wait_all(running)
                for node in running:
                    if node.running:
                        log.warning("node_stop_timed_out", node=node.node_id, incarnation=node.incarnation,
                                    grace_s=self._settings.shutdown_grace_s)
                        signal_group(node.pid, signal.SIGKILL)
                await self._wait_all(running)
                for node in self._nodes.values():
                    self._report_exit(node)
                await self._clean_up_after_killed()
                self._send.close()
                self._receive.close()  # readers from events() hold clones and drain what is left
                assert self._task_group is not None  # every node reaped: what is left waits to start spares
                self._task_group.cancel_scope.cancel()

    def _leave(self, running: list[_Node]) -> None:
        """Stop watching the running agents and let them outlive this platform (see :meth:`detach`)."""
        for node in running:
            if node.process is not None:
                let_go(node.process)
        log.info("local_platform_detached", nodes=sorted(f"{n.node_id}/{n.incarnation}" for n in running),
                 hint="the agents keep running; the next master adopts them")
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()  # the watchers: their nodes are the next master's to watch
        self._send.close()
        self._receive.close()

    async def _clean_up_after_killed(self) -> None:
        """Run the cleanup command of every node whose last agent was killed: no successor freed what it left on
        this machine (its checkpoint shared memory), and the job is over. Bounded by shutdown_grace_s."""
        last: dict[str, _Node] = {}
        for node in self._nodes.values():
            if node.incarnation >= last.get(node.node_id, node).incarnation:
                last[node.node_id] = node
        commands = [node.spec for node in last.values() if node.killed and node.spec.cleanup_command]
        if not commands:
            return

        async def clean(spec: NodeSpec) -> None:
            env = {**os.environ, **spec.env, NODE_ENV: f"{spec.job}/{spec.node_id}/{spec.incarnation}"}
            try:
                await anyio.run_process(spec.cleanup_command, env=env, cwd=spec.cwd, check=False,
                                        stdin=subprocess.DEVNULL, stdout=None, stderr=None)
            except OSError as exc:
                log.warning("node_cleanup_failed", node=spec.node_id, incarnation=spec.incarnation, error=str(exc))

        with anyio.move_on_after(self._settings.shutdown_grace_s):
            async with anyio.create_task_group() as task_group:
                for spec in commands:
                    task_group.start_soon(clean, spec)

    async def _wait_all(self, nodes: list[_Node]) -> None:
        async def wait_one(node: _Node) -> None:
            await node.wait()
            self._report_exit(node)

        async with anyio.create_task_group() as task_group:
            for node in nodes:
                task_group.start_soon(wait_one, node)


async def _spawn(spec: NodeSpec) -> anyio.abc.Process:
    where = f"node {spec.node_id} (incarnation {spec.incarnation})"
    if not spec.command:
        raise PlatformError(f"cannot launch {where}: its command is empty; give the agent's argv")
    env = {**os.environ, **spec.env, NODE_ENV: f"{spec.job}/{spec.node_id}/{spec.incarnation}"}
    _check_executable(spec.command[0], env, spec.cwd, where)
    try:
        # shielded: a cancellation between fork and return would leave a process nobody watches
        with anyio.CancelScope(shield=True):
            process = await anyio.open_process(spec.command, stdin=subprocess.DEVNULL, stdout=None,
                                               stderr=None, cwd=spec.cwd, env=env, start_new_session=True)
    except OSError as exc:
        raise PlatformError(f"cannot launch {where}: {exc}; check its command and working directory") from exc
    return process


def _spare_key(spec: NodeSpec) -> _SpareKey:
    return tuple(spec.spare_command), tuple(sorted(spec.env.items())), spec.cwd


def _runs_agent(pid: int, node: str) -> bool:
    """Whether ``pid`` is the live agent this platform started for ``node`` (``JOB/NODE/INCARNATION``): by its
    environment, or, for a spare that became the node's agent, by its process title."""
    job, node_id, incarnation = node.rsplit("/", 2)
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
    except OSError:
        return False
    named = (f"{NODE_ENV}={node}".encode() in environ.split(b"\0")
             or (incarnation.isdigit() and title == agent_title(job, node_id, int(incarnation)).encode()))
    return named and is_alive(pid)


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
