"""The Slurm platform: the hosts platform, its hosts started by the job's master as steps of the Slurm job it runs in.

`stead run train.py` in an sbatch script (or an salloc shell) holding several nodes serves the job's master on the
host it runs on and starts one job step per node of the allocation (this one's included), each running the same
`stead run` command as one host of the job::

    srun --jobid J --nodes 1 --ntasks 1 --nodelist NODE --overlap --kill-on-bad-exit=0 python -m stead run ARGS

with the multi-node flags it joins by (``PET_NNODES``, ``PET_RDZV_BACKEND=c10d``, ``PET_RDZV_ENDPOINT``,
``PET_RDZV_ID``), the job's token, and the node's Slurm name as its host name (``STEAD_NODE_HOST``: the name a
faulty host's exclusion uses). Every host offers itself to the master (:class:`~stead.platforms.hosts.HostsPlatform`
places the nodes); the nodes beyond ``--nnodes`` are warm spares a lost node's replacement goes to at once.

Each node is its own step, so a node that dies ends its step only, not the job's other steps; the allocation
itself survives a node's death only when the job was submitted with ``--no-kill`` (``#SBATCH --no-kill``), or
Slurm ends the whole job (``NODE_FAIL``). A step that ends while the job runs is looked at (:meth:`_step_ended`):
its node down or failing in Slurm's eyes (``sinfo``), or gone from the allocation, is lost (its node reported
exited now, NodeLost, the node named in the reason) and never used again; a node draining gets no new node; a
step that ended on a healthy node is started again, at most :data:`STEP_STARTS` times; while Slurm's controller
does not answer (``sinfo`` fails) nothing is known of the node, and its step is tried again without counting.
Slurm's node states are also read every :data:`POLL_S`, so that a node Slurm marks down is let go before its
step's end reaches here. A node the job excludes as faulty (``NodeSpec.avoid_hosts``) has its step stopped and
gets none again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Self

import structlog

from stead.core.errors import ConfigError
from stead.core.platform import HOST_ENV, NodeSpec, PlatformEvent
from stead.platforms.hosts._platform import HostsPlatform

__all__ = ["POLL_S", "STEP_STARTS", "SlurmPlatform", "node_states", "step_command"]

log = structlog.get_logger("stead.slurm")

#: how often Slurm's node states are read (one ``sinfo`` for the allocation's nodes)
POLL_S = 5.0
#: how many times a node's step is started in all (its first start included) before the node is given up
STEP_STARTS = 4
#: the pause before a step that ended on a healthy node is started again (doubling at each start)
RESTART_PAUSE_S = 1.0
#: the longest pause between two starts of a node's step
MAX_RESTART_PAUSE_S = 30.0
#: a step that ran this long before it ended failed anew: the pause before its next start is the first again
RAN_A_WHILE_S = 60.0
#: how long one ``sinfo`` may take before the nodes' states count as unknown (the controller not answering)
SINFO_TIMEOUT_S = 30.0
#: how long the hosts' steps are given to end by themselves once the job ended, before srun is signalled
STEP_END_WAIT_S = 10.0
#: how long srun is given to end its step after SIGTERM, before SIGKILL
STEP_KILL_WAIT_S = 5.0
#: the srun lines of a step's stderr kept for the reason of its end
_KEPT_LINES = 5
#: Slurm's base node states (``sinfo %T``, lower case, flags stripped) that mean the node is gone, and that it takes
#: no new work
LOST_STATES = frozenset({"down", "fail", "failing", "future", "unknown"})
DRAIN_STATES = frozenset({"drain", "drained", "draining", "maint", "reboot_issued", "reboot_requested"})

Spawn = Callable[..., Awaitable[asyncio.subprocess.Process]]


def step_command(*, srun: str, job_id: str, node: str, cpus: int | None, argv: Sequence[str]) -> list[str]:
    """The ``srun`` command line that runs ``argv`` as the job's step on ``node``: one task, sharing the node's
    resources with the job's other steps (``--overlap``), left alone by Slurm when it exits badly."""
    command = [srun, f"--jobid={job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap",
               "--kill-on-bad-exit=0", f"--job-name=stead-host-{node}"]
    if cpus:
        command.append(f"--cpus-per-task={cpus}")
    return [*command, *argv]


def node_states(sinfo_output: str) -> dict[str, tuple[str, str]]:
    """``sinfo --noheader --Node --format=%N|%T|%E``'s lines as node -> (base state in lower case, reason)."""
    states = {}
    for line in sinfo_output.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) < 2 or not parts[0]:
            continue
        state = parts[1].strip().lower().rstrip("*~#!%$@^-+")
        states[parts[0].strip()] = (state, parts[2].strip() if len(parts) > 2 else "")
    return states


