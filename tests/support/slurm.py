"""A real Slurm cluster on test hosts (:mod:`tests.support.hosts`), for the tests of stead under ``srun``/``sbatch``.

The controller (``slurmctld``) runs on a test host of its own (``h0``), one ``slurmd`` on each of the others (the
compute nodes ``h1``..``hN``, named after their hostnames, ``CPUs=2`` each by default: ``srun -N3`` runs one task
per node, ``-n 2 -N 1`` two on one node). Authentication is ``auth/none`` (no ``munged``); every path (config,
state, spool, logs, pid files) is under the fixture's folder, which every host shares. The clients (``srun``,
``sbatch``, ``scontrol``, ``squeue``, ``sinfo``) run only on the controller's host: from the root namespace the
route to the hosts' subnet leaves the machine::

    from tests.support.slurm import slurm_cluster

    async def test_three_nodes(tmp_path: Path) -> None:
        async with slurm_cluster(3, workdir=tmp_path) as cluster:     # skips where namespaces or Slurm are missing
            rc, out, err = await cluster.srun(["-N3", "hostname"])     # "h1\\nh2\\nh3\\n", in some order
            step = await cluster.spawn_srun(["-N3", "sleep", "600"])   # a long step: an asyncio process
            job = await cluster.sbatch(tmp_path / "job.sh")            # its output in tmp_path/slurm-<job>.out
            assert await cluster.wait_job(job) == "COMPLETED"
            await cluster.kill_node(1)                                 # h2 dies, and is marked down at once
            assert await cluster.node_state("h2") == "down"
            await cluster.restart_node(1)                              # h2 back (ReturnToService=2): idle again
            cluster.hosts                                              # the test hosts, h0 the controller's
            cluster.env                                                # SLURM_CONF, PATH: what a client needs
            listener = cluster.listen()                                # a socket of this process on h0's address
            sinfo = await cluster.spawn_client(cluster.tools["sinfo"], stdout=subprocess.PIPE)  # asyncio's signature

Everything stops on exit, also when the body raises: the hosts are killed (slurmctld, every slurmd and job step
with them) and their namespaces removed. The test is skipped, saying why, where namespaces cannot be made or the
Slurm daemons and clients are not installed (``make slurm`` installs Debian's).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import textwrap
import threading
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio
import pytest

from tests.support.hosts import DEFAULT_SHARED, NETNS_DIR, Host, Hosts, test_hosts

__all__ = ["SLURM_TOOLS", "Job", "SlurmCluster", "SlurmError", "scontrol_on_path", "slurm_cluster"]


def scontrol_on_path(folder: Path, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``scontrol`` that runs the shell ``line`` (standing in for Slurm's controller), first on PATH."""
    script = folder / "scontrol"
    script.write_text(f"#!/bin/sh\n{line}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")

#: the daemons and clients the cluster needs, looked up on PATH (and in /usr/sbin, where Debian puts the daemons)
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol", "squeue", "sinfo")
#: inside the hosts' own network namespaces fixed ports never meet another suite's
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
#: how long the daemons may take until every node is idle (1-3 s on a quiet machine)
START_TIMEOUT_S = 60.0
#: how long one client command (``scontrol``, ``squeue``, ``sinfo``, ``sbatch``) may take
CLIENT_TIMEOUT_S = 30.0
#: how often the cluster's state is polled while waiting (nodes idle, a job's end)
POLL_S = 0.1
#: seconds without an answer before slurmctld marks a node down (a killed node is marked down at once anyway)
SLURMD_TIMEOUT_S = 5
#: seconds between a step's SIGTERM and SIGKILL when it is cancelled (its node failed, its job ended); a test that
#: asserts what a job does on its SIGTERM gives it longer (``slurm_cluster(kill_wait_s=...)``)
KILL_WAIT_S = 1
#: setns(2)'s flag for a network namespace
CLONE_NEWNET = 0x40000000
#: a job's states once it has ended (``scontrol show job``'s JobState)
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "TIMEOUT"})


class SlurmError(RuntimeError):
    """A Slurm client failed or the cluster did not come up; the message has its output or the daemons' logs."""


@dataclass(frozen=True)
class Job:
    """One line of ``squeue``: the job's id, name, state (``PENDING``, ``RUNNING``, ...) and nodes (``h[1-3]``)."""

    id: int
    name: str
    state: str
    nodes: str


def _missing_tools() -> list[str]:
    return [tool for tool in SLURM_TOOLS if _which(tool) is None]


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")


