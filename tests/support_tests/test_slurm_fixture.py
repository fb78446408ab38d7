"""The Slurm cluster fixture (``tests.support.slurm``): a real slurmctld and slurmds on test hosts, that run steps
and batch jobs on the compute hosts, lose a killed node at once, and never meet a second cluster beside them."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import anyio
import pytest

from tests.support.slurm import slurm_cluster

pytestmark = pytest.mark.anyio

#: bounds for what takes well under a second on a quiet machine, not measured durations
STEP_TIMEOUT_S = 30.0


async def test_srun_runs_a_task_on_every_compute_node_and_several_on_one(tmp_path: Path) -> None:
    async with slurm_cluster(3, workdir=tmp_path) as cluster:
        assert [h.name for h in cluster.nodes] == ["h1", "h2", "h3"]
        assert cluster.controller.name == "h0"
        with anyio.fail_after(STEP_TIMEOUT_S):
            rc, out, err = await cluster.srun(["-N3", "hostname"])
            assert rc == 0, err
            assert sorted(out.split()) == ["h1", "h2", "h3"]
            rc, out, err = await cluster.srun(["-N1", "-n2", "-w", "h2", "hostname"])
            assert rc == 0, err
            assert out.split() == ["h2", "h2"]
        # a node is "completing" a moment after its step ended (Slurm's epilog), then idle
        idle = {"h1": "idle", "h2": "idle", "h3": "idle"}
        with anyio.move_on_after(STEP_TIMEOUT_S):
            while await cluster.node_states() != idle:  # noqa: ASYNC110 (Slurm's controller: nothing to wait on)
                await anyio.sleep(0.2)
        assert await cluster.node_states() == idle


async def test_an_sbatch_script_runs_on_a_node_and_writes_its_output_file(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent("""\
        #!/bin/bash
        #SBATCH --nodes=2
        srun hostname | sort
        echo "batch ran on $(hostname) in $SLURM_JOB_NUM_NODES nodes"
    """))
    async with slurm_cluster(2, workdir=tmp_path) as cluster:
        job = await cluster.sbatch(script)
        assert await cluster.wait_job(job) == "COMPLETED"
        assert await cluster.squeue() == []
        lines = (tmp_path / f"slurm-{job}.out").read_text().splitlines()
        assert lines[:2] == ["h1", "h2"]
        assert lines[2] in {"batch ran on h1 in 2 nodes", "batch ran on h2 in 2 nodes"}


async def test_a_killed_node_is_down_at_once_its_step_ends_and_it_comes_back(tmp_path: Path) -> None:
    async with slurm_cluster(3, workdir=tmp_path) as cluster:
        step = await cluster.spawn_srun(["-N3", "bash", "-c", "echo started; exec sleep 600"])
        assert step.stdout is not None
        with anyio.fail_after(STEP_TIMEOUT_S):
            for _ in range(3):
                assert await step.stdout.readline() == b"started\n"
        [job] = await cluster.squeue()
        assert (job.state, job.nodes) == ("RUNNING", "h[1-3]")

        await cluster.kill_node(1)
        assert await cluster.node_state("h2") == "down"
        with anyio.fail_after(STEP_TIMEOUT_S):
            assert await step.wait() != 0
        assert await cluster.wait_job(job.id) == "NODE_FAIL"  # (COMPLETING a moment before)

        await cluster.restart_node(1)
        with anyio.fail_after(STEP_TIMEOUT_S):
            rc, out, err = await cluster.srun(["-N3", "hostname"])
        assert rc == 0, err
        assert sorted(out.split()) == ["h1", "h2", "h3"]


async def test_two_clusters_side_by_side_do_not_meet(tmp_path: Path) -> None:
    async with (slurm_cluster(2, workdir=tmp_path / "a") as a, slurm_cluster(1, workdir=tmp_path / "b") as b):
        with anyio.fail_after(STEP_TIMEOUT_S):
            (rc_a, out_a, err_a), (rc_b, out_b, err_b) = await asyncio.gather(
                a.srun(["-N2", "hostname"]), b.srun(["-N1", "hostname"]))
        assert (rc_a, rc_b) == (0, 0), (err_a, err_b)
        assert (sorted(out_a.split()), out_b.split()) == (["h1", "h2"], ["h1"])
        assert set(await a.node_states()) == {"h1", "h2"}
        assert set(await b.node_states()) == {"h1"}
