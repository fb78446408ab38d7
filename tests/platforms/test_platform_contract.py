"""One contract suite for every Platform backend.

Each backend is a :class:`Backend` row. Assertions about real processes (exit
codes, process groups, pids) run only where ``runs_processes`` is set; the
master-death test needs ``helper_setup``, the code that builds the platform in
a helper process. A row made with a module-wide fixture (the Slurm test
cluster, which takes seconds to start) names it in ``fixture``; the rows are
run one after the other, each row's tests together, so that it is started once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from _platform_helpers import (
    EXIT_3,
    HOST_STEP,
    SLEEP,
    SPAWN_CHILD,
    TIMEOUT_S,
    agent,
    alive,
    next_event,
    read_pid,
    remaining_events,
    wait_dead,
    wait_running,
)
from _polling import until
from anyio.streams.buffered import BufferedByteReceiveStream

import stead
from stead.cli.on_hosts import HOST_KEEPALIVE_S
from stead.cli.run_args import parse_run_args
from stead.cli.supervisor import listen
from stead.core.config import Settings
from stead.core.events import NodeExited, NodeStarted
from stead.core.jobtoken import JOB_TOKEN_ENV
from stead.core.platform import HOST_ENV, NodeSpec, Platform
from stead.core.rpc import RpcServer
from stead.platforms.hosts import HostServicer, HostsPlatform, job_shape
from stead.platforms.hosts.slurm import SlurmPlatform
from stead.platforms.local import LocalPlatform
from stead.testing.platforms import RecordingPlatform
from tests.support.slurm import SlurmCluster, slurm_cluster

pytestmark = pytest.mark.anyio

SETTINGS = Settings(shutdown_grace_s=5.0)
#: where the helper process imports stead from: the checkout under test
SOURCE_ROOT = str(Path(stead.__file__).resolve().parent.parent)


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    make: Callable[[Settings], Any]
    #: launched nodes are real processes (exit codes, process groups)
    runs_processes: bool
    #: NodeStarted carries the agent's pid (a pod's container process is not the platform's to name)
    reports_pids: bool = True
    #: the signals a killed node is reported with (a pod is deleted gracefully: SIGTERM, SIGKILL after its grace)
    kill_signals: tuple[int, ...] = (signal.SIGKILL,)
    #: Python code that binds ``platform`` in a helper process (``settings`` is defined); None: not tested
    helper_setup: str | None = None
    #: a module-scoped fixture whose value ``make`` takes first (``make(value, settings)``); None: ``make(settings)``
    fixture: str | None = None
    #: why the adoption tests (an agent adopted by its pid) do not apply; "": they do
    no_pid_adoption: str = ""


class OnTestCluster:
    """The k8s platform with a test cluster of its own (:mod:`tests.support.kube`) around it: its pods run the
    agents' commands as processes of this machine."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Any:
        from stead.platforms.k8s import SECRETS, K8sPlatform, K8sSettings, Kube
        from stead.platforms.k8s.pods import token_secret
        from tests.support.kube import FakeKubeApi, FakeKubelet, local_image_env

        async with contextlib.AsyncExitStack() as stack:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="stead-cluster-"))
            api = await stack.enter_async_context(FakeKubeApi())
            await stack.enter_async_context(FakeKubelet(api.url, root=root, images={"stead:test": local_image_env()},
                                                        retry_s=0.1))
            k8s = K8sSettings(api_url=api.url, namespace="default", image="stead:test", grace_period_s=2,
                              master_host="127.0.0.1")
            async with Kube(k8s, pool=1) as kube:
                await kube.create(SECRETS, token_secret("contract", "default", "c" * 43))
            platform = await stack.enter_async_context(K8sPlatform(self.settings, k8s, environ={}))
            self._stack = stack.pop_all()
        return platform

    async def __aexit__(self, *exc: Any) -> None:
        await self._stack.__aexit__(*exc)


