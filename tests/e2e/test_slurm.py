"""`stead run train.py` in a batch script, and under `srun`, against a real Slurm cluster (tests.support.slurm).

As Slurm users run it: one folder on a filesystem every node shares (the job's working directory), the job token
in the environment srun passes on, no multi-node flag.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from stead.core.events import decode_record
from stead.core.views.warnings import warning_lines
from tests.support.readme import readme_files
from tests.support.slurm import slurm_cluster

pytestmark = [pytest.mark.anyio, pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"


async def _events(folder: Path, job: str, *, before_start: bool = False) -> str:
    """``stead events --json`` of ``job``; with ``before_start``, "" while its master has recorded nothing yet."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stead", "events", "--job", job, "--json", cwd=folder,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    if before_start and process.returncode == 1 and f"no events for job '{job}'" in err.decode():
        return ""
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_srun_with_two_tasks_on_a_node_is_refused_saying_why(tmp_path: Path) -> None:
    async with slurm_cluster(1, workdir=tmp_path) as cluster:
        rc, _, err = await cluster.srun(["-N1", "-n2", sys.executable, "-m", "stead", "run", str(TRAIN)],
                                        env={**os.environ}, cwd=tmp_path)
    assert rc != 0
    assert "srun started 2 tasks on 1 node(s)" in err and "use srun --ntasks-per-node 1" in err, err[-2000:]