def _slurm_conf(workdir: Path, controller: Host, nodes: Sequence[Host], cpus: int,
                kill_wait_s: int = KILL_WAIT_S) -> str:
    node_lines = "\n".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} State=UNKNOWN" for h in nodes)
    return textwrap.dedent(f"""\
        ClusterName=stead
        SlurmctldHost={controller.name}({controller.address})
        SlurmctldPort={SLURMCTLD_PORT}
        SlurmdPort={SLURMD_PORT}
        AuthType=auth/none
        CredType=cred/none
        SlurmUser=root
        SlurmdUser=root
        StateSaveLocation={workdir}/state
        SlurmdSpoolDir={workdir}/spool/%n
        SlurmctldPidFile={workdir}/slurmctld.pid
        SlurmdPidFile={workdir}/slurmd-%n.pid
        SlurmctldLogFile={workdir}/slurmctld.log
        SlurmdLogFile={workdir}/slurmd-%n.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_CPU
        SchedulerType=sched/builtin
        SchedulerParameters=batch_sched_delay=0
        SlurmdParameters=config_overrides
        MpiDefault=none
        ReturnToService=2
        JobRequeue=0
        SlurmdTimeout={SLURMD_TIMEOUT_S}
        KillWait={kill_wait_s}
        InactiveLimit=0
        AccountingStorageType=accounting_storage/none
        JobAcctGatherType=jobacct_gather/none
        JobCompType=jobcomp/none
        MailProg=/bin/true
        """) + node_lines + "\nPartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"


#: slurmd loads a cgroup plugin whatever the proctrack and task plugins: v1, on an empty tmpfs that it must not mount
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"


