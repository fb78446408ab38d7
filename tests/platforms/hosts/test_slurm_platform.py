"""The Slurm platform's own part, without a cluster: its host steps and Slurm's node states come from small shell
commands standing in for ``srun`` and ``sinfo`` (the platform runs whatever it is given); the hosts offer themselves
here, as in test_hosts_platform. Against a real Slurm cluster: tests/e2e/test_slurm.py."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from stead.cli.run_args import parse_run_args
from stead.core.errors import ConfigError
from stead.core.events import NodeExited
from stead.core.platform import HOST_ENV, NodeSpec
from stead.platforms.hosts import HostsPlatform
from stead.platforms.hosts import slurm as slurm_module
from stead.platforms.hosts.slurm import SlurmPlatform, node_states, step_command
from stead.testing.platforms import RecordingPlatform
from tests.platforms.hosts.test_hosts_platform import SHAPE, launched, offer, spec

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _quick_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_module, "STEP_END_WAIT_S", 0.1)  # the stand-in steps never hear that the job ended

NODES = ("h1", "h2", "h3")


class FakeSlurm:
    """``srun`` and ``sinfo`` as shell commands: each node's step runs ``steps[node]`` (a shell line; its stderr is
    what srun would say), ``sinfo`` prints ``states``; every command line is kept."""

    def __init__(self, steps: Mapping[str, str], states: Mapping[str, str]) -> None:
        self.steps = dict(steps)
        self.states = dict(states)
        self.commands: list[list[str]] = []
        #: sinfo fails as it does while slurmctld does not answer
        self.unreachable = False
        self.envs: list[Mapping[str, str]] = []

    async def spawn(self, *command: str, **kwargs: Any) -> asyncio.subprocess.Process:
        self.commands.append(list(command))
        self.envs.append(dict(kwargs.get("env") or {}))
        if command[0] == "sinfo" and self.unreachable:
            line = "echo 'sinfo: error: Unable to contact slurm controller (connect failure)' >&2; exit 1"
        elif command[0] == "sinfo":
            lines = "".join(f"{node}|{state}\n" for node, state in self.states.items())
            line = f"printf %s {shlex.quote(lines)}"
        else:
            node = next(a.split("=", 1)[1] for a in command if a.startswith("--nodelist="))
            line = self.steps.get(node, "exec sleep 30")
        return await asyncio.create_subprocess_exec("sh", "-c", line, **kwargs)

    def started(self, node: str) -> int:
        return sum(1 for c in self.commands if f"--nodelist={node}" in c)


def named(launcher: str, name: str) -> Any:
    """A host's offer under its Slurm node's name."""
    made = offer(launcher)
    made.host = name
    return made


def slurm_platform(fake: FakeSlurm, *, takeover: bool = False) -> tuple[SlurmPlatform, HostsPlatform]:
    hosts = HostsPlatform(local=RecordingPlatform(), shape=SHAPE, local_rank=None, static=False, host_name="h1",
                          keepalive_s=0.2, pending_after_s=60.0, ended_wait_s=0.0, nodes_here=False)
    platform = SlurmPlatform(hosts, job_id="42", nodes=NODES, argv=["stead", "run", "train.py"],
                             env={"PET_NNODES": "2:3"}, cpus=(4, 4, 2), srun="srun", sinfo="sinfo", poll_s=0.1,
                             spawn=fake.spawn, takeover=takeover)
    return platform, hosts


async def _until(check: Any, looks: int = 400) -> None:
    for _ in range(looks):  # a bound on looks, not a duration asserted
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the platform did not get there")


def test_a_host_step_is_one_task_on_its_node_sharing_it_with_the_job_s_other_steps() -> None:
    assert step_command(srun="srun", job_id="7", node="gpu03", cpus=16, argv=["python", "-m", "stead", "run"]) == [
        "srun", "--jobid=7", "--nodes=1", "--ntasks=1", "--nodelist=gpu03", "--overlap", "--kill-on-bad-exit=0",
        "--job-name=stead-host-gpu03", "--cpus-per-task=16", "python", "-m", "stead", "run"]
    assert "--cpus-per-task" not in " ".join(step_command(srun="srun", job_id="7", node="n", cpus=None, argv=[]))


def test_sinfo_lines_give_each_node_its_base_state_and_reason() -> None:
    assert node_states("h1|allocated|none\nh2|down*|killed by the test\n\nh3|drained|bad gpu\nh4|mixed~|\n") == {
        "h1": ("allocated", "none"), "h2": ("down", "killed by the test"), "h3": ("drained", "bad gpu"),
        "h4": ("mixed", "")}


async def test_every_node_gets_a_host_step_named_after_its_slurm_node_with_the_job_s_flags() -> None:
    fake = FakeSlurm({}, {n: "allocated" for n in NODES})
    platform, _ = slurm_platform(fake)
    async with platform:
        await _until(lambda: all(fake.started(n) == 1 for n in NODES))
    srun_envs = [env for command, env in zip(fake.commands, fake.envs, strict=True) if command[0] == "srun"]
    assert sorted(env[HOST_ENV] for env in srun_envs) == list(NODES)
    assert all(env["PET_NNODES"] == "2:3" for env in srun_envs)
    assert any("--cpus-per-task=2" in c and "--nodelist=h3" in c for c in fake.commands)


async def test_a_node_slurm_says_is_down_is_lost_at_once_and_never_given_a_step_again() -> None:
    fake = FakeSlurm({}, {n: "allocated" for n in NODES})
    platform, hosts = slurm_platform(fake)
    async with platform:
        await _until(lambda: all(fake.started(n) == 1 for n in NODES))
        for launcher, name in (("a", "h1"), ("b", "h2")):
            host, why = hosts.offer(named(launcher, name))
            assert host is not None, why
        await hosts.launch(spec("node-0"))
        await hosts.launch(spec("node-1"))
        assert launched(hosts, "a") + launched(hosts, "b") == [("node-0", 1), ("node-1", 1)]
        fake.states["h2"] = "down*"  # its host died: Slurm marks it down (its srun would say "Node failure")
        await _until(lambda: "h2" in hosts.barred)
        event = await asyncio.wait_for(anext(platform.events()), 5)
        await asyncio.sleep(0.3)
        assert fake.started("h2") == 1  # never again
    assert hosts.barred["h2"] == "Slurm says node h2 is down"
    assert isinstance(event, NodeExited) and event.reason == "NodeLost: Slurm says node h2 is down"
    assert (event.node_id, event.incarnation) == ("node-1", 1)


async def test_a_step_that_ends_on_a_healthy_node_is_started_again_and_given_up_after_its_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_module, "RESTART_PAUSE_S", 0.01)
    fake = FakeSlurm({"h3": "echo 'srun: error: task 0: Exited with exit code 1' >&2; exit 1"},
                     {n: "allocated" for n in NODES})
    platform, hosts = slurm_platform(fake)
    async with platform:
        await _until(lambda: "h3" in hosts.barred)
    assert fake.started("h3") == slurm_module.STEP_STARTS
    assert f"started {slurm_module.STEP_STARTS} times" in hosts.barred["h3"]
    assert "Exited with exit code 1" in hosts.barred["h3"]
    assert fake.started("h1") == 1 and "h1" not in hosts.barred


async def test_while_slurm_s_controller_does_not_answer_a_node_s_step_is_tried_again_without_giving_it_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_module, "RESTART_PAUSE_S", 0.01)
    monkeypatch.setattr(slurm_module, "MAX_RESTART_PAUSE_S", 0.02)
    fake = FakeSlurm({"h3": "echo 'srun: error: Unable to contact slurm controller (connect failure)' >&2; exit 1"},
                     {n: "allocated" for n in NODES})
    fake.unreachable = True
    platform, hosts = slurm_platform(fake)
    async with platform:
        await _until(lambda: fake.started("h3") > 2 * slurm_module.STEP_STARTS)
        assert "h3" not in hosts.barred  # the controller's silence is not the node's failure
        fake.unreachable = False  # it answers again: the node's own failures count from here
        await _until(lambda: "h3" in hosts.barred)
    assert "Unable to contact slurm controller" in hosts.barred["h3"]
    assert fake.started("h1") == 1 and "h1" not in hosts.barred  # the running steps kept going


async def test_a_host_the_job_excludes_as_faulty_has_its_step_stopped_and_gets_no_node() -> None:
    fake = FakeSlurm({}, {n: "allocated" for n in NODES})
    platform, hosts = slurm_platform(fake)
    async with platform:
        await _until(lambda: all(fake.started(n) == 1 for n in NODES))
        host, _ = hosts.offer(named("c", "h3"))
        assert host is not None
        await platform.launch(NodeSpec(job="j", node_id="node-2", incarnation=2, command=("agent",),
                                       avoid_hosts=("h3",)))
        assert launched(hosts, "c") == []  # waits for another host
        await _until(lambda: "h3" in hosts.barred)
        await asyncio.sleep(0.3)
        assert fake.started("h3") == 1
    assert hosts.barred["h3"] == "the job excluded host h3 as faulty"


async def test_a_master_taking_over_starts_no_step_where_the_host_came_back_to_it() -> None:
    fake = FakeSlurm({}, {n: "allocated" for n in NODES})
    platform, hosts = slurm_platform(fake, takeover=True)
    async with platform:
        for launcher, name in (("a", "h1"), ("b", "h2")):
            host, _ = hosts.offer(named(launcher, name))
            assert host is not None
        await _until(lambda: fake.started("h3") == 1)
        await asyncio.sleep(0.3)
    assert (fake.started("h1"), fake.started("h2")) == (0, 0)


ALLOCATION = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "h[1-3]", "SLURMD_NODENAME": "h1"}
IN_STEP = {**ALLOCATION, "SLURM_STEP_NODELIST": "h[1-3]", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "3",
           "SLURM_PROCID": "0"}


@pytest.mark.parametrize(("environ", "argv", "said"), [
    ({}, ("--platform", "slurm", "train.py"), "run `stead run` in an sbatch script or an salloc shell"),
    (IN_STEP, ("--platform", "slurm", "train.py"), "without srun"),
    (ALLOCATION, ("--platform", "slurm", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h1:1234", "train.py"),
     "drop --rdzv-backend"),
    (ALLOCATION, ("--nnodes", "5", "train.py"), "--nnodes asks for at least 5 nodes but the Slurm job holds 3"),
])
def test_a_slurm_platform_that_cannot_run_says_why(tmp_path: Path, environ: dict[str, str],
                                                    argv: tuple[str, ...], said: str) -> None:
    (tmp_path / "train.py").write_text("")
    with pytest.raises(ConfigError) as raised:
        parse_run_args(argv, environ=environ, cwd=str(tmp_path))
    assert said in str(raised.value)


def test_in_an_allocation_of_several_nodes_stead_run_is_the_slurm_platform_on_them_all(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    environ = {"SLURM_JOB_ID": "1234567", "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURMD_NODENAME": "gpu01",
               "SLURM_JOB_CPUS_PER_NODE": "8(x4)"}
    config = parse_run_args(["--nnodes", "3", "train.py"], environ=environ, cwd=str(tmp_path))
    assert (config.platform, config.min_nodes, config.max_nodes) == ("slurm", 3, 3)
    assert (config.hosts_endpoint, config.rdzv_backend, config.rdzv_id) == ("gpu01:19567", "c10d", "slurm-1234567")
    assert config.argv == ("--nnodes", "3", "train.py")
    every = parse_run_args(["train.py"], environ=environ, cwd=str(tmp_path))
    assert (every.min_nodes, every.max_nodes, every.platform) == (4, 4, "slurm")
    # one node: as on one machine; multi-node flags: torchrun's meaning; a host step: one host of its master's job
    one = parse_run_args(["train.py"], environ={**environ, "SLURM_JOB_NODELIST": "gpu01"}, cwd=str(tmp_path))
    assert (one.platform, one.hosts_endpoint) == ("local", "")
    flagged = parse_run_args(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu02:29400",
                              "train.py"], environ=environ, cwd=str(tmp_path))
    assert flagged.platform == "hosts"
    step = parse_run_args(["--platform", "slurm", "train.py"], cwd=str(tmp_path), environ={
        "SLURM_JOB_ID": "1234567", "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_STEP_NODELIST": "gpu03",
        "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0",
        "STEAD_SLURM_HOST_STEP": "1234567", "PET_NNODES": "3:3", "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "gpu01:19567", "PET_RDZV_ID": "slurm-1234567"})
    assert (step.platform, step.hosts_endpoint, step.job_name) == ("hosts", "gpu01:19567", "slurm-1234567")
