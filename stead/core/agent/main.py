"""The node agent: registers with the master, heartbeats, runs the rounds it is told to run.

One agent per node. It owns the node's worker processes (through a
:class:`WorkerGroup` fed by a warm :class:`Zygote`), reports each worker failure
at once with its exit code, signal and stderr tail, and obeys the master's
command stream: start workers for round R, stop them, stop the node. It applies
each command id once (a master resends the command in force until it hears of
it) and acknowledges it on its next heartbeat. When the master cannot be reached
it keeps the workers running and retries with backoff: a master restart must not
stop training.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import anyio
import structlog

from stead.core.agent.errorfile import error_file_path, read_error_file
from stead.core.agent.extensions import AgentContext, Extensions, load_extensions
from stead.core.agent.gpu import GpuHealth
from stead.core.agent.health_check import ORDERS_ENV as HEALTH_ORDERS_ENV
from stead.core.agent.netif import interface_env
from stead.core.agent.notes import NotesReader
from stead.core.agent.oom import OomRecords, killed_like_oom
from stead.core.agent.pace import StepPace
from stead.core.agent.progress import (
    ProgressFiles,
    ProgressReader,
    progress_prefix,
    remove_earlier,
    remove_left_behind,
)
from stead.core.agent.resources import WorkerResources
from stead.core.agent.stacks import dump_stacks
from stead.core.agent.warned import WarningSource, ask_source, warned_event
from stead.core.agent.workers import WorkerExit, WorkerGroup, WorkerSpec
from stead.core.agent.zygote import Zygote
from stead.core.agent.zygote_main import STARTUP_ENV
from stead.core.config import Settings, settings_env
from stead.core.errors import InvalidRequest, RetryableError, SteadError
from stead.core.events import (
    JobWarned,
    NodeHealthReported,
    NumericsReported,
    PeerCollective,
    StackSample,
    StacksDumped,
    WorkerFailed,
    WorkersStarted,
    WorkersSucceeded,
)
from stead.core.platform import HOST_ENV, WARM_FIRST_ENV
from stead.core.retry import Backoff
from stead.core.rpc import (
    AgentReport,
    CheckHealthCmd,
    DumpStacksCmd,
    HeartbeatInfo,
    MasterClient,
    RegisterInfo,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
    client_tls,
    read_token_file,
    retrying,
)
from stead.core.rpc.backend import MAX_ACKS_PER_BEAT, MAX_EVIDENCE_CHARS
from stead.core.runspec import RUN_SPEC_ENV, RunConfig, Streams, read_spec, worker_env
from stead.core.worker.numerics_settings import restore_bounds_env, skip_steps_env
from stead.core.worker.progress import LAST_STEP_ENV

__all__ = ["EXIT_MASTER_GONE", "EXIT_TERMINATED", "ZYGOTE_LATE_PRELOAD", "ZYGOTE_PRELOAD", "Agent",
           "clean_up_after", "load_run_config", "run_agent", "zygote_env"]

log = structlog.get_logger("stead.agent")

#: an event an agent reports (see stead.core.rpc.backend)
_Reported = TypeVar("_Reported", WorkerFailed, WorkersStarted, WorkersSucceeded, StacksDumped, NodeHealthReported,
                    NumericsReported, JobWarned)

#: the agent's exit code when it gave up on a master gone for longer than master_gone_timeout_s
EXIT_MASTER_GONE = 3
#: the agent's exit code after SIGTERM (its node taken away: a pod deleted, preempted, evicted), as a process killed
#: by SIGTERM reports it: it stopped its workers and its extensions persisted the newest checkpoint first
EXIT_TERMINATED = 128 + signal.SIGTERM
#: the `stead run` arguments of the job, as JSON, so every agent builds the same RunConfig
#: what the zygote imports before forking the first workers; none runs a torch op or starts a thread
ZYGOTE_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel")
#: what it imports once the first step is done, for the restarts: torch._dynamo, which DDP imports lazily on
#: construction (about 2 s on a small CPU; before the first fork it would delay the start instead)
ZYGOTE_LATE_PRELOAD = ("torch._dynamo",)
#: of a health check's time (health_timeout_s), the check process gets this share and the agent waits this long
#: for it: its report reaches the master before the master's own timer fails the node
_HEALTH_RUN_SHARE, _HEALTH_WAIT_SHARE = 0.8, 0.9
#: poll the progress files this often between a round's start and its first step (fast "first step" report)
_FIRST_STEP_POLL_S = 0.01
#: the ids of the last commands applied that the agent remembers, to apply a repeated one once: a master resends
#: only a node's latest command, so a few would do
_APPLIED_IDS_KEPT = 64


class Agent:
    def __init__(self, *, client: MasterClient, config: RunConfig, node_id: str, incarnation: int,
                 settings: Settings, token_file: str = "", extensions: Extensions | None = None,
                 zygote: Zygote | None = None, warning_source: WarningSource | None = None) -> None:
        """``warning_source``: who sends the SIGUSR1 warning (Slurm, inside a Slurm job), asked what it announced
        and reported to the master; None: a warning is persisted on, not reported."""
        self.client = client
        self._warning_source = warning_source
        #: a zygote started before this agent knew its node (a spare's): used, not closed, by :meth:`run`
        self._warm = zygote
        self.token_file = token_file
        self.extensions = extensions or Extensions([])
        self._job_ended = False
        #: set when the agent gave up on its master (gone past master_gone_timeout_s)
        self.master_gone = False
        #: set when SIGTERM stopped the agent (see _stop_on_sigterm)
        self.terminated = False
        self.config = config
        self.node_id = node_id
        self.incarnation = incarnation
        self.settings = settings
        self.nproc = config.nproc_per_node
        self.round = 0
        self.node_rank = 0
        self._stopping = False
        #: round -> when this agent began stopping its workers (an exit after it is one we caused)
        self._stopped_at: dict[int, float] = {}
        self._first_step_pending = False
        self._group: WorkerGroup | None = None
        self._zygote: Zygote | None = None
        self._preloaded: set[str] = set(ZYGOTE_PRELOAD) | (set(ZYGOTE_LATE_PRELOAD) if zygote is not None else set())
        self._progress: ProgressFiles | None = None
        #: each local rank's TORCHELASTIC_ERROR_FILE in the current round
        self._error_files: dict[int, Path] = {}
        #: the newest step this node's workers reported in an earlier round (-1: none), for the next round's workers
        self._last_step = -1
        self._reader: ProgressReader | None = None
        #: the workers' numerical notes on their way to the master; a report of them in flight
        self._notes: NotesReader | None = None
        self._forwarding = False
        self._lock = anyio.Lock()
        self._resources = WorkerResources()
        self._pace = StepPace()
        self._oom = OomRecords()
        self._gpu = GpuHealth()
        self._log = log.bind(node=node_id, incarnation=incarnation)
        #: GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME for the workers when the user set neither and the master is on another
        #: host: the interface this agent reaches it from
        self._ifname_env, ifname = interface_env(os.environ, client.address)
        if ifname:
            self._log.info("worker_interface_chosen", ifname=ifname, master=client.address,
                           why="neither GLOO_SOCKET_IFNAME nor NCCL_SOCKET_IFNAME is set: the workers' collectives use "
                               "the interface this host reaches the master from")
        #: the ids of the commands applied, newest last (see _APPLIED_IDS_KEPT)
        self._applied: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: the ids of commands applied that no heartbeat the master answered has carried yet
        self._acks: collections.deque[str] = collections.deque(maxlen=MAX_ACKS_PER_BEAT)

    async def run(self) -> int:
        preload = ZYGOTE_PRELOAD if not self.config.no_python else ()
        prefix = progress_prefix(self.config.job_name, self.node_id, self.incarnation)
        remove_earlier(self.config.job_name, self.node_id, self.incarnation)  # killed predecessors' on this machine
        with (ProgressFiles(range(self.nproc), prefix=prefix) as progress,
              anyio.open_signal_receiver(signal.SIGTERM) as sigterm,
              anyio.open_signal_receiver(signal.SIGUSR1) as warnings):
            self._progress = progress
            self._reader = ProgressReader(progress.paths)
            self._notes = NotesReader(progress.paths)
            self._oom.open()
            try:
                started = (contextlib.nullcontext(self._warm) if self._warm is not None
                           else Zygote(self.settings, preload=preload, env=zygote_env(self.config)))
                async with started as zygote, WorkerGroup(self.settings, zygote=zygote) as group:
                    self._group, self._zygote = group, zygote
                    await self._until_warm(zygote)
                    try:
                        job = await self._register()
                    except RetryableError as exc:
                        self._give_up_on_master(exc)
                        return EXIT_MASTER_GONE
                    await self.extensions.call("start", ctx=AgentContext(
                        job=job, node_id=self.node_id, incarnation=self.incarnation, nproc=self.nproc,
                        settings=self.settings, client=self.client, master_address=self.client.address,
                        token_file=self.token_file, workdir=progress.dir,
                    ))
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._open_gpus)  # off the start-up path: NVML takes ~0.1 s even to say none
                        tg.start_soon(self._heartbeats)
                        tg.start_soon(self._stop_on_sigterm, sigterm, tg.cancel_scope)
                        tg.start_soon(self._persist_on_warning, warnings)
                        await self._obey(tg)
                        tg.cancel_scope.cancel()
            finally:
                self._reader.close()
                self._oom.close()
                self._gpu.close()
                with anyio.CancelScope(shield=True):
                    await self.extensions.call("stop", job_ended=self._job_ended)
        self._log.info("agent_exiting", master_gone=self.master_gone, terminated=self.terminated)
        return EXIT_TERMINATED if self.terminated else EXIT_MASTER_GONE if self.master_gone else 0

    async def _persist_on_warning(self, signals: AsyncIterator[int]) -> None:
        """SIGUSR1 warns that the node will be stopped soon (Slurm's ``--signal=USR1@SECONDS`` before a time limit,
        or a preemption notice): the extensions save what must survive (the newest checkpoint persisted) while the
        workers go on; the stop itself (SIGTERM) persists again what came since."""
        async for _ in signals:
            warned_at = time.time()
            self._log.warning("agent_warned", reason="SIGUSR1", round=self.round,
                              action="persisting the newest checkpoint; the workers go on")
            answers = await self.extensions.call("warned", reason="SIGUSR1 (a time limit's or preemption's warning)")
            # (an extension that persists answers with the step it persists: the checkpoint's)
            persisted = next((a for a in answers if isinstance(a, int) and not isinstance(a, bool)), None)
            if self._warning_source is not None:
                await self._report_warning(self._warning_source, warned_at, persisted)

    async def _report_warning(self, source: WarningSource, warned_at: float, persisted: int | None) -> None:
        """Tell the master what the warning ``source`` sent at ``warned_at`` announced (``job.warned``)."""
        said = await ask_source(source, timeout_s=self.settings.rpc_timeout_s)
        event = warned_event(source, said, node_id=self.node_id, incarnation=self.incarnation, round=self.round,
                             signal="SIGUSR1", warned_at=warned_at, persisted_step=persisted)
        await self._report(lambda: self.client.report_warned(self._reported(event)))

    async def _stop_on_sigterm(self, signals: AsyncIterator[int], scope: anyio.CancelScope) -> None:
        """SIGTERM takes the node away (its pod deleted, preempted or evicted; the local platform closing): the
        workers stop, then the extensions' stop persists the newest checkpoint, within the platform's grace period.
        The master learns of it from the platform, not from here."""
        async for _ in signals:
            self.terminated = True
            self._log.warning("agent_terminated", reason="SIGTERM", round=self.round,
                              action="stopping the workers; the newest checkpoint is persisted before exiting")
            with anyio.CancelScope(shield=True):
                await self._stop_workers("the node is being stopped (SIGTERM)")
            scope.cancel()
            return

    async def _until_warm(self, zygote: Zygote | None) -> None:
        """Join once the zygote has imported torch (``zygote_wait_s`` at most): a node that joins a running job
        makes it resize, and workers that wait for a cold zygote would stall every rank of the new round."""
        if zygote is None or not zygote.starting:
            return
        self._log.info("agent_warming", reason="the node joins once its workers can start at once")
        with anyio.move_on_after(self.settings.zygote_wait_s):
            if await zygote.wait_ready() and os.environ.get(WARM_FIRST_ENV) == "1" and not self.config.no_python:
                late = [m for m in ZYGOTE_LATE_PRELOAD if m not in self._preloaded]  # what DDP imports on its start
                self._preloaded.update(late)
                await zygote.preload(late)

    # -- master ------------------------------------------------------------------

    async def _register(self, *, deadline_s: float | None = None) -> str:
        """Register (again), retrying for ``deadline_s`` (default: master_gone_timeout_s); RetryableError after."""
        host = os.environ.get(HOST_ENV) or socket.gethostname()  # a pod's host name is the pod's: the platform's
        info = RegisterInfo(node_id=self.node_id, incarnation=self.incarnation, host=host,
                            pid=os.getpid(), nproc=self.nproc)
        deadline = self.settings.master_gone_timeout_s if deadline_s is None else deadline_s
        reply = await retrying(lambda: self.client.register(info), self.settings, what="register",
                               deadline_s=deadline)
        self._log.info("agent_registered", master=self.client.address, job=reply.job)
        return reply.job

    def _give_up_on_master(self, exc: RetryableError) -> None:
        self.master_gone = True
        self._log.error("master_gone", master=self.client.address, error=str(exc),
                        timeout_s=self.settings.master_gone_timeout_s,
                        action="stopping the workers and exiting; `stead run` with the same job name resumes the job",
                        hint="raise master_gone_timeout_s to wait longer for a master")

    async def _obey(self, tg: anyio.abc.TaskGroup) -> None:
        """Follow the command stream until told to stop the node; reconnect when it breaks.

        A master gone for longer than master_gone_timeout_s ends the agent: its workers are stopped (and
        checkpoint on the way out), then it exits cleanly with EXIT_MASTER_GONE.
        """
        backoff = Backoff(self.settings)
        gone_since: float | None = None
        while True:
            try:
                async for command in self.client.commands(self.node_id, self.incarnation):
                    backoff.reset()
                    if command.id in self._applied:  # its acknowledgement is not on record yet: say it again
                        self._log.debug("command_repeated", command=command.id)
                        self._acked(command.id)
                        continue
                    match command:
                        case StartWorkersCmd():
                            await self._start_round(command, tg)
                        case StopWorkersCmd():
                            if command.round == self.round:
                                await self._stop_workers(f"told to stop: {command.reason}")
                        case DumpStacksCmd():
                            tg.start_soon(self._dump_stacks, command)
                        case CheckHealthCmd():
                            tg.start_soon(self._check_health, command)
                        case StopNodeCmd():  # acknowledged by the node's exit, which ends its incarnation
                            self._log.info("agent_stop", reason=command.reason)
                            self._job_ended = True
                            await self._stop_workers(command.reason)
                            return
                    self._acked(command.id)
            except RetryableError as exc:
                self._log.warning("master_unreachable", error=str(exc), action="workers keep running; retrying")
                retry_after = exc.retry_after_s
            else:
                retry_after = 0.0
            gone_since = time.monotonic() if gone_since is None else gone_since
            await backoff.wait(at_least=retry_after)
            try:
                await self._register(deadline_s=max(
                    0.0, self.settings.master_gone_timeout_s - (time.monotonic() - gone_since)))
            except RetryableError as exc:
                self._give_up_on_master(exc)
                await self._stop_workers("the master is gone")
                return
            gone_since = None

    def _acked(self, command_id: str) -> None:
        """Remember ``command_id`` as applied, and acknowledge it with the next heartbeat."""
        self._applied[command_id] = None
        self._applied.move_to_end(command_id)
        while len(self._applied) > _APPLIED_IDS_KEPT:
            self._applied.popitem(last=False)
        if command_id not in self._acks:
            self._acks.append(command_id)

    async def _dump_stacks(self, command: DumpStacksCmd) -> None:
        assert self._group is not None and self._progress is not None and self._reader is not None
        if command.round != self.round:
            return  # asked about a round this node has left
        self._log.info("stacks_dump", round=command.round, reason=command.reason)
        stacks, error = await dump_stacks(self._group.pids, self._progress.paths,
                                          timeout_s=self.settings.stacks_timeout_s)
        steps = self._reader.read()
        workers = tuple(StackSample(local_rank=rank, rank=self.node_rank * self.nproc + rank, stack=stack,
                                    step=steps[rank].step if rank in steps else None)
                        for rank, stack in sorted(stacks.items()))
        await self._report(lambda: self.client.report_stacks(self._reported(StacksDumped(
            node_id=self.node_id, round=command.round, workers=workers, method="faulthandler", error=error))))

    async def _check_health(self, command: CheckHealthCmd) -> None:
        """Run this node's part of a health check in a worker process (forked warm) and report it."""
        assert self._progress is not None
        if self.node_id not in command.nodes:
            return
        started = time.monotonic()
        self._log.info("health_check", check=command.check, nodes=list(command.nodes))
        orders = {"check": command.check, "nodes": list(command.nodes), "index": command.nodes.index(self.node_id),
                  "incarnation": self.incarnation, "store_host": command.store_host,
                  "store_port": command.store_port, "timeout_s": _HEALTH_RUN_SHARE * command.timeout_s}
        out = self._progress.dir / f"health-{command.check}.json"
        env = {k: v for k, v in os.environ.items() if k != RUN_SPEC_ENV}  # forked warm: the workers' start-up
        env.update({**startup_env(self.config), HEALTH_ORDERS_ENV: json.dumps(orders), "STEAD_AUTO_STEP": "0"})
        spec = WorkerSpec(argv=(sys.executable, "-m", "stead.core.agent.health_check"), env=env, cwd=os.getcwd(),
                          local_rank=0, stdout_path=out)
        result: dict[str, object] = {}
        error = ""
        try:
            async with WorkerGroup(self.settings, zygote=self._zygote) as group:
                await group.start([spec])
                with anyio.fail_after(_HEALTH_WAIT_SHARE * command.timeout_s):
                    async for ended in group.exits():
                        if not ended.ok:
                            how = f"code {ended.exit_code}" if ended.signal is None else f"by signal {ended.signal}"
                            error = f"the check's process exited {how}: {ended.error_tail[-500:]}"
                        break
            if not error:
                loaded = json.loads(out.read_text().splitlines()[-1])
                result = loaded if isinstance(loaded, dict) else {"error": f"the check printed {loaded!r:.200}"}
        except TimeoutError:
            error = f"the check did not finish within {_HEALTH_WAIT_SHARE * command.timeout_s:g} s"
        except (OSError, ValueError, IndexError, InvalidRequest) as exc:
            error = f"the check could not run or gave no result: {exc}"
        finally:
            out.unlink(missing_ok=True)
        gpu = await self._gpu_faults()  # NVML's view: ECC errors, XIDs, a lost GPU ("" with no GPU)
        if gpu:
            error = f"{error}; GPU faults: {gpu}" if error else f"GPU faults: {gpu}"
        raw = result.get("collectives")
        collectives = tuple(PeerCollective(peer=str(c.get("peer", "?")), error=str(c.get("error", "")),
                                           seconds=float(c["seconds"]) if isinstance(c.get("seconds"), (int, float))
                                           else None)
                            for c in (raw if isinstance(raw, list) else []) if isinstance(c, dict))
        matmul = result.get("matmul_s")
        report = NodeHealthReported(
            node_id=self.node_id, incarnation=self.incarnation, check=command.check,
            matmul_s=float(matmul) if isinstance(matmul, (int, float)) else None, collectives=collectives,
            device=str(result.get("device", "")), error=(error or str(result.get("error", "")))[:MAX_EVIDENCE_CHARS],
            seconds=time.monotonic() - started)
        self._log.info("health_checked", check=command.check, matmul_s=report.matmul_s, error=report.error,
                       collectives=[(c.peer, c.seconds, c.error) for c in collectives], seconds=report.seconds)
        await self._report(lambda: self.client.report_health(self._reported(report)))

    async def _heartbeat_info(self, step: int | None, *, acked: tuple[str, ...]) -> HeartbeatInfo:
        assert self._group is not None
        rss, cpu = self._resources.sample(self._group.pids.values())
        gpu_memory, gpu_util = await self._gpu_usage()
        return HeartbeatInfo(node_id=self.node_id, incarnation=self.incarnation, round=self.round, step=step,
                             workers_alive=self._group.alive, rss_bytes=rss, cpu_percent=cpu,
                             phase=self._reader.phase() if self._reader is not None else "",
                             step_compute_s=self._pace.compute_s(self.nproc), gpu_memory_bytes=gpu_memory,
                             gpu_util_percent=gpu_util, acked=acked)

    async def _final_beat(self) -> None:
        """One heartbeat at once, with the workers' last steps: the master records the job's final step from it,
        not from a heartbeat up to an interval old."""
        with anyio.move_on_after(self.settings.rpc_timeout_s), contextlib.suppress(SteadError):
            await self.client.heartbeat(await self._heartbeat_info(self._step(), acked=()))

    async def _heartbeats(self) -> None:
        async with anyio.create_task_group() as background:  # imports in the zygote never hold a heartbeat up
            await self._beat(background)

    async def _beat(self, background: anyio.abc.TaskGroup) -> None:
        elapsed = 0.0
        while True:
            fast = self._first_step_pending
            await anyio.sleep(_FIRST_STEP_POLL_S if fast else self.settings.heartbeat_interval_s)
            elapsed += _FIRST_STEP_POLL_S if fast else self.settings.heartbeat_interval_s
            step = self._step()
            if step is not None and self._reader is not None:
                self._pace.observe(self._reader.read())
            if fast and step is None and elapsed < self.settings.heartbeat_interval_s:
                continue
            if step is not None and self._first_step_pending:
                self._first_step_pending = False
                background.start_soon(self._preload_imports)
            elapsed = 0.0
            if self._notes is not None and not self._forwarding:
                self._notes.look()
                if self._notes.pending or self._notes.dropped:
                    self._forwarding = True
                    background.start_soon(self._forward_notes)
            beat = await self._heartbeat_info(step, acked=tuple(self._acks))
            try:
                if await self.client.heartbeat(beat):
                    for command_id in beat.acked:  # on record, or recorded soon: the master took them in
                        with contextlib.suppress(ValueError):
                            self._acks.remove(command_id)
                else:
                    self._log.warning("master_forgot_node", action="registering again")
                    await self._register(deadline_s=0.0)  # one try: the command loop rides out a longer outage
            except RetryableError as exc:
                self._log.warning("heartbeat_failed", error=str(exc))

    async def _forward_notes(self) -> None:
        """Send the workers' pending numerical notes (a report of at most MAX_NOTES_PER_REPORT each)."""
        assert self._notes is not None
        try:
            while self._notes.pending or self._notes.dropped:
                notes, dropped = self._notes.take()
                report = self._reported(NumericsReported(node_id=self.node_id, round=self.round, notes=notes,
                                                         dropped=dropped))
                await self._report(functools.partial(self.client.report_numerics, report))
        except SteadError as exc:  # the master is away for longer than a report retries: these notes are lost
            self._log.warning("numerics_notes_lost", error=str(exc))
        finally:
            self._forwarding = False

    async def _preload_imports(self) -> None:
        """Have the zygote import what the workers imported, so the next restart skips it too."""
        assert self._progress is not None
        late = ZYGOTE_LATE_PRELOAD if not self.config.no_python else ()
        wanted = [m for m in (*late, *self._progress.imported(0)) if m not in self._preloaded]
        if not wanted or self._zygote is None or not self._zygote.ready:
            return
        self._preloaded.update(wanted)
        failed = await self._zygote.preload(wanted)
        self._log.info("zygote_preloaded", modules=len(wanted), failed=sorted(failed))

    def _step(self) -> int | None:
        """The step every local worker has reached (None until all of them reported one)."""
        assert self._reader is not None
        steps = self._reader.read()
        if len(steps) < self.nproc:
            return None
        return min(s.step for s in steps.values())

    # -- workers ---------------------------------------------------------------------

    async def _start_round(self, command: StartWorkersCmd, tg: anyio.abc.TaskGroup) -> None:
        async with self._lock:
            assert self._group is not None and self._progress is not None
            if command.round == self.round and self._group.alive:
                # the same command again after a reconnect (the first "started" report may have been lost with
                # the master that sent it): the workers run; say so again
                await self._workers_started(command.round)
                return
            await self._stop_workers(f"round {command.round} starts")
            assert self._reader is not None
            self._last_step = max([self._last_step, *(p.step for p in self._reader.read().values())])
            self._progress.reset()
            self._pace.reset()
            self.round, self.node_rank = command.round, command.node_rank
            self._stopping = False
            await self.extensions.call("before_round", round=command)
            specs = [self._spec(command, local_rank, await self.extensions.worker_env(
                round=command.round, local_rank=local_rank)) for local_rank in range(self.nproc)]
            await self._group.start(specs)
            for pid in self._group.pids.values():
                self._oom.watch(pid)  # the worker's memory cgroup counters, before anything can kill it
            self._first_step_pending = True
            tg.start_soon(self._watch_round, command.round, self._group.exits())
            self._log.info("round_started", round=command.round, node_rank=command.node_rank,
                           world_size=command.world_size)
        await self._workers_started(command.round)

    async def _workers_started(self, round_: int) -> None:
        await self.client.report_workers(self._reported(WorkersStarted(node_id=self.node_id, round=round_)))

    def _spec(self, command: StartWorkersCmd, local_rank: int, extra_env: dict[str, str]) -> WorkerSpec:
        assert self._progress is not None
        cfg = self.config
        env = dict(os.environ)
        redirect = cfg.redirects[local_rank] if local_rank < len(cfg.redirects) else Streams.NONE
        tee = cfg.tee[local_rank] if local_rank < len(cfg.tee) else Streams.NONE
        folder = None
        if cfg.log_dir and (redirect | tee):
            folder = Path(cfg.log_dir) / cfg.job_name / f"attempt_{command.round - 1}" / str(local_rank)
            folder.mkdir(parents=True, exist_ok=True)
        # torchrun's place for it: beside the worker's logs when there are any, else in the agent's own folder
        error_file = self._error_files[local_rank] = error_file_path(
            folder or self._progress.dir, command.round, local_rank)
        env.update(worker_env(
            cfg, local_rank=local_rank, node_rank=command.node_rank, nnodes=command.nnodes,
            restart_count=command.restart_count, master_addr=command.master_addr, master_port=command.master_port,
            world_size=command.world_size, run_id=cfg.rdzv_id, error_file=str(error_file),
        ))
        env.update(self._ifname_env)
        env.update(settings_env(cfg.settings_overrides))  # the job's --set values reach worker-side code too
        env.update(self._progress.env(local_rank))
        env.update(extra_env)
        env[LAST_STEP_ENV] = str(self._last_step)
        env.update(skip_steps_env(command.skip_steps))  # the master's decisions: every rank skips the same steps
        env.update(restore_bounds_env(command.restore_bounds))  # and restores within the same bounds
        env.update({"STEAD_JOB": cfg.job_name, "STEAD_NODE_ID": self.node_id, "STEAD_ROUND": str(command.round),
                    "STEAD_MASTER_ADDR": self.client.address, "STEAD_TOKEN_FILE": self.token_file})
        env.pop(RUN_SPEC_ENV, None)
        stdout_path = stderr_path = None
        if folder is not None:
            stdout_path = folder / "stdout.log" if (redirect | tee) & Streams.OUT else None
            stderr_path = folder / "stderr.log" if (redirect | tee) & Streams.ERR else None
        return WorkerSpec(argv=cfg.entrypoint, env=env, cwd=os.getcwd(), local_rank=local_rank,
                          stdout_path=stdout_path, stderr_path=stderr_path, tee=bool(tee))

    async def _stop_workers(self, reason: str) -> None:
        assert self._group is not None
        self._stopped_at.setdefault(self.round, time.time())  # even with none alive: a late report is told apart
        for old in [r for r in self._stopped_at if r < self.round - 1]:
            del self._stopped_at[old]
        if self._group.alive:
            self._stopping = True
            self._log.info("workers_stop", reason=reason, round=self.round)
            await self._group.stop()

    async def _watch_round(self, round_: int, exits: AsyncIterator[WorkerExit]) -> None:
        succeeded = 0
        exited_ok: list[int] = []  # global ranks that exited 0 while others still ran: named in a later failure
        async for worker_exit in exits:
            stopped_at = self._stopped_at.get(round_, math.inf if round_ == self.round else 0.0)
            if worker_exit.ok or worker_exit.at > stopped_at:
                self._oom.forget(worker_exit.pid)
            if worker_exit.ok:
                exited_ok.append(self.node_rank * self.nproc + worker_exit.local_rank)
                if stopped_at == math.inf:
                    succeeded += 1
                    if succeeded == self.nproc:
                        await self._final_beat()
                        await self._report(lambda: self.client.report_workers(self._reported(
                            WorkersSucceeded(node_id=self.node_id, round=round_))))
            elif worker_exit.at <= stopped_at:
                # every worker that failed on its own is reported, even after the stop (another failure decided
                # first) came: the real cause of a round's end must be on record, not only its first symptom; the
                # master decides the first and records the others
                await self._report_failure(round_, worker_exit, exited_ok=tuple(exited_ok))
                await self.extensions.call("after_failure", round=round_, local_rank=worker_exit.local_rank,
                                           exit_code=worker_exit.exit_code, signal=worker_exit.signal)

    async def _report_failure(self, round_: int, worker_exit: WorkerExit, *, exited_ok: tuple[int, ...] = ()) -> None:
        assert self._reader is not None
        progress = self._reader.read().get(worker_exit.local_rank) if round_ == self.round else None
        oom = self._oom.evidence(worker_exit.pid) if killed_like_oom(worker_exit.exit_code, worker_exit.signal) else ""
        self._oom.forget(worker_exit.pid)
        gpu = await self._gpu_faults()
        error_file = self._error_files.get(worker_exit.local_rank) if round_ == self.round else None
        recorded = read_error_file(error_file) if error_file is not None else ""
        failure = WorkerFailed(
            node_id=self.node_id, round=round_, local_rank=worker_exit.local_rank,
            rank=self.node_rank * self.nproc + worker_exit.local_rank, exit_code=worker_exit.exit_code,
            signal=worker_exit.signal, step=progress.step if progress else None,
            error_tail=recorded or worker_exit.error_tail,
            exited_at=worker_exit.at or None, oom=oom[:MAX_EVIDENCE_CHARS], gpu=gpu[:MAX_EVIDENCE_CHARS],
            exited_ok_ranks=exited_ok,
        )
        self._log.warning("worker_failed", round=round_, local_rank=failure.local_rank, exit_code=failure.exit_code,
                          signal=failure.signal, oom=oom or None, gpu=gpu or None)
        await self._report(lambda: self.client.report_failure(self._reported(failure)))

    async def _open_gpus(self) -> None:
        with anyio.move_on_after(self.settings.rpc_timeout_s) as scope:  # a wedged driver must not hold the agent
            reason = await anyio.to_thread.run_sync(self._gpu.open, abandon_on_cancel=True)
        if scope.cancelled_caught:
            reason = f"NVML did not answer within {self.settings.rpc_timeout_s:g} s"
        self._log.info("gpus", watched=self._gpu.gpus, reason=reason or None)

    async def _gpu_faults(self) -> str:
        """GPU faults since the last look, as a failure's evidence; NVML may hang on a sick GPU: bounded."""
        if not self._gpu.gpus:
            return ""
        with anyio.move_on_after(self.settings.rpc_timeout_s):
            problems = await anyio.to_thread.run_sync(self._gpu.check, abandon_on_cancel=True)
            return "; ".join(str(problem) for problem in problems)
        return f"NVML did not answer within {self.settings.rpc_timeout_s:g} s (a GPU may be lost)"

    async def _gpu_usage(self) -> tuple[int | None, float | None]:
        """The GPUs' memory and utilisation for the heartbeat; unknown (None) without GPU or when NVML is slow."""
        if not self._gpu.gpus:
            return None, None
        with anyio.move_on_after(self.settings.rpc_timeout_s):
            return await anyio.to_thread.run_sync(self._gpu.usage, abandon_on_cancel=True)
        return None, None

    def _reported(self, event: _Reported) -> AgentReport[_Reported]:
        """``event`` as this node incarnation reports it to the master."""
        return AgentReport(incarnation=self.incarnation, event=event)

    async def _report(self, call: object) -> None:
        try:
            await retrying(call, self.settings, what="report")  # type: ignore[arg-type]
        except InvalidRequest as exc:
            self._log.warning("report_refused", error=str(exc))


