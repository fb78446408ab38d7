"""One contract suite for every Platform backend.

Each backend is a :class:`Backend` row. Assertions about real processes (exit
codes, process groups, pids) run only where ``runs_processes`` is set; the
master-death test needs ``helper_setup``, the code that builds the platform in
a helper process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from _platform_helpers import (
    EXIT_3,
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
from anyio.streams.buffered import BufferedByteReceiveStream

import stead
from stead.core.config import Settings
from stead.core.events import NodeExited, NodeStarted
from stead.core.platform import Platform
from stead.platforms.local import LocalPlatform
from stead.testing.platforms import RecordingPlatform

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


BACKENDS = [
    Backend("local", LocalPlatform, runs_processes=True,
            helper_setup="from stead.platforms.local import LocalPlatform\nplatform = LocalPlatform(settings)"),
    Backend("recording", lambda settings: RecordingPlatform(), runs_processes=False),
    Backend("k8s", OnTestCluster, runs_processes=True, reports_pids=False,
            kill_signals=(signal.SIGTERM, signal.SIGKILL)),
]


@pytest.fixture(params=BACKENDS, ids=lambda backend: backend.name)
def backend(request: pytest.FixtureRequest) -> Backend:
    result: Backend = request.param
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
    if not backend.reports_pids:
        pytest.skip(f"the {backend.name} backend adopts by name, not pid (its own tests cover adoption)")
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