class SlurmCluster:
    """A running cluster: ``hosts`` (``hosts[0]`` the controller's), ``controller``, ``nodes`` (the compute hosts),
    ``conf`` (slurm.conf's path), ``env``; the clients (run on the controller's host) and the node faults."""

    def __init__(self, hosts: Hosts, workdir: Path, tools: Mapping[str, str]) -> None:
        self.hosts = hosts
        self.controller = hosts[0]
        self.nodes: Sequence[Host] = hosts[1:]
        self.workdir = workdir
        self.conf = workdir / "slurm.conf"
        self.tools = dict(tools)
        #: what a Slurm client needs in its environment: the config and a PATH that finds the clients
        self.env = {"SLURM_CONF": str(self.conf), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        self._daemons: list[asyncio.subprocess.Process] = []

    def client_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment (less any ``SLURM_*`` of a Slurm job the suite itself runs in), then
        :attr:`env`, then ``env``: what ``srun`` passes on to its tasks."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**base, **self.env, **(env or {})}

    async def spawn_srun(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                         cwd: Path | str | None = None, stdout: int | IO[Any] | None = subprocess.PIPE,
                         stderr: int | IO[Any] | None = subprocess.PIPE) -> asyncio.subprocess.Process:
        """``srun args`` started on the controller's host (in ``cwd``, the cluster's folder by default: it must be
        a path every host shares, as the tasks run there); a long step, to wait for or to see end."""
        return await self.controller.spawn([self.tools["srun"], *args], env=self.client_env(env),
                                           cwd=cwd or self.workdir, stdout=stdout, stderr=stderr)

    async def spawn_client(self, *command: str, env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
                           **kwargs: Any) -> asyncio.subprocess.Process:
        """``command`` (a Slurm client and its arguments) started on the controller's host with the cluster's
        :meth:`client_env` (and ``env``), as ``asyncio.create_subprocess_exec(*command, ...)`` starts it here: what
        a program that runs Slurm's clients itself (the Slurm platform's ``spawn``) is given, so that they run
        where they reach the cluster."""
        return await self.controller.spawn(command, env=self.client_env(env), cwd=cwd or self.workdir, **kwargs)

    def listen(self, port: int = 0) -> socket.socket:
        """A TCP socket of this process listening at the controller's address (``port``: a free one by default):
        made in the controller's network namespace, so that the cluster's hosts reach a server this process runs
        on it (as they reach a Slurm job's master on the job's batch host). The caller closes it, before the cluster
        stops (an open socket keeps the namespace, nameless, until then)."""
        made: list[socket.socket] = []
        failed: list[BaseException] = []

        def make() -> None:  # a thread of its own enters the namespace (setns moves the calling thread only)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                with (NETNS_DIR / self.controller.netns).open("rb") as netns:
                    if libc.setns(netns.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.controller.netns}: "
                                                          f"{os.strerror(ctypes.get_errno())}")
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((self.controller.address, port))
                    sock.listen(socket.SOMAXCONN)
                except BaseException:
                    sock.close()
                    raise
                made.append(sock)
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=make, name="slurm-listen")
        thread.start()
        thread.join()  # (the thread ends with it: no thread of this process stays in the namespace)
        if failed:
            raise failed[0]
        return made[0]

    async def srun(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
                   cwd: Path | str | None = None) -> tuple[int, str, str]:
        """``srun args`` to its end: ``(returncode, stdout, stderr)``. A caller bounds a long one with
        ``anyio.fail_after`` (the step is killed if the wait is cancelled)."""
        return await self.controller.run([self.tools["srun"], *args], env=self.client_env(env),
                                         cwd=cwd or self.workdir)

    async def sbatch(self, script: Path | str, *args: str, env: Mapping[str, str] | None = None,
                     cwd: Path | str | None = None) -> int:
        """Submit ``script`` (``sbatch args script``, from ``cwd``: the script's folder by default, where its
        ``slurm-<id>.out`` appears); returns the job's id. slurmctld starts batch jobs on its background pass, once
        a second, and the first not before ~3 s after it started (its ``batch_sched_delay`` of 0 is read only on
        its first pass); ``srun`` steps start at once."""
        out = await self._client("sbatch", "--parsable", *args, str(script), env=env,
                                 cwd=cwd or Path(script).parent)
        return int(out.strip().split(";")[0])

    async def scancel(self, job_id: int, *args: str) -> None:
        """``scancel args job_id`` (a signal with ``--signal``; the whole job, its batch shell included, with
        ``--full``); raises :class:`SlurmError` with Slurm's message if it fails."""
        await self._client("scancel", *args, str(job_id))

    async def scontrol(self, *args: str) -> str:
        """``scontrol args``' output; raises :class:`SlurmError` with its message if it fails."""
        return await self._client("scontrol", *args)

    async def squeue(self) -> list[Job]:
        """The jobs the controller knows that have not ended (pending, running, completing)."""
        out = await self._client("squeue", "--noheader", "--format=%i|%j|%T|%N")
        jobs = []
        for line in out.splitlines():
            job_id, name, state, nodes = line.split("|", 3)
            jobs.append(Job(int(job_id), name, state, nodes))
        return jobs

    async def node_states(self) -> dict[str, str]:
        """Every node's base state in lower case (``idle``, ``allocated``, ``mixed``, ``down``, ``drained``...),
        without sinfo's flags (``*`` not responding, ``~`` powered off...)."""
        out = await self._client("sinfo", "--noheader", "--Node", "--format=%N %T")
        states = {}
        for line in out.splitlines():
            name, state = line.split()
            states[name] = state.rstrip("*~#!%$@^-+")
        return states

    async def node_state(self, name: str) -> str:
        """Node ``name``'s base state (see :meth:`node_states`)."""
        return (await self.node_states())[name]

    async def job_state(self, job_id: int) -> str:
        """Job ``job_id``'s state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ``NODE_FAIL``...)."""
        out = await self.scontrol("show", "job", str(job_id))
        for field in out.split():
            if field.startswith("JobState="):
                return field.removeprefix("JobState=")
        raise SlurmError(f"`scontrol show job {job_id}` gave no JobState: {out!r}")

    async def wait_job(self, job_id: int, *, timeout_s: float = CLIENT_TIMEOUT_S) -> str:
        """Wait until job ``job_id`` has ended; returns its final state."""
        with anyio.fail_after(timeout_s):
            while (state := await self.job_state(job_id)) not in ENDED:  # noqa: ASYNC110 (polling the controller)
                await anyio.sleep(POLL_S)
        return state

    async def wait_nodes(self, state: str, *names: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until nodes ``names`` (every node by default) are in ``state`` (``idle``, ``down``...); raises
        :class:`SlurmError` with the daemons' logs if they are not within ``timeout_s``."""
        wanted = set(names or (h.name for h in self.nodes))
        states: dict[str, str] = {}
        with anyio.move_on_after(timeout_s):
            while True:
                with contextlib.suppress(SlurmError):  # slurmctld not listening yet
                    states = await self.node_states()
                    if all(states.get(name) == state for name in wanted):
                        return
                await anyio.sleep(POLL_S)
        raise SlurmError(f"nodes {sorted(wanted)} not {state} within {timeout_s} s (sinfo: {states}); "
                         f"the daemons' logs:\n{self.logs()}")

    async def kill_node(self, i: int) -> None:
        """Compute node ``i`` (``nodes[i]``, host ``hosts[i + 1]``) dies as a machine does, and is marked down at
        once (``scontrol update state=down``), so that its job steps end now rather than after ``SlurmdTimeout``
        and more."""
        node = self.nodes[i]
        await self.hosts.kill(node.index)
        await self.scontrol("update", f"nodename={node.name}", "state=down", "reason=killed by the test")

    async def restart_node(self, i: int) -> None:
        """Compute node ``i`` back after :meth:`kill_node` (or killed now): a fresh host and slurmd; returns once
        the node is idle again."""
        node = self.nodes[i]
        await self.hosts.restart(node.index)
        await self._start_slurmd(node)
        await self.wait_nodes("idle", node.name)

    def logs(self, lines: int = 20) -> str:
        """The last ``lines`` of every daemon's log and stderr, for a failure's message."""
        parts = []
        for path in sorted(self.workdir.glob("slurm*.log")) + sorted(self.workdir.glob("*.stderr")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                if tail:
                    parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts) or "(no logs)"

    async def _client(self, tool: str, *args: str, env: Mapping[str, str] | None = None,
                      cwd: Path | str | None = None) -> str:
        with anyio.fail_after(CLIENT_TIMEOUT_S):
            rc, out, err = await self.controller.run([self.tools[tool], *args], env=self.client_env(env),
                                                     cwd=cwd or self.workdir)
        if rc != 0:
            raise SlurmError(f"`{tool} {' '.join(args)}` failed (exit status {rc}): {err.strip() or out.strip()}")
        return out

    async def _daemon(self, host: Host, argv: Sequence[str], name: str) -> None:
        with (self.workdir / f"{name}.stderr").open("ab") as stderr:
            proc = await host.spawn(argv, env=self.client_env(), cwd=self.workdir, stdout=stderr, stderr=stderr)
        self._daemons.append(proc)

    async def _start_slurmd(self, node: Host) -> None:
        # an empty cgroup hierarchy of the host's own, in its private mount namespace (gone with the host)
        mount = [self.hosts.tools["mount"], "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/sys/fs/cgroup"]
        rc, _, err = await node.run(mount)
        if rc != 0:
            raise SlurmError(f"cannot mount a tmpfs on {node.name}'s /sys/fs/cgroup: {err.strip()}")
        (self.workdir / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        await self._daemon(node, [self.tools["slurmd"], "-D", "-N", node.name, "-f", str(self.conf)],
                           f"slurmd-{node.name}")

    async def _start(self, cpus: int, kill_wait_s: int = KILL_WAIT_S) -> None:
        (self.workdir / "state").mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_slurm_conf(self.workdir, self.controller, self.nodes, cpus, kill_wait_s))
        (self.workdir / "cgroup.conf").write_text(CGROUP_CONF)
        await self._daemon(self.controller, [self.tools["slurmctld"], "-D", "-i", "-f", str(self.conf)],
                           "slurmctld")
        for node in self.nodes:
            await self._start_slurmd(node)
        await self.wait_nodes("idle")

    async def _reap(self) -> None:
        """After the hosts are gone: wait for the daemons this process started (all killed with their hosts)."""
        for proc in self._daemons:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


@contextlib.asynccontextmanager
async def slurm_cluster(n_compute: int, *, workdir: Path, cpus_per_node: int = 2, kill_wait_s: int = KILL_WAIT_S,
                        shared: Iterable[Path | str] = DEFAULT_SHARED) -> AsyncIterator[SlurmCluster]:
    """``async with slurm_cluster(n, workdir=tmp_path) as cluster:`` a controller and ``n`` compute nodes of
    ``cpus_per_node`` CPUs each (``KillWait`` of ``kill_wait_s``), every node idle; all stopped and removed on
    exit. ``workdir`` (a test's
    ``tmp_path``) holds the config, state and logs, and must be a path every host sees (one of ``shared``, or
    outside /tmp); the test is skipped where namespaces cannot be made or Slurm is not installed."""
    if n_compute < 1:
        raise ValueError(f"slurm_cluster({n_compute}): a cluster needs at least one compute node")
    missing = _missing_tools()
    if missing:
        pytest.skip(f"the Slurm cluster needs {', '.join(missing)} (Debian's slurmctld, slurmd and slurm-client: "
                    "`make slurm` installs them)")
    tools = {tool: _which(tool) or tool for tool in SLURM_TOOLS}
    workdir = workdir / "slurm"
    workdir.mkdir(parents=True, exist_ok=True)
    async with test_hosts(n_compute + 1, shared=shared) as hosts:
        cluster = SlurmCluster(hosts, workdir, tools)
        try:
            await cluster._start(cpus_per_node, kill_wait_s)
            yield cluster
        finally:
            with anyio.CancelScope(shield=True):
                for i in range(len(hosts)):
                    await hosts.kill(i)
                await cluster._reap()

