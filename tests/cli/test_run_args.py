"""`stead run` arguments: torchrun's flags, stead's own, every bad input, and torch's worker environment."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from stead.cli import run_args
from stead.cli.run import health_mode
from stead.cli.run_args import build_parser, parse_run_args
from stead.core import runspec
from stead.core.config import Settings
from stead.core.errors import ConfigError, InvalidRequest
from stead.core.runspec import RunConfig, Streams, worker_env

PY = sys.executable
#: a clean environment: no PET_*, STEAD_*, PYTHON_EXEC, OMP_NUM_THREADS or CUDA_VISIBLE_DEVICES
ENV = {"PATH": os.environ.get("PATH", os.defpath)}


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A directory holding train.py, used as the cwd the script is looked up in."""
    with tempfile.TemporaryDirectory(prefix="stead-launch-") as path:
        (Path(path) / "train.py").write_text("print('hello')\n")
        yield Path(path)


def parse(workdir: Path, *argv: str, environ: Mapping[str, str] = ENV) -> RunConfig:
    return parse_run_args(argv, environ=environ, cwd=str(workdir))


def field(config: RunConfig, dotted: str) -> Any:
    value: Any = config
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


def test_defaults_match_torchrun_and_a_laptop(workdir: Path) -> None:
    config = parse(workdir, "train.py")
    defaults = Settings()
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 1)
    assert (config.max_restarts, config.monitor_interval_s) == (0, 0.1)
    assert (config.join_timeout_s, config.last_call_timeout_s) == (defaults.join_timeout_s,
                                                                   defaults.last_call_timeout_s)
    assert config.settings == defaults and config.settings_overrides == {}
    assert config.entrypoint == (PY, "-u", "train.py")
    assert (config.platform, config.log_format, config.log_level, config.trace) == ("local", "console", "info", None)
    assert not config.force  # a job of the same name is resumed only with the same shape and script
    assert (config.role, config.node_rank, config.master_addr, config.master_port) == ("default", 0, "127.0.0.1", None)
    assert (config.redirects, config.tee, config.local_ranks_filter) == ((Streams.NONE,), (Streams.NONE,), frozenset())
    assert (config.rdzv_backend, config.standalone, config.log_dir) == ("static", False, None)
    assert re.fullmatch(r"train-\d{8}-\d{6}-[0-9a-f]{6}", config.job_name)
    assert config.rdzv_id == config.job_name
    assert config.store_url == f"sqlite:///.stead/{config.job_name}.db"


def test_generated_job_names_are_unique(workdir: Path) -> None:
    assert len({parse(workdir, "train.py").job_name for _ in range(5)}) == 5