#: the Slurm row's compute nodes: a contract test runs at most two nodes at once, and a host runs one
SLURM_NODES = 2
#: the job token of the hosts and Slurm rows' jobs
HOSTS_TOKEN = "h" * 43


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """A running Slurm job of the test cluster holding every compute node: the allocation the platform's host steps
    run in (as a batch script's `stead run` is in one)."""

    cluster: SlurmCluster
    job_id: str
    nodes: tuple[str, ...]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Module-wide: the Slurm test cluster, started once for the module, lives on one event loop with the tests."""
    return "asyncio"


@pytest.fixture(scope="module")
async def slurm_job(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SlurmJob]:
    """A Slurm test cluster of :data:`SLURM_NODES` compute nodes and a job holding them all (an ``srun sleep`` on
    each, its first step), for the module: skipped, saying why, where namespaces or Slurm are missing."""
    async with slurm_cluster(SLURM_NODES, workdir=tmp_path_factory.mktemp("slurm-contract")) as cluster:
        holder = await cluster.spawn_srun([f"-N{SLURM_NODES}", "--job-name=contract-allocation", "sleep", "3600"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with anyio.fail_after(TIMEOUT_S):
                while not (running := [job for job in await cluster.squeue()  # noqa: ASYNC110 (the controller's)
                                       if job.name == "contract-allocation" and job.state == "RUNNING"]):
                    await anyio.sleep(0.05)
            yield SlurmJob(cluster, str(running[0].id), tuple(node.name for node in cluster.nodes))
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(ProcessLookupError):
                    holder.kill()
                await holder.wait()


class _CommandsToHosts(HostsPlatform):
    """The hosts platform, which leaves each launched node's command in ``folder`` too, for the hosts'
    :data:`HOST_STEP` (the master's Launch names the node only)."""

    def __init__(self, folder: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder

    async def launch(self, spec: NodeSpec) -> None:
        path = self.folder / f"{spec.node_id}.{spec.incarnation}.json"
        if not path.exists():
            path.with_suffix(".tmp").write_text(json.dumps(list(spec.command)))
            path.with_suffix(".tmp").replace(path)
        await super().launch(spec)


class _OnHosts:
    """A platform whose nodes run on hosts that offer themselves to its RPC server (the hosts platform's, which the
    Slurm platform's is too), made as `stead run` makes it on the master's host (:mod:`stead.cli.on_hosts`) and
    driven from this process. Each host runs the job's `stead run` as a host does (:data:`HOST_STEP`); the platform
    is handed out once every host offered itself. Subclasses say where the server listens and how hosts start."""

    #: the hosts' names (a contract test runs at most two nodes at once, and a host runs one)
    nodes: tuple[str, ...] = ("host-1", "host-2")
    #: the address the hosts reach the master at
    address = "127.0.0.1"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Any:
        async with contextlib.AsyncExitStack() as stack:
            # the job's folder on a filesystem every host shares: the script each host's command line names, and
            # the agents' commands
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="job-", dir=self._shared())))
            (folder / "agents.py").write_text("")
            listener = stack.enter_context(self._listen())
            endpoint = f"{self.address}:{listener.getsockname()[1]}"
            args = ["--nnodes", f"1:{len(self.nodes)}", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", "contract", "--set", f"shutdown_grace_s={self.settings.shutdown_grace_s:g}",
                    str(folder / "agents.py")]
            config = parse_run_args(args, environ={}, cwd=str(folder))
            hosts = _CommandsToHosts(folder, local=RecordingPlatform(), shape=job_shape(config), local_rank=None,
                                     static=False, host_name="master", keepalive_s=HOST_KEEPALIVE_S,
                                     pending_after_s=3600.0, nodes_here=False)
            await stack.enter_async_context(RpcServer([HostServicer(hosts, keepalive_s=HOST_KEEPALIVE_S)],
                                                      token=HOSTS_TOKEN, listen_fd=listener.fileno()))
            argv = [sys.executable, "-c", HOST_STEP, str(folder), json.dumps(args)]
            env = {JOB_TOKEN_ENV: HOSTS_TOKEN, "CONTRACT_KEEPALIVE_S": str(HOST_KEEPALIVE_S), "PYTHONPATH": SOURCE_ROOT}
            platform = await self._platform(stack, hosts, argv, env, folder)
            await until(lambda: all(hosts.connected(node) for node in self.nodes), "every host offered itself")
            self._stack = stack.pop_all()
        return platform

    async def __aexit__(self, *exc: Any) -> None:
        await self._stack.__aexit__(*exc)

    def _shared(self) -> str | None:
        return None

    def _listen(self) -> socket.socket:
        return listen(self.address)

    async def _platform(self, stack: contextlib.AsyncExitStack, hosts: HostsPlatform, argv: list[str],
                        env: dict[str, str], folder: Path) -> Any:
        """The platform, entered on ``stack``, its hosts started (each runs ``argv`` with ``env`` in ``folder``)."""
        raise NotImplementedError