@dataclasses.dataclass(eq=False)
class _Step:
    """One node's host step: its srun process, how often it was started, why it runs no more."""

    node: str
    cpus: int | None
    process: asyncio.subprocess.Process | None = None
    starts: int = 0
    #: why the node gets no step any more ("" while it does)
    given_up: str = ""
    lines: list[str] = dataclasses.field(default_factory=list)
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class SlurmPlatform:
    """The hosts platform ``hosts`` (it runs no node here: ``nodes_here=False``), with one host step per node of the
    Slurm job ``job_id`` kept running (see the module). ``argv``: the command each step runs; ``env``: what it
    adds to this process's environment there. ``takeover``: a master taking over from one that died, whose steps
    still run (their hosts offer themselves again): a node's step is started only once its host has not come
    back within a few keepalives."""

    name = "slurm"

    def __init__(self, hosts: HostsPlatform, *, job_id: str, nodes: Sequence[str], argv: Sequence[str],
                 env: Mapping[str, str], cpus: Sequence[int] = (), cwd: str | None = None, takeover: bool = False,
                 srun: str = "srun", sinfo: str = "sinfo", poll_s: float = POLL_S, spawn: Spawn | None = None) -> None:
        self.hosts = hosts
        self.job_id = job_id
        self.argv = list(argv)
        self.env = dict(env)
        self.cwd = cwd
        self.takeover = takeover
        self.srun, self.sinfo = srun, sinfo
        self.poll_s = poll_s
        self._spawn: Spawn = spawn or asyncio.create_subprocess_exec
        per_node = list(cpus) if len(cpus) == len(nodes) else [None] * len(nodes)
        self._steps = {node: _Step(node, count) for node, count in zip(nodes, per_node, strict=True)}
        self._leaving = False
        self._detached = False
        self._poll: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    # -- Platform -------------------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        for tool in (self.srun, self.sinfo):
            if os.sep not in tool and shutil.which(tool) is None:
                raise ConfigError(f"{tool} is not on PATH: the Slurm platform starts each node of the job as an srun "
                                  "step and reads the nodes' states with sinfo; run stead in a Slurm job on a host "
                                  "with Slurm's clients, or pick another --platform")
        await self.hosts.__aenter__()
        for step in self._steps.values():
            step.task = asyncio.create_task(self._keep(step), name=f"slurm-step-{step.node}")
        self._poll = asyncio.create_task(self._watch_states(), name="slurm-node-states")
        log.info("slurm_steps", job=self.job_id, nodes=list(self._steps))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._leaving = True
        await self.hosts.__aexit__(exc_type, exc, tb)  # the hosts are told the job ended: their steps end
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        if not self._detached:
            await self._end_steps()
        await asyncio.gather(*self._stopping)
        for step in self._steps.values():
            if step.task is not None:
                step.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await step.task

    def detach(self) -> None:
        """The master leaves the job to the next one: the steps run on (their hosts offer themselves to it)."""
        self._detached = True
        self.hosts.detach()

    def end(self, *, exit_code: int, summary: str) -> None:
        self.hosts.end(exit_code=exit_code, summary=summary)

    async def launch(self, spec: NodeSpec) -> None:
        for name in spec.avoid_hosts:  # excluded by the job as faulty: its step goes, and none comes again
            step = self._steps.get(name)
            if step is not None and not step.given_up:
                self._give_up(step, f"the job excluded host {name} as faulty", lost=False)
        await self.hosts.launch(spec)

    async def kill(self, node_id: str, incarnation: int) -> None:
        await self.hosts.kill(node_id, incarnation)

    async def adopt(self, spec: NodeSpec, *, pid: int | None) -> bool:
        return await self.hosts.adopt(spec, pid=pid)

    async def events(self) -> AsyncIterator[PlatformEvent]:
        async for event in self.hosts.events():
            yield event

    # -- steps ----------------------------------------------------------------------------------------------

    async def _keep(self, step: _Step) -> None:
        """Keep ``step``'s node running a host step until the job ends or the node is given up."""
        if self.takeover:  # its host may still run, offering itself to this master again
            await asyncio.sleep(3 * self.hosts.keepalive_s)
        pause = RESTART_PAUSE_S
        while not self._leaving and not step.given_up:
            if self.hosts.connected(step.node):  # (taken over: that host's step runs on)
                await asyncio.sleep(self.hosts.keepalive_s)
                continue
            if step.starts >= STEP_STARTS:
                self._give_up(step, f"its host step was started {step.starts} times and ended each time (last: "
                                    f"{self._said(step)})", lost=True)
                return
            step.starts += 1
            started = time.monotonic()
            rc = await self._run(step)
            if self._leaving or step.given_up:
                return
            if time.monotonic() - started > RAN_A_WHILE_S:
                pause = RESTART_PAUSE_S  # it ran a while: a new failure, not the same one again
            states = await self._states()
            if step.node not in states:  # Slurm's controller does not answer: nothing is known of the node, and
                step.starts -= 1  # the start is not counted against it (the job keeps what it has meanwhile)
                log.warning("slurm_controller_unreachable", node=step.node, exit_code=rc, said=self._said(step),
                            again_in_s=round(pause, 1), what="the node's host step is started again once sinfo "
                            "answers; check slurmctld (scontrol ping)")
            else:
                why = self._step_ended(step, states)
                if why:
                    self._give_up(step, why, lost=True)
                    return
                log.warning("slurm_step_ended", node=step.node, exit_code=rc, said=self._said(step),
                            again_in_s=round(pause, 1), starts=step.starts)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await step.stop.wait()
            pause = min(pause * 2, MAX_RESTART_PAUSE_S)

    async def _run(self, step: _Step) -> int:
        """Run the node's host step to its end; its exit code (negative: a signal)."""
        env = {**os.environ, **self.env, HOST_ENV: step.node}
        command = step_command(srun=self.srun, job_id=self.job_id, node=step.node, cpus=step.cpus, argv=self.argv)
        step.lines.clear()
        try:
            process = await self._spawn(*command, env=env, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL,
                                        stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            step.lines.append(f"cannot run {self.srun}: {exc}")
            return 127
        step.process = process
        log.info("slurm_step_started", node=step.node, pid=process.pid, start=step.starts)
        assert process.stderr is not None
        async for raw in process.stderr:  # passed on (the host's own lines: the batch output has them all)
            line = raw.decode(errors="replace")
            sys.stderr.write(line)
            if line.startswith("srun:"):
                step.lines = [*step.lines[-(_KEPT_LINES - 1):], line.strip()]
        return await process.wait()

    def _step_ended(self, step: _Step, states: Mapping[str, tuple[str, str]]) -> str:
        """Why the node gets no step again ("" when it does): Slurm says it is gone, or it left the job."""
        said = self._said(step)
        state, reason = states.get(step.node, ("", ""))
        if state in LOST_STATES:
            return f"Slurm says node {step.node} is {state}{f' ({reason})' if reason else ''}; its step ended: {said}"
        if state in DRAIN_STATES:
            return f"Slurm drains node {step.node}{f' ({reason})' if reason else ''}; its step ended: {said}"
        if "Node failure" in said or "Requested node configuration is not available" in said:
            return f"node {step.node} failed or left the Slurm job ({said})"
        return ""

    def _give_up(self, step: _Step, reason: str, *, lost: bool) -> None:
        """The node runs no step any more: it is barred from the job's nodes, its node reported lost (``lost``),
        and its step, if it runs, stopped."""
        if step.given_up:
            return
        step.given_up = reason
        step.stop.set()
        log.warning("slurm_node_given_up", node=step.node, reason=reason)
        self.hosts.bar(step.node, reason, lost=lost)
        if step.process is not None and step.process.returncode is None:
            task = asyncio.get_running_loop().create_task(self._stop(step.process), name=f"slurm-stop-{step.node}")
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def _stop(self, process: asyncio.subprocess.Process) -> None:
        """End one srun and its step: SIGTERM (srun passes it to the task, whose `stead run` stops its node), then
        SIGKILL."""
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(STEP_KILL_WAIT_S):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    async def _end_steps(self) -> None:
        """The job ended: wait for the steps to end by themselves (their hosts were told), then stop the rest."""
        running = [s.process for s in self._steps.values() if s.process is not None and s.process.returncode is None]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STEP_END_WAIT_S):
                for process in running:
                    await process.wait()
        await asyncio.gather(*(self._stop(p) for p in running if p.returncode is None))

    async def _watch_states(self) -> None:
        """Let go of the nodes Slurm marks down or drains while their steps run."""
        while True:
            await asyncio.sleep(self.poll_s)
            states = await self._states()
            for step in self._steps.values():
                state, reason = states.get(step.node, ("", ""))
                if step.given_up or not state:
                    continue
                detail = f" ({reason})" if reason else ""
                if state in LOST_STATES:
                    self._give_up(step, f"Slurm says node {step.node} is {state}{detail}", lost=True)
                elif state in DRAIN_STATES:
                    self._give_up(step, f"Slurm drains node {step.node}{detail}", lost=False)

    async def _states(self) -> dict[str, tuple[str, str]]:
        """Slurm's state of the job's nodes; empty when ``sinfo`` fails (logged: the controller may be away, and
        the job goes on as it is)."""
        command = [self.sinfo, "--noheader", "--Node", f"--nodes={','.join(self._steps)}", "--format=%N|%T|%E"]
        try:
            process = await self._spawn(*command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                        stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            log.warning("slurm_states_unread", error=repr(exc))
            return {}
        try:
            async with asyncio.timeout(SINFO_TIMEOUT_S):
                out, err = await process.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            log.warning("slurm_states_unread", error=f"{self.sinfo} did not answer within {SINFO_TIMEOUT_S:g} s")
            return {}
        if process.returncode != 0:
            log.warning("slurm_states_unread", exit_code=process.returncode, said=err.decode(errors="replace")[-300:])
            return {}
        return node_states(out.decode(errors="replace"))

    @staticmethod
    def _said(step: _Step) -> str:
        return "; ".join(step.lines) or "srun said nothing"
