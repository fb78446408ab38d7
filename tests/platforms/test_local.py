"""What the local platform does beyond the shared contract."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import anyio
import pytest
from _platform_helpers import SLEEP, SPAWN_CHILD, agent, next_event, read_pid, remaining_events, wait_dead, wait_exists
from _polling import until

from stead.core.config import Settings
from stead.core.errors import ConfigError, PlatformError
from stead.core.events import NodeExited, NodeStarted
from stead.core.platform import NodeSpec, agent_title
from stead.core.procs import is_alive
from stead.platforms.local import LocalPlatform, create, platform_factory

pytestmark = pytest.mark.anyio


async def exit_of(spec: NodeSpec, settings: Settings | None = None) -> NodeExited:
    """Run one agent to its end and return its NodeExited."""
    async with LocalPlatform(settings) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.launch(spec)
        started = await next_event(events)
        assert isinstance(started, NodeStarted) and started.host == "localhost"
        exited = await next_event(events)
        assert isinstance(exited, NodeExited)
        return exited


async def test_agent_gets_spec_env_over_the_master_env_and_runs_in_spec_cwd(scratch: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEAD_TEST_INHERITED", "from-master")
    monkeypatch.setenv("STEAD_TEST_OVERRIDDEN", "from-master")
    code = ("import os, sys\n"
            "ok = (os.environ['STEAD_TEST_INHERITED'] == 'from-master'"
            " and os.environ['STEAD_TEST_OVERRIDDEN'] == 'from-spec'"
            " and os.path.samefile(os.getcwd(), sys.argv[1]))\n"
            "sys.exit(0 if ok else 5)")
    spec = agent(code, str(scratch), env={"STEAD_TEST_OVERRIDDEN": "from-spec"}, cwd=str(scratch))
    assert (await exit_of(spec)).exit_code == 0


async def test_agent_leads_its_own_session() -> None:
    code = "import os, sys; sys.exit(0 if os.getsid(0) == os.getpid() == os.getpgid(0) else 4)"
    assert (await exit_of(agent(code))).exit_code == 0


async def test_agent_is_not_tied_to_the_master_by_a_death_signal_and_carries_its_node_name() -> None:
    # PR_GET_PDEATHSIG is 2: an agent must outlive a master that crashes (the next one adopts it)
    code = ("import ctypes, os, sys\n"
            "sig = ctypes.c_int(-1)\n"
            "ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)\n"
            "sys.exit(10 + sig.value if os.environ.get('STEAD_LOCAL_NODE') == 'contract/n1/1' else 4)")
    assert (await exit_of(agent(code))).exit_code == 10


async def test_processes_left_by_an_exited_agent_are_killed(scratch: Path, strays: list[int]) -> None:
    pid_file = scratch / "child.pid"
    code = SPAWN_CHILD.replace("time.sleep(300)\n", "sys.exit(0)\n")
    assert code != SPAWN_CHILD
    assert (await exit_of(agent(code, str(pid_file)))).exit_code == 0
    child = await read_pid(pid_file)
    strays.append(child)
    await wait_dead(child)


async def test_agent_ignoring_sigterm_is_killed_after_the_grace(scratch: Path, strays: list[int]) -> None:
    ready = scratch / "ready"
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "open(sys.argv[1], 'w').close()\n"
            "time.sleep(300)")
    async with LocalPlatform(Settings(shutdown_grace_s=0.2)) as platform:
        events = platform.events()
        await platform.launch(agent(code, str(ready)))
        started = await next_event(events)
        assert isinstance(started, NodeStarted) and started.pid is not None
        strays.append(started.pid)
        await wait_exists(ready)
    assert await remaining_events(events) == [NodeExited(node_id="n1", incarnation=1, signal=signal.SIGKILL)]


async def test_agents_are_stopped_when_the_owner_is_cancelled(strays: list[int]) -> None:
    with anyio.CancelScope() as scope:
        async with LocalPlatform() as platform:
            events = platform.events()
            await platform.launch(agent(SLEEP))
            started = await next_event(events)
            assert isinstance(started, NodeStarted) and started.pid is not None
            pid = started.pid
            strays.append(pid)
            scope.cancel()
            await anyio.sleep_forever()
    await wait_dead(pid)
    assert await remaining_events(events) == [NodeExited(node_id="n1", incarnation=1, signal=signal.SIGTERM)]


async def test_a_detached_platform_leaves_its_agents_running_when_it_closes(strays: list[int]) -> None:
    async with LocalPlatform() as platform:
        events = platform.events()
        await platform.launch(agent(SLEEP))
        started = await next_event(events)
        assert isinstance(started, NodeStarted) and started.pid is not None
        strays.append(started.pid)
        platform.detach()  # the master fails: the next one adopts the agent
    await anyio.sleep(0.2)  # what a kill on close would take
    assert is_alive(started.pid), "the agent was stopped"
    assert await remaining_events(events) == []  # no exit to report: it runs
    os.kill(started.pid, signal.SIGKILL)
    await wait_dead(started.pid)


@pytest.mark.parametrize(("command", "cwd", "message"), [
    ((), None, "command is empty"),
    (("stead-no-such-program",), None, "not found on PATH"),
    (("./no-such-file",), None, "not an executable file"),
    ((sys.executable, "-c", "pass"), "/nonexistent/stead/dir", "working directory"),
])
async def test_a_node_that_cannot_start_is_a_platform_error(command: tuple[str, ...], cwd: str | None,
                                                            message: str) -> None:
    async with LocalPlatform() as platform:
        spec = NodeSpec(job="j", node_id="n1", incarnation=1, command=command, cwd=cwd)
        with pytest.raises(PlatformError, match=message):
            await platform.launch(spec)


async def test_launch_outside_the_context_is_a_platform_error() -> None:
    platform = LocalPlatform()
    with pytest.raises(PlatformError, match="not running"):
        await platform.launch(agent(SLEEP))
    async with platform:
        pass
    with pytest.raises(PlatformError, match="not running"):
        await platform.launch(agent(SLEEP))
    with pytest.raises(PlatformError, match="already started"):
        await platform.__aenter__()


async def test_factory_builds_a_local_platform_and_rejects_options() -> None:
    assert platform_factory is create
    platform = await platform_factory(Settings(shutdown_grace_s=1.0))
    assert isinstance(platform, LocalPlatform) and platform.name == "local"
    with pytest.raises(ConfigError, match="takes no options"):
        await platform_factory(Settings(), namespace="x")


async def test_adopting_a_node_without_a_pid_reports_it_exited() -> None:
    async with LocalPlatform() as platform, contextlib.aclosing(platform.events()) as events:
        assert not await platform.adopt(agent(SLEEP, node="n1", incarnation=1), pid=None)
        assert await next_event(events) == NodeExited(node_id="n1", incarnation=1)


async def test_when_it_closes_it_runs_the_cleanup_command_of_each_node_whose_last_agent_was_killed(
        scratch: Path) -> None:
    def cleaned_by(node: str) -> tuple[str, ...]:
        write = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"
        return (sys.executable, "-c", write, str(scratch / node), node)

    async with LocalPlatform(Settings(shutdown_grace_s=10.0)) as platform:
        events = platform.events()
        for node, code in (("killed", SLEEP), ("relaunched", SLEEP), ("clean", "pass")):
            await platform.launch(agent(code, node=node, cleanup_command=cleaned_by(node)))
        await platform.launch(agent("pass", node="relaunched", incarnation=2, cleanup_command=cleaned_by("relaunched")))
        await platform.kill("killed", 1)
        await platform.kill("relaunched", 1)
        exits = {(e.node_id, e.incarnation) for e in [await next_event(events) for _ in range(8)]
                 if isinstance(e, NodeExited)}
        assert exits == {("killed", 1), ("relaunched", 1), ("relaunched", 2), ("clean", 1)}
    assert os.listdir(scratch) == ["killed"], "cleanup ran for the wrong nodes"


#: a stand-in for `stead agent --spare`: writes its pid, then the identity line it reads, and runs (as an agent would)
SPARE = ("import os, sys, time\n"
         "open(sys.argv[1] + f'/spare-{os.getpid()}', 'w').close()\n"
         "line = sys.stdin.readline()\n"
         "if not line: sys.exit(0)\n"
         "open(sys.argv[1] + f'/told-{os.getpid()}', 'w').write(line)\n"
         "time.sleep(300)\n")


def _spare_pids(scratch: Path) -> list[int]:
    return sorted(int(name[6:]) for name in os.listdir(scratch) if name.startswith("spare-"))


async def _spares(scratch: Path, count: int) -> list[int]:
    await until(lambda: len(_spare_pids(scratch)) >= count, f"{count} warm spare agent(s) started")
    return _spare_pids(scratch)


async def test_a_lost_node_s_replacement_is_the_warm_spare_told_its_node_and_a_new_spare_follows(
        scratch: Path) -> None:
    spare_command = (sys.executable, "-c", SPARE, str(scratch))
    settings = Settings(spare_agents=1, spare_delay_s=0.0, shutdown_grace_s=5.0)
    async with LocalPlatform(settings) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.launch(agent(SLEEP, node="n1", spare_command=spare_command))
        assert isinstance(await next_event(events), NodeStarted)
        [spare] = await _spares(scratch, 1)
        await platform.launch(agent(SLEEP, node="n1", incarnation=2, spare_command=spare_command))
        started = await next_event(events)
        assert started == NodeStarted(node_id="n1", incarnation=2, host="localhost", pid=spare)
        await wait_exists(scratch / f"told-{spare}")
        assert (scratch / f"told-{spare}").read_text() == '{"node_id": "n1", "incarnation": 2}\n'
        [_, second] = await _spares(scratch, 2)  # the next spare, for the next loss
        os.kill(second, signal.SIGKILL)  # a spare that died is not handed a node: the launch starts one cold
        await wait_dead(second)
        await platform.launch(agent(SLEEP, node="n1", incarnation=3, spare_command=spare_command))
        cold = await next_event(events)
        assert isinstance(cold, NodeStarted) and cold.pid not in (spare, second)
        assert not (scratch / f"told-{second}").exists()
        third = [p for p in await _spares(scratch, 3) if p not in (spare, second)]
    # closing took the spares down with the nodes (the suite's leak check sees any process left)
    for pid in (spare, *third):
        await wait_dead(pid)


async def test_a_host_waiting_as_a_spare_keeps_a_warm_agent_that_its_first_node_is_given(scratch: Path) -> None:
    spare_command = (sys.executable, "-c", SPARE, str(scratch))
    settings = Settings(spare_agents=1, spare_delay_s=600.0, shutdown_grace_s=5.0)  # (not waited for: no launch)
    async with LocalPlatform(settings) as platform, contextlib.aclosing(platform.events()) as events:
        await platform.keep_spares(agent(SLEEP, node="spare", incarnation=0, spare_command=spare_command))
        [spare] = await _spares(scratch, 1)
        await platform.keep_spares(agent(SLEEP, node="spare", incarnation=0, spare_command=spare_command))
        await anyio.sleep(0.5)
        assert _spare_pids(scratch) == [spare], "a second call started another spare past spare_agents"
        await platform.launch(agent(SLEEP, node="n1", incarnation=3, spare_command=spare_command))
        assert await next_event(events) == NodeStarted(node_id="n1", incarnation=3, host="localhost", pid=spare)
        await wait_exists(scratch / f"told-{spare}")
    await wait_dead(spare)


async def test_no_spare_is_started_when_spare_agents_is_0_or_the_node_has_no_spare_command(scratch: Path) -> None:
    spare_command = (sys.executable, "-c", SPARE, str(scratch))
    for settings, command in ((Settings(spare_agents=0, spare_delay_s=0.0), spare_command),
                              (Settings(spare_agents=1, spare_delay_s=0.0), ())):
        async with LocalPlatform(settings) as platform, contextlib.aclosing(platform.events()) as events:
            await platform.launch(agent(SLEEP, node="n1", spare_command=command))
            assert isinstance(await next_event(events), NodeStarted)
            await anyio.sleep(0.5)
    assert _spare_pids(scratch) == []


async def test_a_spare_that_became_a_node_s_agent_is_adopted_by_its_title(scratch: Path) -> None:
    # a later master adopts agents by pid; a spare's environment never named its node, its process title does
    code = ("import sys, time, setproctitle\n"
            "setproctitle.setproctitle(sys.argv[1])\n"
            "open(sys.argv[2], 'w').close()\n"
            "time.sleep(300)\n")
    ready = scratch / "titled"
    async with LocalPlatform() as launcher, contextlib.aclosing(launcher.events()) as launched:
        await launcher.launch(agent(code, agent_title("contract", "n1", 2), str(ready), node="other"))
        started = await next_event(launched)
        assert isinstance(started, NodeStarted) and started.pid is not None
        pid = started.pid
        await wait_exists(ready)
        async with LocalPlatform() as adopter, contextlib.aclosing(adopter.events()) as events:
            assert await adopter.adopt(agent(SLEEP, node="n1", incarnation=2), pid=pid)
            assert not await adopter.adopt(agent(SLEEP, node="n1", incarnation=3), pid=pid)  # not that one
            assert isinstance(await next_event(events), NodeExited)
