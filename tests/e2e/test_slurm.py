"""`srun stead run train.py` against a real Slurm cluster (tests.support.slurm): the job step's nodes make one job.

As Slurm users run it: one folder on a filesystem every node shares (the job's working directory), the job token
in the environment srun passes on, no multi-node flag.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.readme import readme_files
from tests.support.slurm import slurm_cluster

pytestmark = [pytest.mark.anyio, pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"


async def _events(folder: Path, job: str) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stead", "events", "--job", job, "--json", cwd=folder,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_srun_with_two_tasks_on_a_node_is_refused_saying_why(tmp_path: Path) -> None:
    async with slurm_cluster(1, workdir=tmp_path) as cluster:
        rc, _, err = await cluster.srun(["-N1", "-n2", sys.executable, "-m", "stead", "run", str(TRAIN)],
                                        env={**os.environ}, cwd=tmp_path)
    assert rc != 0
    assert "srun started 2 tasks on 1 node(s)" in err and "use srun --ntasks-per-node 1" in err, err[-2000:]


async def test_the_readme_sbatch_script_trains_one_job_over_its_three_nodes(tmp_path: Path) -> None:
    """srun in the batch script, no multi-node flag: one job of three nodes, served by the first (a crash's recovery
    across hosts is tests/e2e/test_hosts_jobs.py's)."""
    (tmp_path / "train.sbatch").write_text(readme_files()["train.sbatch"])
    shutil.copy(TRAIN, tmp_path / "train.py")
    # as on a cluster: `stead` and python3 on PATH (the environment's); no GLOO_SOCKET_IFNAME: stead picks it
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "STEAD_JOB_TOKEN")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
    async with slurm_cluster(3, workdir=tmp_path) as cluster:
        job_id = await cluster.sbatch(tmp_path / "train.sbatch", env=env, cwd=tmp_path)
        state = await cluster.wait_job(job_id, timeout_s=180)
    out = (tmp_path / f"slurm-{job_id}.out").read_text(errors="replace")
    assert state == "COMPLETED", out[-4000:]
    assert f"job slurm-{job_id} succeeded" in out, out[-4000:]
    assert out.count("serves its master") == 1, out[-4000:]  # the step's first node, h1, and only it
    events = [json.loads(line) for line in (await _events(tmp_path, f"slurm-{job_id}")).splitlines() if line]
    assert {e["data"]["host"] for e in events if e["type"] == "node.started"} == {"h1", "h2", "h3"}
    assert [len(e["data"]["members"]) for e in events if e["type"] == "round.started"] == [3]