@pytest.mark.long(40)
async def test_the_readme_sbatch_script_trains_one_job_is_warned_cancelled_and_resumes_when_submitted_again(
        tmp_path: Path) -> None:
    """The README's batch script: no srun, no multi-node flag, the Slurm platform's job of three nodes, each a step of
    its own, served by the batch host. Slurm's warning before a time limit (``--signal=USR1@SECONDS``; here sent at
    once with ``scancel --signal=USR1``) reaches every process of the steps: the agents persist the newest committed
    step and training goes on, nothing restarted, each host step logs the time Slurm leaves the job (submitted
    with a time limit of 10 minutes) and the master records each node's report of the warning (``job.warned``).
    ``scancel`` then stops the job with its newest step persisted, its master recording why (Slurm's controller
    asked), and the script submitted again (the same job name) resumes from it.
    (A crash's recovery across hosts is tests/e2e/test_hosts_jobs.py's.)"""
    (tmp_path / "train.sbatch").write_text(readme_files()["train.sbatch"])
    shutil.copy(TRAIN, tmp_path / "train.py")
    # as on a cluster: `stead` and python3 on PATH (the environment's); no GLOO_SOCKET_IFNAME: stead picks it
    env = _cluster_env()

    async def stepped(beyond: int) -> bool:
        return any(int(str(p["step"])) > beyond for p in await _recorded(tmp_path, "progress.step"))

    # KillWait 10 s, not the cluster's 1 s: the master asks Slurm why and records it before Slurm's SIGKILL, also
    # on a loaded machine (a stead that stops in time costs nothing of it)
    async with slurm_cluster(3, workdir=tmp_path, kill_wait_s=10) as cluster:
        first = await cluster.sbatch(tmp_path / "train.sbatch", "--time=10", env=env, cwd=tmp_path)
        await _until("step 10", lambda: stepped(10))
        await cluster.scancel(first, "--signal=USR1")
        out = tmp_path / f"slurm-{first}.out"
        await _until("every agent's warned persist", lambda: _async(len(_warned_persists(out)) == 3))
        warned = max(_warned_persists(out))
        # one step, the one the master named to the first warned node: whole on disk (each node its newest commit
        # wrote different steps when a commit came between the nodes' signals, none of them whole)
        assert len(set(_warned_persists(out))) == 1, _warned_persists(out)

        async def went_on_and_recorded() -> bool:  # (the nodes' reports come while the job steps on)
            return await stepped(warned + 5) and len(await _recorded(tmp_path, "job.warned")) == 3

        await _until("steps after the warning, every node's warning recorded", went_on_and_recorded)
        await cluster.scancel(first)
        assert await cluster.wait_job(first, timeout_s=60) == "CANCELLED"
        again = await cluster.sbatch(tmp_path / "train.sbatch", env=env, cwd=tmp_path)
        state = await cluster.wait_job(again, timeout_s=120)
        log = out.read_text(errors="replace")  # read late: a cancelled job's last lines come after its state
        events = [json.loads(line) for line in (await _events(tmp_path, "train")).splitlines() if line]
    assert log.count("serves its master") == 1, log[-4000:]  # the batch host, h1, and only it
    assert log.count("agent_warned") == 3, log[-4000:]  # every node's agent
    left = [int(n) for n in re.findall(r"Slurm warned: time limit in ~(\d+) s", log)]
    assert len(left) == 3 and all(0 < n <= 600 for n in left), log[-4000:]  # every host step, from --time=10
    # why the job stopped, as Slurm's controller said while it cancelled the job: recorded, and printed at the end
    stopped = [e["data"] for e in events if e["type"] == "job.stopped"]
    assert stopped == [{"reason": "stopped by SIGTERM: cancelled by scancel (CANCELLED)",
                        "cause": "cancelled by scancel (CANCELLED)"}], stopped
    assert "job train stopped: stopped by SIGTERM: cancelled by scancel (CANCELLED)" in log, log[-4000:]
    resumed = (tmp_path / f"slurm-{again}.out").read_text(errors="replace")
    assert state == "COMPLETED", resumed[-4000:]
    found = re.search(r"rank 0 resumed from step (\d+)", resumed)
    assert found is not None and int(found.group(1)) > warned, resumed[-4000:]  # the cancel persisted a newer step
    assert "rank 0 done: 100 steps" in resumed, resumed[-4000:]
    assert "job train succeeded" in resumed, resumed[-4000:]
    assert {e["data"]["host"] for e in events if e["type"] == "node.started"} == {"h1", "h2", "h3"}
    # the master recorded the warning, a report of each node, with the time Slurm left and the step committed then
    reports = [e["data"] for e in events if e["type"] == "job.warned"]
    assert sorted(r["node_id"] for r in reports) == ["node-0", "node-1", "node-2"], reports
    assert all(r["source"] == "slurm" and r["signal"] == "SIGUSR1" and 0 < r["time_left_s"] <= 600
               and r["committed_step"] is not None and r["persisted_step"] == warned for r in reports), reports
    [line] = warning_lines([decode_record(json.dumps(e).encode(), where="stead events") for e in events])
    assert re.fullmatch(r"by Slurm at \S+: \d+ s left \(time limit at \S+\); warned on 3 of 3 nodes; "
                        rf"step {warned} persisted at \S+", line), line  # what stead status shows
    # one round each: the warning restarted nothing (the workers ignored it)
    assert [len(e["data"]["members"]) for e in events if e["type"] == "round.started"] == [3, 3]