@pytest.mark.parametrize(("argv", "expected"), [
    (["--nnodes", "4"], {"min_nodes": 4, "max_nodes": 4}),
    (["--nnodes", "1:4"], {"min_nodes": 1, "max_nodes": 4}),
    (["--nnodes=2:2"], {"min_nodes": 2, "max_nodes": 2}),
    (["--nproc-per-node", "8"], {"nproc_per_node": 8}),
    (["--nproc_per_node", "8"], {"nproc_per_node": 8}),
    (["--nproc-per-node=3"], {"nproc_per_node": 3}),
    (["--max-restarts", "3"], {"max_restarts": 3}),
    (["--max-node-relaunches", "7"], {"max_node_relaunches": 7}),
    (["--max_restarts", "3"], {"max_restarts": 3}),
    (["--monitor-interval", "0.5"], {"monitor_interval_s": 0.5}),
    (["--monitor_interval", "2"], {"monitor_interval_s": 2.0}),
    (["--rdzv-conf", "join_timeout=20,last_call_timeout=2"],
     {"join_timeout_s": 20.0, "last_call_timeout_s": 2.0, "settings.join_timeout_s": 20.0,
      "settings_overrides": {"join_timeout_s": "20", "last_call_timeout_s": "2"}}),
    (["--rdzv_conf", " join_timeout = 30 "], {"join_timeout_s": 30.0}),
    (["--rdzv-conf", "heartbeat=9,keep_alive_interval=1"],
     {"settings.heartbeat_timeout_s": 9.0, "settings.heartbeat_interval_s": 1.0}),
    (["--rdzv-conf", "read_timeout=60,is_host=1"],
     {"rdzv_conf": {"read_timeout": "60", "is_host": "1"}, "settings": Settings()}),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:29400", "--rdzv-id", "exp42"],
     {"rdzv_backend": "c10d", "rdzv_endpoint": "host:29400", "rdzv_id": "exp42", "job_name": "exp42",
      "store_url": "sqlite:///.stead/exp42.db"}),
    (["--rdzv_backend", "etcd", "--rdzv_endpoint", "h:1", "--rdzv_id", "My_Run.7"],
     {"rdzv_backend": "etcd", "rdzv_id": "My_Run.7", "job_name": "my-run-7"}),
    (["--rdzv-id", "run", "--job-name", "exp-1"], {"rdzv_id": "run", "job_name": "exp-1"}),
    (["--standalone"], {"standalone": True, "min_nodes": 1, "max_nodes": 1, "rdzv_backend": "c10d",
                        "rdzv_endpoint": "localhost:0"}),
    (["--standalone", "--nnodes", "1"], {"standalone": True}),
    (["--nnodes", "2", "--node-rank", "1"], {"node_rank": 1}),
    (["--nnodes", "2", "--node_rank", "1"], {"node_rank": 1}),
    (["--master-addr", "10.0.0.1", "--master-port", "29501"], {"master_addr": "10.0.0.1", "master_port": 29501}),
    (["--master_addr", "h", "--master_port", "1"], {"master_addr": "h", "master_port": 1}),
    (["--local-addr", "node7"], {"local_addr": "node7"}),
    (["--local_addr", "node7"], {"local_addr": "node7"}),
    (["--role", "trainer"], {"role": "trainer"}),
    (["--log-dir", "/var/log/x"], {"log_dir": "/var/log/x"}),
    (["--log_dir", "logs"], {"log_dir": "logs"}),
    (["--nproc-per-node", "2", "-r", "3"], {"redirects": (Streams.ALL, Streams.ALL)}),
    (["--nproc-per-node", "2", "--redirects", "0:1,1:2"], {"redirects": (Streams.OUT, Streams.ERR)}),
    (["--nproc-per-node", "3", "-t", "1:3"], {"tee": (Streams.NONE, Streams.ALL, Streams.NONE)}),
    (["--nproc-per-node", "2", "--tee", "2"], {"tee": (Streams.ERR, Streams.ERR)}),
    (["--local-ranks-filter", "0,2"], {"local_ranks_filter": frozenset({0, 2})}),
    (["--local_ranks_filter", "1"], {"local_ranks_filter": frozenset({1})}),
    (["--start-method", "fork"], {"nproc_per_node": 1}),
    (["--shutdown-timeout", "7"], {"settings.worker_stop_grace_s": 7.0}),
    (["--store", "etcd://127.0.0.1:2379"], {"store_url": "etcd://127.0.0.1:2379"}),
    (["--store", "memory://"], {"store_url": "memory://"}),
    (["--plugins", "ckpt,diagnosis", "--no-plugin", "sharding"],
     {"plugins": ("ckpt", "diagnosis"), "disabled_plugins": ("sharding",)}),
    (["--set", "ckpt.keep_last=4", "--set", "sharding.wait_s=0.5"],
     {"settings.plugin_values": {"ckpt": {"keep_last": "4"}, "sharding": {"wait_s": "0.5"}}}),
    (["--job-name", "exp-1"], {"job_name": "exp-1", "rdzv_id": "exp-1", "store_url": "sqlite:///.stead/exp-1.db"}),
    (["--set", "heartbeat_timeout_s=10", "--set", "plugin_max_failures=5"],
     {"settings.heartbeat_timeout_s": 10.0, "settings.plugin_max_failures": 5,
      "settings_overrides": {"heartbeat_timeout_s": "10", "plugin_max_failures": "5"}}),
    (["--set", "join_timeout_s=15"], {"join_timeout_s": 15.0}),
    (["--rdzv-conf", "join_timeout=15", "--set", "join_timeout_s=15"], {"join_timeout_s": 15.0}),
    (["--log-format", "json"], {"log_format": "json"}),
    (["--trace", "console"], {"trace": "console"}),
    (["--trace", "otlp"], {"trace": "otlp"}),
    (["--log-level", "debug"], {"log_level": "debug"}),
    (["--quiet"], {"log_level": "warning"}),
    (["--job-name", "again", "--force"], {"job_name": "again", "force": True}),
])
def test_flag_sets_its_field(workdir: Path, argv: list[str], expected: dict[str, Any]) -> None:
    config = parse(workdir, *argv, "train.py")
    assert {name: field(config, name) for name in expected} == expected


