"""`stead master`, `stead events` and `stead status` against sqlite and a real etcd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from stead.core.events import JobStopped, JobSubmitted, WorkerFailed, WorkersStarted, WorkersSucceeded
from stead.core.events.log import EventLog
from stead.core.rpc import AgentReport, MasterClient, RegisterInfo, StartWorkersCmd, read_token_file
from stead.core.store import open_store
from stead.core.views.goodput import PARTS


@pytest.fixture(params=["sqlite", "etcd"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'cli.db'}"
    value: str = request.getfixturevalue("etcd_url")
    return value


def _stead(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stead", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


async def _seed(url: str, job: str) -> None:
    store = await open_store(url)
    try:
        await EventLog(store, job).append(JobSubmitted(job=job, min_nodes=1, max_nodes=1, nproc_per_node=1))
    finally:
        await store.close()


async def _play_agent(address: str, token: str) -> None:
    async with MasterClient(address, token, call_timeout_s=30) as client:  # a loaded CI machine: no flake
        await client.register(RegisterInfo(node_id="node-0", incarnation=1, host="h", pid=1, nproc=1))
        commands = client.commands("node-0", 1)
        with anyio.fail_after(20):
            start = await commands.__anext__()
        assert isinstance(start, StartWorkersCmd)
        for done in (WorkersStarted(node_id="node-0", round=start.round),
                     WorkersSucceeded(node_id="node-0", round=start.round)):
            await client.report_workers(AgentReport(incarnation=1, event=done))
        await commands.aclose()


def test_master_resumes_a_stored_job_and_events_and_status_show_it(tmp_path: Path, url: str) -> None:
    job = "cli-job"
    anyio.run(_seed, url, job)
    token_file = tmp_path / "job.token"
    master = subprocess.Popen(
        [sys.executable, "-m", "stead", "master", "--store", url, "--job", job, "--token-file", str(token_file),
         "--log-format", "json", "--set", "heartbeat_timeout_s=120",  # the played agent sends no heartbeat
         "--metrics-port", "0"],  # metrics only when asked for: on a free port of loopback
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert master.stdout is not None
        first = master.stdout.readline()
        assert "listening on 127.0.0.1:" in first, first + (master.stderr.read() if master.stderr else "")
        assert str(token_file) in master.stdout.readline()
        address = first.rsplit(" ", 1)[1].strip()
        anyio.run(_play_agent, address, read_token_file(token_file))
        out, err = master.communicate(timeout=60)
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()
    assert master.returncode == 0, err
    assert f"job {job!r} succeeded" in out
    events = _stead("events", "--store", url, "--job", job, cwd=tmp_path)
    assert events.returncode == 0, events.stderr
    lines = events.stdout.splitlines()
    assert "job.submitted" in lines[0] and "node.joined" in events.stdout and "job.succeeded" in lines[-2]
    assert "scaler.recommended" in lines[-1]  # what the job used, recorded at its end (nothing measured here)
    status = _stead("status", "--store", url, "--job", job, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "phase      succeeded" in status.stdout and "node-0" in status.stdout
    shown = json.loads(_stead("status", "--store", url, "--job", job, "--json", cwd=tmp_path).stdout)
    assert (shown["phase"], shown["round"], shown["restarts"]) == ("succeeded", 1, 0)
    assert shown["nodes"]["node-0"]["incarnation"] == 1 and shown["max_restarts"] == 3, shown
    assert (shown["master_pid"], shown["master_address"]) == (master.pid, address)  # the process to kill
    assert shown["master_metrics"].startswith("http://127.0.0.1:")  # asked for: loopback, a free port
    # the goodput ledger: no step was reported (the agent is played), so nothing counted as useful, and it says so
    assert shown["goodput"] == 0.0 and shown["useful_s"] == 0.0 and shown["ended"] is True
    assert sum(shown[f"{part}_s"] for part in PARTS) == pytest.approx(shown["wall_s"], abs=0.01)
    assert shown["missing"] == ["no step progress was recorded: no time can be counted as useful"]
    assert "goodput    0.0% of" in status.stdout and "(not counted: no step progress" in status.stdout
    as_json = _stead("events", "--store", url, "--job", job, "--json", cwd=tmp_path)
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [r["seq"] for r in records] == list(range(1, len(lines) + 1))
    assert records[0]["type"] == "job.submitted" and records[0]["data"]["job"] == job
    assert [r["type"] for r in records[-2:]] == ["job.succeeded", "scaler.recommended"]
    assert all(isinstance(r["at"], float) for r in records)
    followed = _stead("events", "--store", url, "--job", job, "--follow", cwd=tmp_path)  # ends with the job
    assert followed.returncode == 0 and followed.stdout.splitlines() == lines


def test_events_json_is_strict_json_even_for_a_stored_nan(tmp_path: Path) -> None:
    url, job = f"sqlite:///{tmp_path / 'nan.db'}", "nan-job"

    async def seed() -> None:  # an older master accepted exited_at = NaN and stored it
        store = await open_store(url)
        try:
            await EventLog(store, job).append(WorkerFailed(node_id="node-0", round=1, local_rank=0, rank=0,
                                                           exit_code=1, exited_at=float("nan")))
        finally:
            await store.close()

    anyio.run(seed)
    shown = _stead("events", "--store", url, "--job", job, "--json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr

    def not_json(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON: {shown.stdout}")

    (record,) = [json.loads(line, parse_constant=not_json) for line in shown.stdout.splitlines()]
    assert record["type"] == "worker.failed" and record["data"]["exited_at"] is None
    assert record["data"]["exit_code"] == 1


def test_read_only_commands_on_an_unknown_job_say_so_and_create_nothing(tmp_path: Path) -> None:
    for command in ("status", "events", "top", "report", "scale"):
        more = ("--nodes", "2") if command == "scale" else ()
        result = _stead(command, "--store", f"sqlite:///{tmp_path / 'x.db'}", "--job", "nope", *more, cwd=tmp_path)
        assert result.returncode == 2
        assert "no job 'nope' here" in result.stderr and "does not exist" in result.stderr
        assert "Traceback" not in result.stderr
        default = _stead(command, "--job", "nope", *more, cwd=tmp_path)
        assert default.returncode == 2 and ".stead/nope.db does not exist" in default.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_version_names_stead_torch_and_python(tmp_path: Path) -> None:
    result = _stead("--version", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.startswith("stead 0.") and "(torch 2." in result.stdout and "Python 3." in result.stdout


def test_a_bad_setting_is_a_clear_error(tmp_path: Path) -> None:
    result = _stead("events", "--job", "x", "--set", "nonsense=1", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown setting 'nonsense'" in result.stderr


def test_help_explains_the_commands(tmp_path: Path) -> None:
    result = _stead("--help", cwd=tmp_path)
    assert result.returncode == 0
    for command in ("run", "master", "agent", "events", "status", "top", "report", "scale"):
        assert command in result.stdout
    run_help = _stead("run", "--help", cwd=tmp_path)
    assert run_help.returncode == 0 and "--nproc-per-node" in run_help.stdout and "--max-restarts" in run_help.stdout


async def _seed_ended(url: str, job: str) -> None:
    store = await open_store(url)
    try:
        log = EventLog(store, job)
        await log.append(JobSubmitted(job=job, min_nodes=1, max_nodes=3, nproc_per_node=1))
        await log.append(JobStopped(reason="stopped by hand"))
    finally:
        await store.close()


def test_scale_refuses_a_finished_job_and_nodes_outside_min_max_saying_why(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ended.db'}"
    anyio.run(_seed_ended, url, "ended")
    finished = _stead("scale", "--store", url, "--job", "ended", "--nodes", "2", cwd=tmp_path)
    assert finished.returncode == 1 and "Traceback" not in finished.stderr
    assert "job 'ended' is stopped (stopped by hand); only a running job can be scaled" in finished.stderr
    missing = _stead("scale", "--store", url, "--job", "ended", cwd=tmp_path)
    assert missing.returncode == 2 and "--nodes" in missing.stderr
    anyio.run(_seed, url, "open")  # submitted, its range 1:1
    outside = _stead("scale", "--store", url, "--job", "open", "--nodes", "5", cwd=tmp_path)
    assert outside.returncode == 2 and "--nodes 5 is outside job 'open''s MIN:MAX 1:1" in outside.stderr


async def _scale_a_running_job(tmp_path: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """`stead scale` of a job whose master runs: with the token file where `stead run` writes it, with
    --token-file, with STEAD_JOB_TOKEN, with none, and with another job's token."""
    from stead.core.master import Master, MasterConfig
    from stead.core.rpc import new_token, write_token_file

    url = f"sqlite:///{tmp_path / 'grow.db'}"
    config = MasterConfig(job="grow", store_url=url, plugins=["scaler"], tcp_store=False,
                          token_file=str(tmp_path / ".stead" / "grow.token"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_token_file(elsewhere / "other.token", new_token())
    scale = ("scale", "--store", url, "--job", "grow", "--nodes")
    said = {}
    async with Master(config) as master:
        await master.submit_job(JobSubmitted(job="grow", min_nodes=1, max_nodes=3, nproc_per_node=1, start_nodes=1))
        said["default file"] = await anyio.to_thread.run_sync(lambda: _stead(*scale, "2", cwd=tmp_path))
        said["--token-file"] = await anyio.to_thread.run_sync(lambda: _stead(
            *scale, "3", "--token-file", str(config.token_file), cwd=elsewhere))
        said["env"] = await anyio.to_thread.run_sync(lambda: _stead(
            *scale, "1", cwd=elsewhere, env={"STEAD_JOB_TOKEN": master.token}))
        said["none"] = await anyio.to_thread.run_sync(lambda: _stead(*scale, "2", cwd=elsewhere))
        said["other"] = await anyio.to_thread.run_sync(lambda: _stead(
            *scale, "2", "--token-file", str(elsewhere / "other.token"), cwd=elsewhere))
    return said


def test_scale_takes_the_job_token_from_its_file_or_the_environment_and_says_where_it_looked(tmp_path: Path) -> None:
    said = anyio.run(_scale_a_running_job, tmp_path)
    for how, nodes, was in (("default file", 2, 1), ("--token-file", 3, 2), ("env", 1, 3)):
        assert said[how].returncode == 0, (how, said[how].stderr)
        assert f"job 'grow': target {nodes} nodes (was {was})" in said[how].stdout
    assert said["none"].returncode == 2
    assert ("no token for job 'grow': .stead/grow.token does not exist and STEAD_JOB_TOKEN is not set; run this "
            "where `stead run` ran") in said["none"].stderr
    assert said["other"].returncode == 2
    assert f"the token in token file {tmp_path}/elsewhere/other.token is not job 'grow''s" in said["other"].stderr
