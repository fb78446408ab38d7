"""`srun stead run train.py`: the Slurm job step gives torchrun's multi-node flags; flags given still win, and a
step that cannot be one job is refused with what to do."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stead.cli.run_args import parse_run_args
from stead.cli.slurm_env import PORT_BASE, hostnames, slurm_step
from stead.core.errors import ConfigError
from stead.core.runspec import RunConfig

#: a task of `srun -N3 stead run ...` in job 4711, on the second node
STEP = {"PATH": os.environ.get("PATH", os.defpath), "SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "gpu[01-03]", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_PROCID": "1", "SLURM_NODEID": "1"}
PORT = PORT_BASE + 4711


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "train.py").write_text("print('hello')\n")
    yield tmp_path


def parse(workdir: Path, *argv: str, environ: Mapping[str, str] = STEP) -> RunConfig:
    return parse_run_args([*argv, "train.py"], environ=environ, cwd=str(workdir))


@pytest.mark.parametrize(("nodelist", "names"), [
    ("h1", ("h1",)),
    ("h[1-3]", ("h1", "h2", "h3")),
    ("gpu[01-03,07]", ("gpu01", "gpu02", "gpu03", "gpu07")),
    ("gpu[08-11]", ("gpu08", "gpu09", "gpu10", "gpu11")),
    ("login1,n[1-2],ctl", ("login1", "n1", "n2", "ctl")),
    ("rack[1-2]-n[01-02]", ("rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02")),
    ("node-[9-10].cluster", ("node-9.cluster", "node-10.cluster")),
])
def test_a_node_list_expands_as_slurm_expands_it(nodelist: str, names: tuple[str, ...]) -> None:
    assert hostnames(nodelist) == names


@pytest.mark.parametrize(("nodelist", "says"), [
    ("", "names no host"),
    ("h[1-3", "without its ']'"),
    ("h1-3]", "without its '['"),
    ("h[[1-2]]", "inside a bracket"),
    ("h[3-1]", "runs backwards"),
    ("h[a-c]", "not a number or a range"),
    ("h1,,h2", "an empty name"),
    ("h[1-1000000]", "more than"),
])
def test_a_node_list_that_does_not_parse_is_refused_saying_why(nodelist: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"does not parse|names no host|more than") as err:
        hostnames(nodelist)
    assert says in str(err.value)


@given(st.lists(st.tuples(st.sampled_from(["n", "gpu", "a-b"]), st.integers(0, 300), st.integers(0, 4)),
                min_size=1, max_size=8))
def test_a_bracketed_range_names_exactly_its_numbers_with_their_padding(
        groups: list[tuple[str, int, int]]) -> None:
    expression = ",".join(f"{prefix}[{first:03d}-{first + extra:03d}]" for prefix, first, extra in groups)
    expected = tuple(f"{prefix}{n:03d}" for prefix, first, extra in groups for n in range(first, first + extra + 1))
    assert hostnames(expression) == expected


def test_outside_an_srun_step_nothing_changes(workdir: Path) -> None:
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    assert slurm_step(batch) is None  # a batch script's own shell: one machine, as before
    config = parse(workdir, environ=batch)
    assert (config.min_nodes, config.max_nodes, config.hosts_endpoint, config.platform) == (1, 1, "", "local")


def test_no_flags_make_one_elastic_job_served_by_the_steps_first_node(workdir: Path) -> None:
    config = parse(workdir)
    assert (config.min_nodes, config.max_nodes) == (3, 3)
    assert (config.rdzv_backend, config.hosts_endpoint, config.platform) == ("c10d", f"gpu01:{PORT}", "hosts")
    assert (config.rdzv_id, config.job_name) == ("slurm-4711", "slurm-4711")  # the same on every node


def test_a_smaller_nnodes_leaves_the_steps_other_nodes_as_spare_hosts(workdir: Path) -> None:
    config = parse(workdir, "--nnodes", "2")
    assert (config.min_nodes, config.max_nodes, config.hosts_endpoint) == (2, 2, f"gpu01:{PORT}")
    config = parse(workdir, "--nnodes", "2:3")
    assert (config.min_nodes, config.max_nodes) == (2, 3)


@pytest.mark.parametrize(("argv", "backend", "endpoint"), [
    (("--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400"), "c10d", "head:29400"),
    (("--master-port", "29555"), "c10d", "gpu01:29555"),
    (("--node-rank", "1"), "static", "gpu01:29500"),
    (("--node-rank", "1", "--master-addr", "head", "--master-port", "1234"), "static", "head:1234"),
    (("--rdzv-id", "exp7"), "c10d", f"gpu01:{PORT}"),
])
def test_torchruns_flags_given_win_over_the_step(workdir: Path, argv: tuple[str, ...], backend: str,
                                                 endpoint: str) -> None:
    config = parse(workdir, *argv)
    assert (config.rdzv_backend, config.hosts_endpoint) == (backend, endpoint)
    if "--rdzv-id" in argv:
        assert config.job_name == "exp7"


def test_torchruns_pet_variables_win_over_the_step(workdir: Path) -> None:
    config = parse(workdir, environ={**STEP, "PET_NNODES": "2"})
    assert (config.min_nodes, config.max_nodes) == (2, 2)


def test_standalone_under_srun_stays_one_machine(workdir: Path) -> None:
    config = parse(workdir, "--standalone", "--nnodes", "1")
    assert (config.hosts_endpoint, config.platform) == ("", "local")


@pytest.mark.parametrize(("argv", "environ", "says"), [
    (("--nnodes", "4"), {}, "--nnodes asks for at least 4 nodes but the Slurm step runs on 3 (gpu01,gpu02,gpu03)"),
    (("--nnodes", "4:6"), {}, "ask srun for --nodes 4 or more"),
    ((), {"SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"},
     "srun started 6 tasks on 3 node(s)"),
    ((), {"SLURM_STEP_NUM_NODES": "2"}, "SLURM_STEP_NUM_NODES=2 but SLURM_STEP_NODELIST='gpu[01-03]' names 3"),
    ((), {"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not a number"),
    ((), {"SLURM_PROCID": "5"}, "SLURM_PROCID=5 is not a task of a 3-task step"),
    ((), {"SLURM_STEP_NODELIST": "gpu[01-03"}, "does not parse"),
])
def test_a_step_that_cannot_be_one_job_is_refused_saying_what_to_do(
        workdir: Path, argv: tuple[str, ...], environ: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(workdir, *argv, environ={**STEP, **environ})
    assert says in str(err.value)