@pytest.mark.parametrize(("argv", "entrypoint", "script_args"), [
    (["train.py", "--lr", "0.1"], (PY, "-u", "train.py", "--lr", "0.1"), ("--lr", "0.1")),
    (["train.py", "--nnodes", "5"], (PY, "-u", "train.py", "--nnodes", "5"), ("--nnodes", "5")),
    (["-m", "pkg.train", "--x"], (PY, "-u", "-m", "pkg.train", "--x"), ("--x",)),
    (["--module", "pkg"], (PY, "-u", "-m", "pkg"), ()),
    (["--no-python", "true", "a"], ("true", "a"), ("a",)),
    (["--no_python", "true"], ("true",), ()),
])
def test_entrypoint_is_what_torchrun_runs(workdir: Path, argv: list[str], entrypoint: tuple[str, ...],
                                          script_args: tuple[str, ...]) -> None:
    config = parse(workdir, *argv)
    assert config.entrypoint == entrypoint
    assert config.training_script_args == script_args
    assert (config.min_nodes, config.max_nodes) == (1, 1)  # flags after the script belong to the script


def test_run_path_runs_the_script_by_absolute_path(workdir: Path) -> None:
    config = parse(workdir, "--run-path", "train.py", "x")
    assert config.run_path and config.entrypoint == (PY, "-u", str(workdir / "train.py"), "x")
    assert parse(workdir, "--run_path", "--no-python", "train.py").entrypoint == (PY, "-u", str(workdir / "train.py"))


def test_python_exec_replaces_the_interpreter_like_torchrun(workdir: Path) -> None:
    config = parse(workdir, "train.py", environ={**ENV, "PYTHON_EXEC": "/opt/py/bin/python3"})
    assert config.entrypoint == ("/opt/py/bin/python3", "-u", "train.py")


def test_script_is_found_by_absolute_path_and_executable_by_relative_path(workdir: Path) -> None:
    assert parse(workdir, str(workdir / "train.py")).entrypoint == (PY, "-u", str(workdir / "train.py"))
    tool = workdir / "tool.sh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert parse(workdir, "--no-python", "./tool.sh").entrypoint == ("./tool.sh",)


def test_pet_environment_variables_are_defaults_like_torchrun(workdir: Path) -> None:
    environ = {**ENV, "PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
               "PET_MASTER_ADDR": "h", "PET_MASTER_PORT": "1234", "PET_MAX_RESTARTS": "4", "PET_MODULE": "0"}
    config = parse(workdir, "train.py", environ=environ)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.node_rank) == (3, 3, 2, 1)
    assert (config.master_addr, config.master_port, config.max_restarts, config.module) == ("h", 1234, 4, False)
    assert parse(workdir, "--nnodes", "1", "--node-rank", "0", "train.py", environ=environ).min_nodes == 1
    assert parse(workdir, "pkg.train", environ={**ENV, "PET_MODULE": "1"}).module


def test_stead_environment_variables_are_the_settings_base(workdir: Path) -> None:
    environ = {**ENV, "STEAD_HEARTBEAT_TIMEOUT_S": "8", "STEAD_JOIN_TIMEOUT_S": "9"}
    config = parse(workdir, "--rdzv-conf", "join_timeout=3", "train.py", environ=environ)
    assert (config.settings.heartbeat_timeout_s, config.join_timeout_s) == (8.0, 3.0)


@pytest.mark.parametrize(("value", "gpus", "expected"), [
    ("auto", 4, 4),
    ("auto", 0, "cpus"),
    ("cpu", 4, "cpus"),
    ("gpu", 2, 2),
])
def test_nproc_per_node_by_device(workdir: Path, monkeypatch: pytest.MonkeyPatch, value: str, gpus: int,
                                  expected: int | str) -> None:
    monkeypatch.setattr(run_args, "gpu_count", lambda environ=None: gpus)
    cpus = len(os.sched_getaffinity(0))
    assert parse(workdir, "--nproc-per-node", value, "train.py").nproc_per_node == (
        cpus if expected == "cpus" else expected)


