"""Node health checks on a real job: a slow node is caught before it trains, replaced, and the job completes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

RunJob = Callable[..., Any]  # the run_job fixture of conftest.py

pytestmark = pytest.mark.e2e

TRAIN = """
import torch, torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    model(torch.ones(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
print("finished", dist.get_rank(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.extended("a node slower than the others caught by its health check before training, its host excluded "
                      "and the node relaunched elsewhere: tests/e2e/test_slurm.py's platform test (the same slow "
                      "fault, the node on the spare); the check's verdicts: test_health_machine.py")
@pytest.mark.long(21)
def test_a_node_slower_than_twice_the_median_is_excluded_before_training_and_relaunched(
        run_job: RunJob, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEAD_FAULT_HEALTH", "node-1:1:slow")  # node-1's first agent: 4x the work per matmul
    # the README's command (its section on node health checks)
    job = run_job(TRAIN, job="check", flags=("--nnodes", "3", "--set", "health_check=all"))
    assert job.returncode == 0, job.stderr[-4000:]
    assert "health.checked" in job.events("check")
    checks = job.records("check", "health.checked")
    first, second = checks
    assert first["nodes"] == ["node-0", "node-1", "node-2"]
    [verdict] = first["failed"]
    assert (verdict["node_id"], verdict["incarnation"]) == ("node-1", 1)
    assert "matmul took" in verdict["reason"] and "the median" in verdict["reason"]
    assert second["nodes"] == ["node-1", "node-0"] and second["failed"] == []  # the new node, with a partner
    reports: list[dict[str, Any]] = job.records("check", "node.health")
    assert {(r["node_id"], r["incarnation"], r["check"]) for r in reports} == {
        ("node-0", 1, 1), ("node-1", 1, 1), ("node-2", 1, 1), ("node-1", 2, 2), ("node-0", 1, 2)}
    assert all(r["device"] == "cpu" and r["matmul_s"] > 0 for r in reports)
    assert all(c["seconds"] is not None for r in reports for c in r["collectives"])  # every pair all-reduced
    # nobody trained before the check passed: one round, with node-1's second incarnation
    [round_] = job.records("check", "round.started")
    assert sorted(round_["members"]) == ["node-0", "node-1", "node-2"]
    relaunch = [r for r in job.records("check", "node.requested") if r["incarnation"] == 2]
    assert [(r["node_id"], bool(r["avoid_hosts"])) for r in relaunch] == [("node-1", True)]  # its host excluded
    assert job.stdout.count("finished") == 3