class OnLocalHosts(_OnHosts):
    """The hosts platform with its hosts' `stead run` started here, on this machine's loopback (named by
    ``STEAD_NODE_HOST``, as the Slurm platform names its hosts): no namespace needed."""

    async def _platform(self, stack: contextlib.AsyncExitStack, hosts: HostsPlatform, argv: list[str],
                        env: dict[str, str], folder: Path) -> Any:
        for node in self.nodes:
            host = await anyio.open_process(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=folder,
                                            env={**os.environ, **env, HOST_ENV: node}, start_new_session=True)
            stack.push_async_callback(_ended, host)  # (after the platform closed: told that the job ended)
        return await stack.enter_async_context(hosts)


async def _ended(host: anyio.abc.Process) -> None:
    """Wait for a host's `stead run` to end (its master told it the job ended), killed if it does not."""
    with anyio.move_on_after(TIMEOUT_S):
        await host.wait()
    if host.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(host.pid, signal.SIGKILL)
        await host.wait()
    await host.aclose()


class OnSlurmJob(_OnHosts):
    """The Slurm platform of :func:`slurm_job`'s job, as a batch script's `stead run` makes it
    (:func:`stead.cli.on_hosts.slurm_platform`): its ``srun`` and ``sinfo`` run on the controller's host (Slurm's
    clients reach the cluster from there only), and its hosts' RPC server listens at the controller's address, on a
    socket this process made in that host's network namespace (:meth:`SlurmCluster.listen`). Each compute node's
    host step runs the job's `stead run`."""

    def __init__(self, job: SlurmJob, settings: Settings) -> None:
        super().__init__(settings)
        self.job = job
        self.nodes = job.nodes
        self.address = job.cluster.controller.address

    def _shared(self) -> str | None:
        return str(self.job.cluster.workdir)

    def _listen(self) -> socket.socket:
        return self.job.cluster.listen()

    async def _platform(self, stack: contextlib.AsyncExitStack, hosts: HostsPlatform, argv: list[str],
                        env: dict[str, str], folder: Path) -> Any:
        cluster = self.job.cluster
        clients: list[asyncio.subprocess.Process] = []

        async def spawn(*command: str, **kwargs: Any) -> asyncio.subprocess.Process:
            process = await cluster.spawn_client(*command, **kwargs)
            clients.append(process)
            return process

        stack.push_async_callback(_clients_ended, clients)  # (after the platform closed)
        platform = SlurmPlatform(hosts, job_id=self.job.job_id, nodes=self.nodes, argv=argv, env=env, cwd=str(folder),
                                 srun=cluster.tools["srun"], sinfo=cluster.tools["sinfo"], spawn=spawn)
        return await stack.enter_async_context(platform)


async def _clients_ended(clients: list[asyncio.subprocess.Process]) -> None:
    """The Slurm clients the platform started, gone. Each runs under a wrapper that enters the controller's
    namespaces (:meth:`SlurmCluster.spawn_client`): the platform stops the wrapper it was handed (where a batch
    script's platform stops ``srun`` itself), and an ``srun`` still finishing its step with a slow controller may
    outlive it (seen once: 10 s after the platform closed). Its process group (the wrapper's session) is killed."""
    for process in clients:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


BACKENDS = [
    Backend("local", LocalPlatform, runs_processes=True,
            helper_setup="from stead.platforms.local import LocalPlatform\nplatform = LocalPlatform(settings)"),
    Backend("recording", lambda settings: RecordingPlatform(), runs_processes=False),
    # each host's `stead run` kills its node's agent with its local platform (SIGKILL, as the local row's) and
    # reports the agent's pid on its host (here this machine, where the test watches it). A new master adopts a
    # host's node when the host offers itself to it again (its `stead run` outlives the master), never by a pid of
    # another machine: the adoption tests do not apply
    Backend("hosts", OnLocalHosts, runs_processes=True,
            no_pid_adoption="a new master adopts the nodes of the hosts that offer themselves to it again, not a pid "
            "(tests/platforms/hosts/test_hosts_platform.py, tests/e2e/test_hosts_jobs.py)"),
    Backend("k8s", OnTestCluster, runs_processes=True, reports_pids=False,
            kill_signals=(signal.SIGTERM, signal.SIGKILL), no_pid_adoption="it adopts pods by name, not pid (its "
            "own tests cover adoption)"),
    # the hosts row's platform, each host a step of the Slurm job on its compute node: the same signals and pids
    # (the test cluster's hosts share this machine's pid namespace: the test watches their agents too)
    Backend("slurm", OnSlurmJob, runs_processes=True, fixture="slurm_job",
            no_pid_adoption="a new master adopts the nodes of the hosts that offer themselves to it again, not a pid "
            "(tests/platforms/hosts/test_slurm_platform.py's takeover test)"),
]