@pytest.mark.long(60)
async def test_the_slurm_platform_keeps_a_faulty_node_out_and_a_killed_host_costs_a_node_not_the_slurm_job(
        tmp_path: Path) -> None:
    """`stead run --nnodes 2:3` in a batch script of four nodes: every node a host step, one a spare. node-1's
    first agent fails its health check: its host is excluded, its step stopped, and node-1 goes to the spare. A
    compute host running a node is then killed: its node is lost at once (Slurm says it is down), no spare is
    left, the job goes on with two nodes, and the Slurm job completes (its allocation kept: ``--no-kill``)."""
    shutil.copy(TRAIN, tmp_path / "train.py")
    (tmp_path / "plat.sbatch").write_text(
        "#!/bin/bash\n#SBATCH --no-kill\nstead run --nnodes 2:3 --job-name plat --set health_check=all "
        "train.py --steps 200 --step-time 0.05 --save-every 1\n")
    env = {**_cluster_env(), "STEAD_FAULT_HEALTH": "node-1:1:slow"}  # node-1's first agent: 4x the work

    async def hosts_of(after: int = 0) -> dict[str, str]:
        return {str(e["node_id"]): str(e["host"]) for e in await _recorded(tmp_path, "node.started", "plat")
                if int(str(e["incarnation"])) > after}

    async def stepped(beyond: int) -> bool:
        return any(int(str(p["step"])) > beyond for p in await _recorded(tmp_path, "progress.step", "plat"))

    async with slurm_cluster(4, workdir=tmp_path) as cluster:
        job = await cluster.sbatch(tmp_path / "plat.sbatch", "--nodes=4", env=env, cwd=tmp_path)
        await _until("node-1 on the spare", lambda: _async_dict(hosts_of(1)), timeout_s=180)
        await _until("steps after the check", lambda: stepped(20))
        placed = await hosts_of()
        excluded = _excluded(tmp_path, job)
        victim = next(host for node, host in sorted(placed.items()) if host != "h1")
        await cluster.kill_node(int(victim[1:]) - 1)
        state = await cluster.wait_job(job, timeout_s=180)
        started = await _recorded(tmp_path, "node.started", "plat")
        exited = await _recorded(tmp_path, "node.exited", "plat")
        rounds = await _recorded(tmp_path, "round.started", "plat")
    log = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert state == "COMPLETED", log[-4000:]
    assert "job plat succeeded" in log, log[-4000:]
    assert f"the job excluded host {excluded} as faulty" in log, log[-4000:]
    assert excluded not in {str(e["host"]) for e in started if int(str(e["incarnation"])) > 1}
    assert [e for e in started if e["node_id"] == "node-1" and e["incarnation"] == 2]
    lost = [str(e["reason"]) for e in exited if str(e.get("reason", "")).startswith("NodeLost")]
    # lost at once: Slurm said the node is down, or (whichever came first) its host hung up on the master
    assert any(f"node {victim} is down" in r or f"host {victim} " in r for r in lost), exited
    members = rounds[-1]["members"]
    assert isinstance(members, list) and len(members) == 2, rounds  # no spare left: the job went on with two nodes


def _excluded(folder: Path, job: int) -> str:
    """The host the Slurm platform gave up as the job excluded it (its log line in the batch output)."""
    for line in (folder / f"slurm-{job}.out").read_text(errors="replace").splitlines():
        if "slurm_node_given_up" in line and "excluded host" in line:
            return line.split("node=")[1].split()[0]
    raise AssertionError("no host was excluded")


async def _async_dict(found: Awaitable[dict[str, str]]) -> bool:
    return bool(await found)


def _cluster_env() -> dict[str, str]:
    """As on a cluster: `stead` and python3 on PATH (the environment's); no GLOO_SOCKET_IFNAME (stead picks it), no
    job token (stead makes one and keeps it for the job's next submission)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "STEAD_JOB_TOKEN")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
    return env


async def _recorded(folder: Path, kind: str, job: str = "train") -> list[dict[str, object]]:
    if not (folder / ".stead" / f"{job}.db").exists():
        return []  # the job's master has not started yet
    lines = (await _events(folder, job, before_start=True)).splitlines()  # (or started, nothing recorded yet)
    return [e["data"] for e in map(json.loads, filter(None, lines)) if e["type"] == kind]


def _warned_persists(out: Path) -> list[int]:
    """The step each agent persisted on the warning (one line per rank; the ranks' steps may differ by the moments
    the signal reached each node)."""
    lines = out.read_text(errors="replace").splitlines() if out.exists() else []
    return [int(line.split("step=")[1].split()[0]) for line in lines
            if "ckpt_persisted_rank" in line and "SIGUSR1" in line]


async def _async(value: bool) -> bool:
    return value


async def _until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 120) -> None:
    with anyio.move_on_after(timeout_s):
        while not await check():  # noqa: ASYNC110 (another process writes the log)
            await anyio.sleep(0.3)
        return
    raise AssertionError(f"no {what} within {timeout_s:g} s")
