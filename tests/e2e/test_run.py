"""Whole `stead run` jobs with real torch worker processes and injected faults."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

RunJob = Callable[..., Any]  # the run_job fixture of conftest.py

pytestmark = pytest.mark.e2e

#: a torchrun-style script: gloo process group, a tiny DDP model, a few steps
TRAIN = """
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import stead

FAULT = sys.argv[1] if len(sys.argv) > 1 else "none"
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    if step == 3 and rank == 1:
        if FAULT == "crash" and restart == 0:
            os._exit(17)
        if FAULT == "always":
            raise RuntimeError(f"boom in restart {restart}")
        if FAULT.startswith("kill-agent") and not os.path.exists("agent-killed"):
            open("agent-killed", "w").close()
            parent = lambda p: int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            argv = lambda p: open(f"/proc/{p}/cmdline", "rb").read().replace(b"\\0", b" ")
            pid = os.getpid()
            while pid > 1:
                pid = parent(pid)
                if b"stead agent" in argv(pid):
                    # kill-agent-spare: once the master (the agent's parent) keeps a spare agent
                    while FAULT == "kill-agent-spare" and not any(
                            p.isdigit() and parent(p) == parent(pid) and b"--spare" in argv(p)
                            for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/stat")):
                        time.sleep(0.1)
                    os.kill(pid, 9)
                    time.sleep(60)
    if FAULT == "name-error" and step == 0:
        undefined_name_here
    loss = model(torch.ones(4, 8)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    stead.report_step(step)
    time.sleep(0.05)
if rank == 0:
    print(f"finished world={dist.get_world_size()} restart={restart}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.extended("a crashed worker restarted and its job completing: the same crash decided by the default "
                      "policy below, the chaos quick schedule's worker crashes, the README recipes (test_recipes.py)")
def test_a_crashed_worker_is_restarted_and_the_job_completes(run_job: RunJob) -> None:
    job = run_job(TRAIN, "crash", flags=("--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "2"))
    assert job.returncode == 0, job.stderr[-3000:]
    assert "finished world=4 restart=1" in job.stdout
    events = job.events("e2e")
    assert "worker.failed" in events and "exit_code=17" in events, events
    assert "recovery.decided" in events and "action=restart" in events
    assert "round=2" in events and "job.succeeded" in events


def test_with_the_diagnosis_plugin_disabled_the_default_policy_decides_and_the_job_recovers(run_job: RunJob) -> None:
    job = run_job(TRAIN, "crash", flags=("--nproc-per-node", "2", "--max-restarts", "2", "--no-plugin", "diagnosis"))
    assert job.returncode == 0, job.stderr[-3000:]
    assert "finished world=2 restart=1" in job.stdout
    events = job.events("e2e")
    assert "plugins.started" in events and "deciders=" not in events
    assert "recovery.decided" in events and "decided_by=default" in events
    assert "no diagnosis plugin is running" in events and "job.succeeded" in events


def test_an_exhausted_restart_budget_fails_the_job_with_the_workers_error(run_job: RunJob) -> None:
    job = run_job(TRAIN, "always", flags=("--nproc-per-node", "2", "--max-restarts", "1"))
    assert job.returncode == 1
    assert "max restarts exhausted (1)" in job.stderr
    assert "RuntimeError: boom in restart 1" in job.stderr
    assert job.stderr.count("job.failed") == 0  # the user sees a summary, not an event dump
    assert "job e2e failed" in job.stderr


def test_a_user_code_error_fails_fast_without_restarting(run_job: RunJob) -> None:
    job = run_job(TRAIN, "name-error", flags=("--nproc-per-node", "2", "--max-restarts", "3"))
    assert job.returncode == 1
    assert "NameError" in job.stderr and "undefined_name_here" in job.stderr
    events = job.events("e2e")
    assert "round=2" not in events
    assert "action=fail" in events


@pytest.mark.parametrize("spare", [
    pytest.param(False, id="cold", marks=pytest.mark.extended(
        "a killed agent relaunched cold: the chaos quick schedule's kill-agent fault (its jobs keep no spare)")),
    pytest.param(True, id="from-a-spare")])
@pytest.mark.long(22)
def test_a_sigkilled_agent_is_replaced_and_the_job_completes(run_job: RunJob, spare: bool) -> None:
    settings = ("--set", "spare_agents=1", "--set", "spare_delay_s=1") if spare else ("--set", "spare_agents=0")
    job = run_job(TRAIN, "kill-agent-spare" if spare else "kill-agent",
                  flags=("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3", *settings))
    assert job.returncode == 0, job.stderr[-3000:]
    events = job.events("e2e")
    assert "node.exited" in events and "signal=9" in events
    assert "node.requested       node_id=node-1 incarnation=2" in events
    assert "job.succeeded" in events
    used = [json.loads(line) for line in job.stderr.splitlines() if '"spare_agent_used"' in line]
    if not spare:
        assert used == [] and '"spare_agent_started"' not in job.stderr
        return
    # the replacement is the spare the master kept: warm, told its node on stdin, adopted under its pid
    [handed] = [u for u in used if u["incarnation"] == 2]
    assert (handed["node"], handed["incarnation"]) == ("node-1", 2)
    [started] = [r for r in job.records("e2e", "node.started") if r["incarnation"] == 2]
    assert started["pid"] == handed["pid"]
    assert '"spare_agent_assigned"' in job.stderr and '"zygote_exec"' not in job.stderr.split('"spare_agent_used"')[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py"], "missing.py"),
        (["--no-such-flag", "train.py"], "unrecognized arguments"),
        (["--nnodes", "3:2", "train.py"], "MIN"),
        (["--nproc-per-node", "0", "train.py"], "nproc"),
        (["--store", "etcd://127.0.0.1:1", "train.py"], "etcd://127.0.0.1:1 is unreachable (tried for 5 s"),
        (["--platform", "k8s", "train.py"], "--platform k8s needs the container image its pods run"),
        (["--platform", "k8s", "--set", "k8s.image=img", "train.py"], "needs a store that every master pod reaches"),
        (["--plugins", "ckpt,nope", "train.py"], "'nope' not installed"),
        (["--set", "ckpt.nope=1", "train.py"], "settings of the ckpt plugin: ckpt.dir="),
        (["--set", "heartbeat_timeout_s=inf", "train.py"], "must be a finite number of seconds"),
    ],
)
def test_bad_input_is_one_clear_line_and_a_non_zero_exit(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "train.py").write_text("print('never run')\n")
    proc = subprocess.run([sys.executable, "-m", "stead", "run", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors and message.lower() in errors[-1].lower(), proc.stderr
    assert "Traceback" not in proc.stderr
    assert "never run" not in proc.stdout


def test_the_readme_embedding_example_runs(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "embed.py"
    proc = subprocess.run([sys.executable, str(example)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "job running: round 1 with node-0" in proc.stdout
    assert "job succeeded" in proc.stdout


def test_sigint_stops_the_job_cleanly(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import time, stead\nfor step in range(100000):\n    stead.report_step(step)\n    time.sleep(0.05)\n"
    )
    proc = subprocess.Popen([sys.executable, "-m", "stead", "run", "--job-name", "sig", "--nproc-per-node", "2",
                             "--log-format", "json", "train.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = 120.0
        while deadline > 0:  # wait until the workers run (the job has a round)
            status = subprocess.run([sys.executable, "-m", "stead", "status", "--job", "sig"], cwd=tmp_path,
                                    capture_output=True, text=True, timeout=60)
            if "phase      running" in status.stdout:
                break
            time.sleep(0.5)
            deadline -= 0.5
        proc.send_signal(2)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "stopped by SIGINT" in err
    events = subprocess.run([sys.executable, "-m", "stead", "events", "--job", "sig"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60).stdout
    assert "job.stopped" in events and "reason='stopped by SIGINT'" in events