@pytest.fixture(scope="module", params=BACKENDS, ids=lambda backend: backend.name)
def backend(request: pytest.FixtureRequest) -> Backend:
    result: Backend = request.param
    if result.fixture is not None:
        result = dataclasses.replace(result, make=functools.partial(result.make, request.getfixturevalue(
            result.fixture)))
    return result


def needs_processes(backend: Backend) -> None:
    if not backend.runs_processes:
        pytest.skip(f"the {backend.name} backend runs no processes")


async def test_backend_satisfies_the_platform_protocol(backend: Backend) -> None:
    async with backend.make(SETTINGS) as platform:
        assert isinstance(platform, Platform)
        assert platform.name


async def test_launch_reports_node_started(backend: Backend, strays: list[int]) -> None:
    async with backend.make(SETTINGS) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.launch(agent(SLEEP, node="n1", incarnation=2))
        started = await next_event(events)
        assert isinstance(started, NodeStarted)
        assert (started.node_id, started.incarnation) == ("n1", 2)
        if backend.reports_pids and backend.runs_processes:
            assert started.pid is not None
            strays.append(started.pid)
            assert alive(started.pid)


async def test_exit_code_is_reported(backend: Backend) -> None:
    needs_processes(backend)
    async with backend.make(SETTINGS) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.launch(agent(EXIT_3))
        assert isinstance(await next_event(events), NodeStarted)
        assert await next_event(events) == NodeExited(node_id="n1", incarnation=1, exit_code=3, signal=None)


async def test_kill_reports_sigkill(backend: Backend, strays: list[int]) -> None:
    async with backend.make(SETTINGS) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.launch(agent(SLEEP))
        started = await next_event(events)
        assert isinstance(started, NodeStarted)
        if started.pid is not None:
            strays.append(started.pid)
        await platform.kill("n1", 1)
        exited = await next_event(events)
        assert isinstance(exited, NodeExited) and (exited.node_id, exited.incarnation) == ("n1", 1)
        assert exited.exit_code is None and exited.signal in backend.kill_signals
        if backend.runs_processes and backend.reports_pids:
            assert started.pid is not None
            await wait_dead(started.pid)


async def test_kill_reaches_every_process_of_the_node(backend: Backend, scratch: Path, strays: list[int]) -> None:
    needs_processes(backend)
    pid_file = scratch / "child.pid"
    async with backend.make(SETTINGS) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.launch(agent(SPAWN_CHILD, str(pid_file)))
        assert isinstance(await next_event(events), NodeStarted)
        child = await read_pid(pid_file)
        strays.append(child)
        await platform.kill("n1", 1)
        exited = await next_event(events)
        assert isinstance(exited, NodeExited) and exited.signal in backend.kill_signals
        await wait_dead(child)


async def test_launching_the_same_incarnation_twice_starts_one_node(backend: Backend, strays: list[int]) -> None:
    spec = agent(SLEEP)
    async with backend.make(SETTINGS) as platform, contextlib.aclosing(platform.events()) as events:
        async with anyio.create_task_group() as task_group:  # concurrent repeats too
            task_group.start_soon(platform.launch, spec)
            task_group.start_soon(platform.launch, spec)
        await platform.launch(spec)
        started = await next_event(events)
        assert isinstance(started, NodeStarted)
        if started.pid is not None:
            strays.append(started.pid)
        await platform.kill("n1", 1)
        assert isinstance(await next_event(events), NodeExited)
        await platform.launch(spec)  # a finished incarnation is not started again either
    rest = await remaining_events(events)
    assert rest == []


async def test_a_new_incarnation_of_a_node_is_a_new_node(backend: Backend, strays: list[int]) -> None:
    async with backend.make(SETTINGS) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.launch(agent(SLEEP, incarnation=1))
        await platform.launch(agent(SLEEP, incarnation=2))
        first, second = await next_event(events), await next_event(events)
        assert {(e.node_id, e.incarnation) for e in (first, second)} == {("n1", 1), ("n1", 2)}
        assert all(isinstance(e, NodeStarted) for e in (first, second))
        strays.extend(e.pid for e in (first, second) if isinstance(e, NodeStarted) and e.pid is not None)
        await platform.kill("n1", 1)
        exited = await next_event(events)
        assert isinstance(exited, NodeExited) and exited.incarnation == 1