def test_nproc_gpu_without_gpu_is_an_error(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_args, "gpu_count", lambda environ=None: 0)
    with pytest.raises(ConfigError, match="no GPU found"):
        parse(workdir, "--nproc-per-node", "gpu", "train.py")


def test_gpu_count_without_nvml_is_zero() -> None:
    # this machine has no NVIDIA driver: nvmlInit raises NVMLError
    assert runspec.gpu_count({}) == 0


@pytest.mark.parametrize(("visible", "expected"), [(None, 4), ("0,1", 2), ("", 0), ("1,-1,2", 1), ("0,1,2,3,4,5", 4)])
def test_gpu_count_is_limited_by_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch, visible: str | None,
                                                      expected: int) -> None:
    class NVMLError(Exception):
        pass

    fake = types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlDeviceGetCount=lambda: 4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert runspec.gpu_count({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}) == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["missing.py"], r"training script 'missing.py' not found \(cwd {cwd}\)"),
    (["sub/missing.py"], r"'sub/missing.py' not found \(cwd {cwd}\)"),
    (["--nnodes", "3:2", "train.py"], "MIN 3 is larger than MAX 2"),
    (["--nnodes", "0:2", "train.py"], "minimum number of nodes must be at least 1"),
    (["--nnodes", "0", "train.py"], "at least 1"),
    (["--nnodes", "-1", "train.py"], "at least 1"),
    (["--nnodes", "two", "train.py"], "'two' is not a node count"),
    (["--nnodes", "1.5", "train.py"], "not a node count"),
    (["--nnodes", "1:2:3", "train.py"], "not a node count"),
    (["--nnodes", "1:", "train.py"], "not a node count"),
    (["--nproc-per-node", "0", "train.py"], "--nproc-per-node must be at least 1, got 0"),
    (["--nproc-per-node", "-2", "train.py"], "at least 1, got -2"),
    (["--nproc-per-node", "xpu", "train.py"], "'xpu' is not supported"),
    (["--rdzv-conf", "join_timeout", "train.py"], "--rdzv-conf 'join_timeout' is not valid"),
    (["--rdzv-conf", "=5", "train.py"], "not valid"),
    (["--rdzv-conf", "join_timeout=10,", "train.py"], "not valid"),
    (["--rdzv-conf", "bogus=1", "train.py"], "unknown key 'bogus'; known keys: close_timeout"),
    (["--rdzv-conf", "join_timeout=abc", "train.py"], "join_timeout='abc' must be a positive number"),
    (["--rdzv-conf", "last_call_timeout=0", "train.py"], "must be a positive number"),
    (["-r", "4", "train.py"], "--redirects '4': 4 is out of range"),
    (["-r", "0:5", "train.py"], "5 is out of range"),
    (["-r", "1:1", "train.py"], "names local rank 1 but there are 1 per node"),
    (["-r", "x", "train.py"], "--redirects 'x' is not valid"),
    (["-t", "0:1,", "train.py"], "--tee '0:1,' is not valid"),
    (["--tee", "9", "train.py"], "--tee '9': 9 is out of range"),
    (["-m", "train.py"], "expects a module name like 'pkg.train', not the path 'train.py'"),
    (["--module", "pkg/train"], "not the path"),
    (["-m", "--no-python", "pkg"], "--module and --no-python cannot be used together"),
    (["-m", "--run-path", "pkg"], "--module and --run-path cannot be used together"),
    (["--no-python", "stead-no-such-program"], "'stead-no-such-program' not found on PATH"),
    (["--no-python", "./train.py"], "not found or not executable"),
    (["--max-restarts", "-1", "train.py"], "--max-restarts must be at least 0"),
    (["--max-node-relaunches", "-1", "train.py"], "--max-node-relaunches must be at least 0"),
    (["--monitor-interval", "0", "train.py"], "--monitor-interval must be positive"),
    (["--nnodes", "2", "--node-rank", "2", "train.py"], "--node-rank 2 is out of range"),
    (["--node-rank", "-1", "train.py"], "--node-rank must be at least 0"),
    (["--master-port", "70000", "train.py"], "70000 is not a TCP port"),
    (["--standalone", "--nnodes", "2", "train.py"], "--standalone runs a single node"),
    (["--set", "nope=1", "train.py"], "unknown setting 'nope'"),
    (["--set", "heartbeat_timeout_s", "train.py"], "is not NAME=VALUE"),
    # a name is a setting's name, read without the spaces around it; a later --set never quietly undoes one
    (["--set", "K8S.ptrace=true", "train.py"], r"'K8S.ptrace' is not a setting's name; a name is lowercase"),
    (["--set", "ckpt keep_last=3", "train.py"], r"'ckpt keep_last' is not a setting's name"),
    (["--set", "k8s.ptrace=false", "--set", " k8s.ptrace = true", "train.py"],
     "--set k8s.ptrace=false and --set k8s.ptrace=true disagree; give k8s.ptrace once"),
    (["--set", "heartbeat_timeout_s=abc", "train.py"], "not a valid float"),
    (["--set", "heartbeat_timeout_s=-1", "train.py"], "must not be negative"),
    (["--rdzv-conf", "join_timeout=10", "--set", "join_timeout_s=20", "train.py"], "disagree"),
    (["--shutdown-timeout", "3", "--set", "worker_stop_grace_s=4", "train.py"], "disagree"),
    (["--job-name", "Bad_Name", "train.py"], "--job-name 'Bad_Name' is not valid"),
    (["--job-name", "a" * 64, "train.py"], "at most 63"),
    (["--store", "nourl", "train.py"], "--store 'nourl' is not a URL"),
    (["--local-ranks-filter", "a", "train.py"], "comma-separated local ranks"),
    (["--platform", "nomad", "train.py"], r"--platform 'nomad' is not installed \(installed: k8s, local; and slurm "
                                          r"in a Slurm job\)"),
    (["--plugins", "nope", "train.py"], r"--plugins: plugin\(s\) 'nope' not installed"),
    (["--no-plugin", "nope", "train.py"], r"--no-plugin: plugin\(s\) 'nope' not installed"),
    (["--set", "ckpt.bogus=1", "train.py"], r"unknown setting 'ckpt.bogus'; settings of the ckpt plugin: ckpt.dir="),
    (["--set", "ckpt.keep_last=0", "train.py"], "setting ckpt.keep_last='0' must be at least 1"),
    (["--set", "heartbeat_interval_s=0", "train.py"], "must be at least 0.001 seconds"),
    (["--set", "rpc_timeout_s=nan", "train.py"], "must be a finite number of seconds"),
])
def test_bad_input_is_a_one_line_config_error(workdir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(workdir, *argv)
    text = str(caught.value)
    assert re.search(message.replace("{cwd}", re.escape(str(workdir))), text), text
    assert "\n" not in text


def test_bad_pet_flag_variable_is_a_config_error(workdir: Path) -> None:
    with pytest.raises(ConfigError, match="PET_STANDALONE='yes' must be 0 or 1"):
        parse(workdir, "train.py", environ={**ENV, "PET_STANDALONE": "yes"})


@pytest.mark.parametrize("argv", [
    ["--bogus", "train.py"],
    ["--nproc", "2", "train.py"],  # no abbreviations: stead's flags may grow
    ["--max-restarts", "x", "train.py"],
    ["--nnodes", "2"],
    [],
])
def test_argparse_errors_are_usage_and_one_line_with_exit_code_2(workdir: Path, argv: list[str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse(workdir, *argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: stead run")
    assert [line for line in err.splitlines() if "error" in line] == [err.strip().splitlines()[-1]]
    assert err.strip().splitlines()[-1].startswith("stead run: error: ")
    assert "Traceback" not in err


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(ENV)
    undocumented = [action.dest for action in parser._actions if not action.help]
    assert undocumented == []
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(["--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--nnodes", "--nproc-per-node", "--max-restarts", "--monitor-interval", "--rdzv-conf",
                 "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--node-rank", "--master-addr", "--master-port",
                 "--module", "--no-python", "--run-path", "--log-dir", "--redirects", "--tee", "--standalone",
                 "--role", "--local-addr", "--store", "--platform", "--plugins", "--no-plugin", "--job-name", "--set",
                 "--log-format", "--trace",
                 "training_script", "join_timeout", "last_call_timeout"):
        assert flag in out, flag


# -- worker environment ----------------------------------------------------------------------------------


def run_config(workdir: Path, *argv: str) -> RunConfig:
    return parse(workdir, *argv, "train.py")


def test_worker_env_for_the_second_worker_of_the_second_node(workdir: Path) -> None:
    config = run_config(workdir, "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "3", "--role", "r")
    env = worker_env(config, local_rank=1, node_rank=1, nnodes=2, restart_count=2, master_addr="10.0.0.1",
                     master_port=29400, world_size=4, run_id="job-x", error_file="/logs/1/error.json", environ={})
    assert env == {
        "RANK": "3", "GROUP_RANK": "1", "ROLE_RANK": "3", "ROLE_NAME": "r", "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job-x", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "LOCAL_RANK": "1", "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_ERROR_FILE": "/logs/1/error.json",
    }


@pytest.mark.parametrize(("nproc", "environ", "expected"), [
    ("2", {}, "1"),  # torchrun's default for more than one worker per node
    ("1", {}, None),
    ("2", {"OMP_NUM_THREADS": "8"}, "8"),
    ("1", {"OMP_NUM_THREADS": "8"}, "8"),
])
def test_worker_env_omp_num_threads_like_torchrun(workdir: Path, nproc: str, environ: dict[str, str],
                                                  expected: str | None) -> None:
    config = run_config(workdir, "--nproc-per-node", nproc)
    env = worker_env(config, local_rank=0, node_rank=0, nnodes=1, restart_count=0, master_addr="h", master_port=1,
                     world_size=int(nproc), run_id="r", environ=environ)
    assert env.get("OMP_NUM_THREADS") == expected


def test_worker_env_passes_through_what_torchrun_passes_through(workdir: Path) -> None:
    environ = {"CUDA_VISIBLE_DEVICES": "2,3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "OTHER": "x"}
    env = worker_env(run_config(workdir), local_rank=0, node_rank=0, nnodes=1, restart_count=0, master_addr="h",
                     master_port=1, world_size=1, run_id="r", environ=environ)
    assert (env["CUDA_VISIBLE_DEVICES"], env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == ("2,3", "3")
    assert "OTHER" not in env  # the rest is inherited, not set


def test_worker_env_with_uneven_nodes_uses_the_given_base_rank(workdir: Path) -> None:
    env = worker_env(run_config(workdir, "--nproc-per-node", "2"), local_rank=1, node_rank=2, nnodes=3,
                     restart_count=0, master_addr="h", master_port=1, world_size=7, run_id="r", base_rank=5,
                     local_world_size=2, environ={})
    assert (env["RANK"], env["ROLE_RANK"], env["GROUP_RANK"], env["WORLD_SIZE"]) == ("6", "6", "2", "7")


@pytest.mark.parametrize("overrides", [
    {"local_rank": 2},
    {"local_rank": -1},
    {"node_rank": 2},
    {"world_size": 3},
    {"group_world_size": 1},
])
def test_worker_env_rejects_ranks_outside_the_world(workdir: Path, overrides: dict[str, int]) -> None:
    args: dict[str, Any] = {"local_rank": 1, "node_rank": 1, "nnodes": 2, "restart_count": 0, "master_addr": "h",
                            "master_port": 1, "world_size": 4, "run_id": "r", "environ": {}, **overrides}
    with pytest.raises(InvalidRequest, match="outside"):
        worker_env(run_config(workdir, "--nproc-per-node", "2"), **args)


def torch_worker_envs(argv: list[str], *, group_rank: int, group_world_size: int, restart_count: int,
                      master_addr: str, master_port: int,
                      monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[str, ...], str, dict[int, dict[str, str]]]:
    """What torchrun itself would run and set: its argument handling, then LocalElasticAgent._start_workers.

    Only the process start is replaced (by a recorder that still lets torch's log specs add their
    variables); the rendezvous result is filled in as a finished rendezvous leaves it.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.agent.server.api import WorkerSpec

    recorded: dict[int, dict[str, str]] = {}

    class Started:
        def pids(self) -> dict[int, int]:
            return {}

    def record_start(*, envs: dict[int, dict[str, str]], logs_specs: Any, **_: Any) -> Started:
        logs_specs.reify(envs)  # torch adds TORCHELASTIC_ERROR_FILE here
        recorded.update(envs)
        return Started()

    class FinishedRendezvous:
        use_agent_store = True

        def __init__(self, run_id: str) -> None:
            self.run_id = run_id

        def get_run_id(self) -> str:
            return self.run_id

    monkeypatch.setattr(local_elastic_agent, "start_processes", record_start)
    launch_config, cmd, cmd_args = torchrun.config_from_args(torchrun.parse_args(argv))  # may set OMP_NUM_THREADS
    assert isinstance(cmd, str)
    spec = WorkerSpec(role=launch_config.role, local_world_size=launch_config.nproc_per_node, entrypoint=cmd,
                      args=tuple(cmd_args), rdzv_handler=FinishedRendezvous(launch_config.run_id),  # type: ignore[arg-type]
                      max_restarts=launch_config.max_restarts, monitor_interval=launch_config.monitor_interval)
    agent = local_elastic_agent.LocalElasticAgent(spec, logs_specs=launch_config.logs_specs,  # type: ignore[arg-type]
                                                  start_method=launch_config.start_method)
    agent._remaining_restarts = spec.max_restarts - restart_count
    group = agent._worker_group
    group.store = object()
    group.group_rank, group.group_world_size = group_rank, group_world_size
    group.master_addr, group.master_port = master_addr, master_port
    world = group_world_size * spec.local_world_size
    for worker in group.workers:
        worker.global_rank = worker.role_rank = group_rank * spec.local_world_size + worker.local_rank
        worker.world_size = worker.role_world_size = world
    agent._start_workers(group)
    return (cmd, *cmd_args), launch_config.run_id, recorded


@pytest.mark.parametrize(("nproc", "environ"), [
    ("2", {}),
    ("1", {"OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}),
    ("3", {"OMP_NUM_THREADS": "2"}),
])
def test_worker_env_equals_what_torchrun_sets(workdir: Path, monkeypatch: pytest.MonkeyPatch, nproc: str,
                                              environ: dict[str, str]) -> None:
    for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHON_EXEC",
                 "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_HEALTH_CHECK_PORT"):
        monkeypatch.setenv(name, "")  # remembered, so that whatever torch sets is undone after the test
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(workdir)
    agent_environ = dict(os.environ)  # before torchrun's argument handling changes it
    argv = ["--nnodes", "2", "--nproc-per-node", nproc, "--max-restarts", "3", "--rdzv-id", "job-x", "--role", "r",
            "--log-dir", str(workdir / "logs"), "train.py", "--lr", "1"]

    entrypoint, run_id, torch_envs = torch_worker_envs(argv, group_rank=1, group_world_size=2, restart_count=2,
                                                       master_addr="10.0.0.1", master_port=29400,
                                                       monkeypatch=monkeypatch)

    config = parse_run_args(argv, environ=agent_environ, cwd=str(workdir))
    assert config.entrypoint == entrypoint
    assert config.rdzv_id == run_id
    assert sorted(torch_envs) == list(range(int(nproc)))
    for local_rank, expected in torch_envs.items():
        ours = worker_env(config, local_rank=local_rank, node_rank=1, nnodes=2, restart_count=2,
                          master_addr="10.0.0.1", master_port=29400, world_size=2 * int(nproc), run_id=config.rdzv_id,
                          error_file=expected["TORCHELASTIC_ERROR_FILE"], environ=agent_environ)
        assert ours == expected


@pytest.mark.parametrize(("platform", "setting", "mode"), [
    ("local", "auto", "off"), ("k8s", "auto", "all"), ("local", "relaunched", "relaunched"), ("k8s", "off", "off"),
])
def test_auto_health_checks_every_node_on_kubernetes_and_none_on_one_machine(workdir: Path, platform: str,
                                                                            setting: str, mode: str) -> None:
    config = parse(workdir, "--set", f"health_check={setting}", "train.py")
    assert health_mode(dataclasses.replace(config, platform=platform)) == mode