def load_run_config() -> RunConfig:
    """The job's run spec, from the variable whoever started this agent set (:func:`~stead.core.runspec.read_spec`)."""
    return read_spec(os.environ.get(RUN_SPEC_ENV))


async def clean_up_after(*, node_id: str, incarnation: int) -> int:
    """Free what a killed agent of ``node_id``/``incarnation`` left on this machine (its extensions know what)."""
    config = load_run_config()
    extensions = Extensions(load_extensions(config.settings, plugins=config.plugins, disabled=config.disabled_plugins))
    await extensions.call("cleanup", job=config.job_name, node_id=node_id, incarnation=incarnation)
    removed = remove_left_behind(progress_prefix(config.job_name, node_id, incarnation))
    log.info("agent_cleaned_up", node=node_id, incarnation=incarnation, progress_dirs=len(removed))
    return 0


def startup_env(config: RunConfig) -> dict[str, str]:
    """The start-up variables (OMP_NUM_THREADS, ...) the job's workers get: a process forked from the zygote must
    have the same ones, or it is started as a fresh interpreter instead."""
    sample = worker_env(config, local_rank=0, node_rank=0, nnodes=1, restart_count=0,
                        master_addr="127.0.0.1", master_port=1, world_size=config.nproc_per_node, run_id="")
    return {k: v for k, v in sample.items() if k in STARTUP_ENV}