async def test_killing_an_unknown_or_finished_node_is_ignored(backend: Backend, strays: list[int]) -> None:
    async with backend.make(SETTINGS) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.kill("nobody", 1)
        await platform.launch(agent(SLEEP))
        started = await next_event(events)
        if isinstance(started, NodeStarted) and started.pid is not None:
            strays.append(started.pid)
        await platform.kill("n1", 7)  # a known node, an unknown incarnation
        await platform.kill("n1", 1)
        assert isinstance(await next_event(events), NodeExited)
        await platform.kill("n1", 1)
    assert await remaining_events(events) == []


async def test_closing_kills_every_node(backend: Backend, scratch: Path, strays: list[int]) -> None:
    pid_file = scratch / "child.pid"
    async with backend.make(SETTINGS) as platform:
        events = platform.events()
        await platform.launch(agent(SLEEP, node="a"))
        await platform.launch(agent(SPAWN_CHILD, str(pid_file), node="b"))
        started = [await next_event(events), await next_event(events)]
        pids = [e.pid for e in started if isinstance(e, NodeStarted) and e.pid is not None]
        strays.extend(pids)
        if backend.runs_processes:
            pids.append(await read_pid(pid_file))
            strays.append(pids[-1])
    exited = await remaining_events(events)
    assert sorted((e.node_id, type(e)) for e in exited) == [("a", NodeExited), ("b", NodeExited)]
    for pid in pids:
        await wait_dead(pid)  # the suite-wide fixture then checks that no child process is left


async def test_agents_outlive_a_killed_master_and_the_next_platform_adopts_them(backend: Backend,
                                                                                strays: list[int]) -> None:
    needs_processes(backend)
    if backend.no_pid_adoption:
        pytest.skip(f"the {backend.name} backend: {backend.no_pid_adoption}")
    if backend.helper_setup is None:
        pytest.skip(f"the {backend.name} backend has no helper process setup")
    code = "\n".join([
        "import sys, anyio",
        "from stead.core.config import Settings",
        "from stead.core.platform import NodeSpec",
        "settings = Settings()",
        backend.helper_setup,
        "async def main():",
        "    async with platform:",
        f"        await platform.launch(NodeSpec(job='contract', node_id='n1', incarnation=1,"
        f" command=(sys.executable, '-c', {SLEEP!r})))",
        "        async for event in platform.events():",
        "            print('AGENT_PID', event.pid, flush=True)",
        "            await anyio.sleep_forever()",
        "anyio.run(main)",
    ])
    master = await anyio.open_process([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": SOURCE_ROOT})
    async with master:
        try:
            assert master.stdout is not None
            lines = BufferedByteReceiveStream(master.stdout)
            with anyio.fail_after(TIMEOUT_S):
                line = b""
                while not line.startswith(b"AGENT_PID"):
                    line = await lines.receive_until(b"\n", 65536)
            agent_pid = int(line.split()[1])
            strays.append(agent_pid)
        finally:
            master.kill()  # SIGKILL: the master gets no chance to clean up
            await master.wait()
    assert alive(agent_pid), "the agent died with its master"
    async with backend.make(SETTINGS) as platform, contextlib.aclosing(platform.events()) as events:
        wrong = agent(SLEEP, node="n1", incarnation=2)
        assert not await platform.adopt(wrong, pid=agent_pid), "adopted the wrong incarnation"
        assert await next_event(events) == NodeExited(node_id="n1", incarnation=2)
        stranger = agent(SLEEP, node="n2", incarnation=1)
        assert not await platform.adopt(stranger, pid=os.getpid()), "adopted a process it never started"
        assert await next_event(events) == NodeExited(node_id="n2", incarnation=1)
        assert await platform.adopt(agent(SLEEP, node="n1", incarnation=1), pid=agent_pid)
        await platform.kill("n1", 1)
        assert await next_event(events) == NodeExited(node_id="n1", incarnation=1)  # not our child: no status
    await wait_dead(agent_pid)


async def test_closing_stops_adopted_nodes_too(backend: Backend, strays: list[int]) -> None:
    needs_processes(backend)
    if backend.no_pid_adoption:
        pytest.skip(f"the {backend.name} backend: {backend.no_pid_adoption}")
    async with backend.make(SETTINGS) as first:
        await first.launch(agent(SLEEP))
        started = await next_event(first.events())
        assert isinstance(started, NodeStarted) and started.pid is not None
        strays.append(started.pid)
        await wait_running(started.pid, SLEEP)  # what a second master finds is the agent, not a copy of the first
        async with backend.make(SETTINGS) as second:
            events = second.events()
            assert await second.adopt(agent(SLEEP, node="n1", incarnation=1), pid=started.pid)
        assert await remaining_events(events) == [NodeExited(node_id="n1", incarnation=1)]
        await wait_dead(started.pid)
