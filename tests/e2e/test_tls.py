"""A whole `stead run` job with mutual TLS on every RPC, from the certificates `stead certs` makes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stead.cli.certs import make_certs
from tests.e2e.test_run import TRAIN as FAULTY_TRAIN

RunJob = Callable[..., Any]  # the run_job fixture of conftest.py

pytestmark = pytest.mark.e2e

#: 2 nodes x 1 process: DDP over gloo, a sharded sampler (each worker leases its shards from the master over RPC)
TRAIN = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
import stead
from stead.data import ShardedSampler

dist.init_process_group("gloo")
sampler = ShardedSampler("ids", size=24, shard_size=4, seed=1, epochs=1)
model = DistributedDataParallel(torch.nn.Linear(1, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
seen, step = [], 0
for batch in DataLoader(list(range(24)), batch_size=2, sampler=sampler):
    seen += batch.tolist()
    loss = model(batch.float().reshape(-1, 1)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    step += 1
    stead.report_step(step)
every = [None] * dist.get_world_size()
dist.all_gather_object(every, seen)
if dist.get_rank() == 0:
    print(f"finished world={dist.get_world_size()} ids={sorted(i for ids in every for i in ids)}", flush=True)
dist.destroy_process_group()
"""


def _tls_flags(pki: Path) -> tuple[str, ...]:
    settings = make_certs(job="e2e", directory=pki, hosts=["127.0.0.1", "localhost"])
    return tuple(word for name, path in settings.items() for word in ("--set", f"{name}={path}"))


def test_a_job_runs_with_mutual_tls_on_every_rpc(run_job: RunJob, tmp_path: Path) -> None:
    flags = ("--nnodes", "2", "--nproc-per-node", "1", *_tls_flags(tmp_path / "pki"))
    job = run_job(TRAIN, flags=flags)
    assert job.returncode == 0, job.stderr[-3000:]
    assert f"finished world=2 ids={list(range(24))}" in job.stdout
    started = [json.loads(line) for line in job.stderr.splitlines() if '"rpc_server_started"' in line]
    assert started and all(record["tls"] is True for record in started), started
    assert '"rpc_tls_refused"' not in job.stderr
    assert "job.succeeded" in job.events("e2e")


@pytest.mark.extended("every RPC over mutual TLS: the test above; a spare agent taking a killed node's place: "
                      "tests/e2e/test_run.py's from-a-spare variant (the same RPCs, without TLS)")
def test_a_spare_agent_replaces_a_killed_node_over_tls(run_job: RunJob, tmp_path: Path) -> None:
    flags = ("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3", "--set", "spare_agents=1",
             "--set", "spare_delay_s=1", *_tls_flags(tmp_path / "pki"))
    job = run_job(FAULTY_TRAIN, "kill-agent-spare", flags=flags)
    assert job.returncode == 0, job.stderr[-3000:]
    used = [json.loads(line) for line in job.stderr.splitlines() if '"spare_agent_used"' in line]
    assert [(u["node"], u["incarnation"]) for u in used if u["incarnation"] == 2] == [("node-1", 2)]
    assert "job.succeeded" in job.events("e2e")
    assert '"rpc_tls_refused"' not in job.stderr


@pytest.mark.parametrize(("broken", "message"), [
    ("tls_key_file", "only tls_ca_file and tls_cert_file are set: set tls_key_file too"),
    ("tls_cert_file=missing.pem", "setting tls_cert_file='missing.pem': cannot read the file"),
    ("tls_ca_file=train.py", "setting tls_ca_file='train.py': the file holds no PEM certificate"),
])
def test_bad_tls_settings_fail_stead_run_before_anything_starts(tmp_path: Path, broken: str, message: str) -> None:
    (tmp_path / "train.py").write_text("print('never run')\n")
    flags = dict(pair.split("=", 1) for pair in _tls_flags(tmp_path / "pki")[1::2])
    name, _, value = broken.partition("=")
    if value:
        flags[name] = value
    else:
        del flags[name]
    sets = [word for name, path in flags.items() for word in ("--set", f"{name}={path}")]
    proc = subprocess.run([sys.executable, "-m", "stead", "run", *sets, "train.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr.splitlines()[-1], proc.stderr
    assert "Traceback" not in proc.stderr and "never run" not in proc.stdout
    assert not (tmp_path / ".stead").exists()  # no store, no token file: nothing started