def zygote_env(config: RunConfig) -> dict[str, str]:
    """The agent's environment plus the start-up variables workers get (so they can be forked)."""
    env = dict(os.environ)
    env.pop(RUN_SPEC_ENV, None)
    env.update(startup_env(config))
    return env


async def run_agent(*, master: str, token_file: str, node_id: str, incarnation: int, settings: Settings,
                    config: RunConfig | None = None, zygote: Zygote | None = None,
                    warning_source: WarningSource | None = None) -> int:
    """Run one node's agent until its job ends; ``zygote``: one already warm (a spare agent's);
    ``warning_source``: who sends the SIGUSR1 warning (see :class:`Agent`)."""
    config = config or load_run_config()
    token = read_token_file(token_file)
    structlog.contextvars.bind_contextvars(node=node_id)
    async with MasterClient(master, token, call_timeout_s=settings.rpc_timeout_s,
                            tls=client_tls(config.settings)) as client:
        agent = Agent(client=client, config=config, node_id=node_id, incarnation=incarnation,
                      settings=config.settings, token_file=token_file, zygote=zygote,
                      warning_source=warning_source,
                      extensions=Extensions(load_extensions(config.settings, plugins=config.plugins,
                                                            disabled=config.disabled_plugins)))
        return await agent.run()
