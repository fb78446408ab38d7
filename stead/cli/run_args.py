"""The command line of ``stead run``: torchrun's flags with torchrun's meaning.

A user switching from ``torchrun`` keeps the command line: every torchrun flag
stead honours is accepted in both spellings (``--nproc-per-node`` and
``--nproc_per_node``), with torchrun's default and its ``PET_<NAME>``
environment fallback (which Kubeflow's PyTorchJob relies on); under ``srun`` the Slurm
job step gives the multi-node flags' defaults (:mod:`stead.cli.slurm_env`). stead adds its own
flags (store, platform, job name, settings). :func:`parse_run_args` validates
everything up front and raises :class:`~stead.core.errors.ConfigError` with a
one-line message. What it returns, :class:`~stead.core.runspec.RunConfig`, is the typed spec the master, the
agents and the platforms read.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Mapping, Sequence

import structlog

from stead.cli.slurm_env import (
    HOST_STEP_ENV,
    SlurmAllocation,
    check_nnodes,
    flag_defaults,
    platform_allocation,
    rendezvous,
    slurm_allocation,
    slurm_step,
)
from stead.core.config import Settings
from stead.core.entrypoints import installed
from stead.core.errors import ConfigError
from stead.core.logging import LOG_LEVELS, TRACE_CHOICES, TRACE_HELP
from stead.core.plugins import GROUP as PLUGIN_GROUP
from stead.core.plugins import PLATFORM_GROUP, check_plugin_settings
from stead.core.runspec import SETTING_NAME, RunConfig, Streams, gpu_count

__all__ = ["PLATFORM_GROUP", "build_parser", "parse_run_args", "parse_setting", "parse_settings"]

log = structlog.get_logger()

#: ``--rdzv-conf`` keys that set a stead setting (torch key -> Settings field)
RDZV_CONF_SETTINGS: Mapping[str, str] = {
    "join_timeout": "join_timeout_s",
    "last_call_timeout": "last_call_timeout_s",
    "heartbeat": "heartbeat_timeout_s",
    "keep_alive_interval": "heartbeat_interval_s",
}
#: ``--rdzv-conf`` keys torch's rendezvous backends read that mean nothing to stead: accepted, ignored
RDZV_CONF_IGNORED = frozenset({"close_timeout", "is_host", "keep_alive_max_attempt", "read_timeout",
                               "store_type", "timeout"})

_JOB_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_STORE_URL = re.compile(r"[a-z][a-z0-9+.-]*://.*")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``stead run`` parser; torchrun flags default to ``PET_<NAME>`` from ``environ`` like torchrun."""
    parser = argparse.ArgumentParser(
        prog="stead run",
        description="Run a distributed PyTorch training script that survives failures. "
                    "Accepts torchrun's flags with torchrun's meaning; `torchrun ARGS` becomes `stead run ARGS`. "
                    "Under srun (one task per node) the Slurm step gives the multi-node flags: `srun stead run "
                    "train.py` is one job over the step's nodes, its first node serving the job's master "
                    "(--rdzv-backend c10d); flags given on the command line win.",
        allow_abbrev=False,
    )
    torch_flags = parser.add_argument_group(
        "torchrun-compatible options", "same spelling, meaning and default as torchrun; "
        "each can also be given as the environment variable PET_<NAME> (e.g. PET_NPROC_PER_NODE)")
    _add_torchrun_flags(torch_flags)
    torch_dests = {action.dest for action in torch_flags._group_actions}
    stead_flags = parser.add_argument_group("stead options")
    _add_stead_flags(stead_flags)
    parser.add_argument("training_script",
                        help="the training script (or module with -m, or program with --no-python) every worker runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER,
                        help="arguments passed to the training script unchanged")
    env = os.environ if environ is None else environ
    step = slurm_step(env)
    if step is not None:  # under srun: the step's nodes are the job's (torchrun's PET_* and flags still win)
        parser.set_defaults(**flag_defaults(step))
    allocation = slurm_allocation(env) if step is None else None
    if allocation is not None and len(allocation.nodes) > 1:  # the Slurm platform's, unless flags say otherwise
        parser.set_defaults(nnodes=str(len(allocation.nodes)), rdzv_id=f"slurm-{allocation.job_id}")
    _apply_env_defaults(parser, torch_dests, env)
    return parser


def _add_torchrun_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--nnodes", default="1:1", metavar="N|MIN:MAX",
        help="number of nodes, or the elastic range MIN:MAX; the job runs with any count in the range (default 1:1)")
    add("--nproc-per-node", "--nproc_per_node", default="1", metavar="N|auto|cpu|gpu",
        help="worker processes per node: a number, 'gpu' (one per GPU), 'cpu' (one per CPU), "
             "or 'auto' (one per GPU, else one per CPU) (default 1)")
    add("--rdzv-backend", "--rdzv_backend", default="static",
        help="static: node ranks given on each host (--node-rank, --master-addr); c10d: with --rdzv-endpoint, "
             "the job's master serves at the endpoint and assigns node ranks; etcd: with --rdzv-endpoint (an etcd "
             "server), every host's `stead run` is a master candidate, one elected, the others hot standbys "
             "(default static)")
    add("--rdzv-endpoint", "--rdzv_endpoint", default="", metavar="HOST[:PORT]",
        help="with --rdzv-backend c10d and more than one node: where the job's master serves (port 29400 when "
             "left out); the host whose address it is runs the master, every host one node. With --rdzv-backend "
             "etcd: the etcd server that keeps the job and elects its master (port 2379 when left out)")
    add("--rdzv-id", "--rdzv_id", default="none",
        help="the run id workers see as TORCHELASTIC_RUN_ID; also the job name when --job-name is not given")
    add("--rdzv-conf", "--rdzv_conf", default="", metavar="KEY=VALUE,...",
        help="rendezvous settings: join_timeout (s, wait this long for MIN nodes), last_call_timeout "
             "(s, then wait this long for more, up to MAX), heartbeat (s, a silent node is lost after this), "
             f"keep_alive_interval (s); torch's {', '.join(sorted(RDZV_CONF_IGNORED))} are accepted and ignored")
    add("--standalone", action="store_true",
        help="single-node job with a local store; needs --nnodes 1 (the default) and ignores the --rdzv-* options")
    add("--max-restarts", "--max_restarts", type=int, default=0, metavar="N",
        help="restart the workers at most N times after failures before the job fails (default 0)")
    add("--max-node-relaunches", "--max_node_relaunches", type=int, default=3, metavar="N",
        help="relaunch a lost or killed node (a new agent) at most N times before the job goes on without it, "
             "or fails below the minimum node count (default 3)")
    add("--start-nodes", "--start_nodes", type=int, default=None, metavar="N",
        help="with --nnodes MIN:MAX, start on N nodes (default MAX, or fewer when --set capacity_nodes caps it); "
             "`stead scale --job NAME --nodes N` changes it while the job runs")
    add("--monitor-interval", "--monitor_interval", type=float, default=0.1, metavar="SECONDS",
        help="accepted for torchrun compatibility and ignored: stead's agent learns of a worker's exit at once "
             "(it waits on the process, it does not poll)")
    add("--start-method", "--start_method", default="spawn", choices=("spawn", "fork", "forkserver"),
        help="accepted for torchrun compatibility and ignored: stead always starts workers as new processes")
    add("--role", default="default", help="role name of the workers, seen as ROLE_NAME (default 'default')")
    add("-m", "--module", action="store_true",
        help="run the training script as a module, like 'python -m' (give a module name, not a .py path)")
    add("--no-python", "--no_python", action="store_true",
        help="run the training script as a program, without prepending 'python'")
    add("--run-path", "--run_path", action="store_true",
        help="run the training script file by path as __main__ (like runpy.run_path); takes precedence "
             "over --no-python")
    add("--log-dir", "--log_dir", default=None, metavar="DIR",
        help="directory for redirected worker output and error files")
    add("-r", "--redirects", default="0", metavar="STD|RANK:STD,...",
        help="send worker streams to files in --log-dir: 0 none, 1 stdout, 2 stderr, 3 both; "
             "or per local rank, e.g. 0:1,1:2 (default 0)")
    add("-t", "--tee", default="0", metavar="STD|RANK:STD,...",
        help="like --redirects, but also copy the stream to the console (default 0)")
    add("--local-ranks-filter", "--local_ranks_filter", default="", metavar="RANK,...",
        help="show console output of these local ranks only, e.g. 0,1 (default: all)")
    add("--node-rank", "--node_rank", type=int, default=None, metavar="RANK",
        help="rank of this host's node in a static rendezvous over several hosts: rank 0 runs the job's master at "
             "--master-addr:--master-port, the others join it (default 0)")
    add("--master-addr", "--master_addr", default=None, metavar="HOST",
        help="with --nnodes N over several hosts: the address of the host of node rank 0, where the job's master "
             "serves (default 127.0.0.1)")
    add("--master-port", "--master_port", type=int, default=None, metavar="PORT",
        help="with --nnodes N over several hosts: the port the job's master serves on (default 29500)")
    add("--local-addr", "--local_addr", default=None, metavar="HOST",
        help="address of this node as other nodes reach it (default: its host name)")
    add("--shutdown-timeout", "--shutdown_timeout", type=float, default=None, metavar="SECONDS",
        help="grace between SIGTERM and SIGKILL when workers are stopped (the worker_stop_grace_s setting)")


def _add_stead_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--store", default=None, metavar="URL",
        help="state store: sqlite:///PATH (default sqlite:///.stead/<job>.db), etcd://HOST:PORT, or memory://")
    add("--platform", default="local", metavar="NAME",
        help="where nodes run: 'local' (processes on this machine); 'slurm' (the nodes of the Slurm job this "
             "runs in, each an srun step of its own, the nodes beyond --nnodes warm spares: the default in an "
             "sbatch script or salloc shell holding several nodes); other platforms install their own "
             "(default local)")
    add("--plugins", default=None, metavar="NAME,...",
        help="run only these master plugins, each of which must be installed (default: every installed one); "
             "e.g. --plugins ckpt,sharding")
    add("--no-plugin", action="append", default=[], metavar="NAME", dest="no_plugin",
        help="do not run this plugin (repeatable), e.g. --no-plugin diagnosis")
    add("--job-name", default=None, metavar="NAME",
        help="job name (lowercase letters, digits and '-'; at most 63); default: --rdzv-id or a generated one. "
             "A job that ran before under this name (ended, failed, stopped, or its `stead run` died) is resumed: "
             "its workers restore its newest checkpoint and data cursor")
    add("--force", action="store_true",
        help="resume the job named by --job-name even though --nnodes, --nproc-per-node or the script and its "
             "arguments differ from its last run")
    add("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
        help="override a stead setting, e.g. --set heartbeat_timeout_s=10 (repeatable)")
    add("--log-format", default="console", choices=("console", "json"),
        help="format of stead's own logs (default console)")
    add("--log-level", default="info", choices=LOG_LEVELS, metavar="LEVEL",
        help="lowest level of stead's own log lines, in every process of the job: debug, info, warning or "
             "error (default info)")
    add("--quiet", "-q", action="store_true",
        help="only warnings, errors and the final summary (as --log-level warning)")
    add("--trace", default=None, choices=TRACE_CHOICES, help=TRACE_HELP)


def _apply_env_defaults(parser: argparse.ArgumentParser, dests: set[str], environ: Mapping[str, str]) -> None:
    """torchrun's ``PET_<DEST>`` fallback: a set variable replaces the flag's default."""
    for action in parser._actions:
        if action.dest not in dests:
            continue
        name = f"PET_{action.dest.upper()}"
        raw = environ.get(name)
        if raw is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            try:
                action.default = bool(int(raw))
            except ValueError:
                raise ConfigError(f"environment variable {name}={raw!r} must be 0 or 1; fix or unset it") from None
        else:
            action.default = raw  # a string default goes through the flag's type conversion when parsed


def parse_run_args(argv: Sequence[str], *, environ: Mapping[str, str] | None = None,
                   cwd: str | None = None) -> RunConfig:
    """Parse and validate ``stead run`` arguments; a bad value raises ConfigError with a one-line message.

    ``environ`` (default ``os.environ``) supplies ``PET_*`` defaults, ``STEAD_*`` settings and
    ``PYTHON_EXEC``; ``cwd`` (default the current directory) is where the training script is looked up.
    """
    env = os.environ if environ is None else environ
    workdir = os.getcwd() if cwd is None else cwd
    ns = build_parser(env).parse_args(list(argv))

    min_nodes, max_nodes = _parse_nnodes(ns.nnodes)
    step = slurm_step(env)
    if step is not None and not ns.standalone:
        check_nnodes(step, min_nodes)
        ns.rdzv_backend, ns.rdzv_endpoint, ns.master_addr = rendezvous(
            step, backend=ns.rdzv_backend, endpoint=ns.rdzv_endpoint, node_rank=ns.node_rank,
            master_addr=ns.master_addr, master_port=ns.master_port)
    slurm = _slurm_allocation(ns, env, step is not None, min_nodes)
    if ns.standalone and (min_nodes, max_nodes) != (1, 1):
        raise ConfigError(f"--standalone runs a single node but --nnodes is {ns.nnodes!r}; "
                          "drop --nnodes or drop --standalone")
    nproc = _parse_nproc_per_node(ns.nproc_per_node, env)
    _check_at_least(ns.max_restarts, 0, "--max-restarts")
    _check_at_least(ns.max_node_relaunches, 0, "--max-node-relaunches")
    if not ns.monitor_interval > 0:
        raise ConfigError(f"--monitor-interval must be positive, got {ns.monitor_interval}")
    node_rank = 0 if ns.node_rank is None else ns.node_rank
    _check_at_least(node_rank, 0, "--node-rank")
    if node_rank >= max_nodes:
        raise ConfigError(f"--node-rank {node_rank} is out of range for --nnodes {ns.nnodes!r}; "
                          f"use a rank below {max_nodes}")
    if ns.master_port is not None and not 0 < ns.master_port < 65536:
        raise ConfigError(f"--master-port {ns.master_port} is not a TCP port; use 1-65535 or leave it out")

    entrypoint = _entrypoint(ns, env, workdir)
    redirects = _parse_streams(ns.redirects, "--redirects", nproc)
    tee = _parse_streams(ns.tee, "--tee", nproc)
    ranks_filter = _parse_ranks_filter(ns.local_ranks_filter)

    rdzv_conf = _parse_rdzv_conf(ns.rdzv_conf)
    overrides = _settings_overrides(rdzv_conf, ns.settings, ns.shutdown_timeout)
    settings = Settings.from_mapping(overrides, base=Settings.from_env(env))
    check_plugin_settings(settings)
    if ns.platform != SLURM_PLATFORM:  # (not an entry point: `stead run` sets it up itself)
        _check_platform(ns.platform)
    plugins, disabled = parse_plugins(ns.plugins, ns.no_plugin)
    start_nodes = _start_nodes(ns.start_nodes, min_nodes, max_nodes, settings.capacity_nodes)

    job_name = _job_name(ns.job_name, ns.rdzv_id, ns.training_script)
    rdzv_id = ns.rdzv_id if ns.rdzv_id not in ("", "none") else job_name
    if ns.standalone:
        rdzv_backend, rdzv_endpoint = "c10d", "localhost:0"
    else:
        rdzv_backend, rdzv_endpoint = ns.rdzv_backend, ns.rdzv_endpoint
    hosts_endpoint = "" if ns.standalone else _hosts_endpoint(ns, min_nodes, max_nodes)
    if slurm is not None:  # this host serves the job's master; the Slurm platform starts a host step on every node
        hosts_endpoint = _hostport(slurm.here or socket.gethostname(), ns.master_port or slurm.port)
        rdzv_backend, rdzv_endpoint = "c10d", hosts_endpoint
    store_url = ns.store if ns.store is not None else f"sqlite:///.stead/{job_name}.db"
    if hosts_endpoint and rdzv_backend in ELECTED_BACKENDS and ns.store is None:
        store_url = f"etcd://{hosts_endpoint}"  # the job's log lives where its hosts elect its master
    if not _STORE_URL.fullmatch(store_url):
        raise ConfigError(f"--store {store_url!r} is not a URL; use sqlite:///PATH, etcd://HOST:PORT or memory://")
    platform = ns.platform
    if slurm is not None:
        platform = SLURM_PLATFORM
    elif hosts_endpoint:
        if ns.platform != "local":
            raise ConfigError(f"torchrun's multi-node flags run one job over several machines, each running `stead "
                              f"run`; --platform {ns.platform} starts the nodes itself: drop --node-rank, "
                              "--master-addr and --rdzv-endpoint, or drop --platform")
        platform = HOSTS_PLATFORM

    return RunConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        max_restarts=ns.max_restarts,
        max_node_relaunches=ns.max_node_relaunches,
        start_nodes=start_nodes,
        monitor_interval_s=ns.monitor_interval,
        join_timeout_s=settings.join_timeout_s,
        last_call_timeout_s=settings.last_call_timeout_s,
        entrypoint=entrypoint,
        training_script=ns.training_script,
        training_script_args=tuple(ns.training_script_args),
        module=ns.module,
        no_python=ns.no_python,
        run_path=ns.run_path,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf,
        standalone=ns.standalone,
        node_rank=node_rank,
        master_addr=ns.master_addr or "127.0.0.1",
        master_port=ns.master_port,
        local_addr=ns.local_addr,
        role=ns.role,
        log_dir=ns.log_dir,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ranks_filter,
        store_url=store_url,
        platform=platform,
        argv=tuple(argv),
        hosts_endpoint=hosts_endpoint,
        plugins=plugins,
        disabled_plugins=disabled,
        job_name=job_name,
        force=ns.force,
        settings_overrides=overrides,
        settings=settings,
        log_format=ns.log_format,
        log_level="warning" if ns.quiet else ns.log_level,
        trace=ns.trace,
    )


def _check_platform(name: str) -> None:
    platforms = installed(PLATFORM_GROUP)
    if name in platforms:
        return
    raise ConfigError(f"--platform {name!r} is not installed (installed: {', '.join(platforms) or 'none'}; and "
                      f"{SLURM_PLATFORM} in a Slurm job); pick one of them")


def parse_plugins(enabled: str | None, disabled: Sequence[str]) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    names = installed(PLUGIN_GROUP)
    off = tuple(n.strip() for item in disabled for n in item.split(",") if n.strip())
    wanted = None if enabled is None else tuple(n.strip() for n in enabled.split(",") if n.strip())
    for flag, listed in (("--plugins", wanted or ()), ("--no-plugin", off)):
        unknown = [n for n in listed if n not in names]
        if unknown:
            raise ConfigError(f"{flag}: plugin(s) {', '.join(map(repr, unknown))} not installed (installed: "
                              f"{', '.join(names) or 'none'}); install the package that provides them or leave "
                              "them out")
    return wanted, off


def _check_at_least(value: int, minimum: int, flag: str) -> None:
    if value < minimum:
        raise ConfigError(f"{flag} must be at least {minimum}, got {value}")


def _start_nodes(start: int | None, min_nodes: int, max_nodes: int, capacity: int) -> int | None:
    """The nodes to start with: --start-nodes (within MIN:MAX), capped by capacity_nodes; None: MAX."""
    if start is not None and not min_nodes <= start <= max_nodes:
        raise ConfigError(f"--start-nodes {start} is outside --nnodes {min_nodes}:{max_nodes}; give a count within "
                          "MIN:MAX")
    if capacity and capacity < min_nodes:
        raise ConfigError(f"capacity_nodes={capacity} is below the job's minimum of {min_nodes} nodes; raise "
                          "capacity_nodes or lower --nnodes MIN")
    if capacity and capacity < (start or max_nodes):
        return capacity
    return start


def _parse_nnodes(value: str) -> tuple[int, int]:
    parts = value.split(":")
    if len(parts) > 2 or not all(re.fullmatch(r"\s*-?\d+\s*", p) for p in parts):
        raise ConfigError(f"--nnodes {value!r} is not a node count; use N or MIN:MAX, e.g. --nnodes 2 or --nnodes 1:4")
    min_nodes, max_nodes = int(parts[0]), int(parts[-1])
    if min_nodes < 1:
        raise ConfigError(f"--nnodes {value!r}: the minimum number of nodes must be at least 1")
    if min_nodes > max_nodes:
        raise ConfigError(f"--nnodes {value!r}: MIN {min_nodes} is larger than MAX {max_nodes}; use MIN:MAX with "
                          "MIN <= MAX")
    return min_nodes, max_nodes


def _parse_nproc_per_node(value: str, environ: Mapping[str, str]) -> int:
    if re.fullmatch(r"\s*-?\d+\s*", value):
        count = int(value)
        if count < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {count}")
        return count
    if value == "cpu":
        return _cpu_count()
    if value == "gpu":
        gpus = gpu_count(environ)
        if gpus == 0:
            raise ConfigError("--nproc-per-node gpu: no GPU found on this machine (NVML reports none); "
                              "use --nproc-per-node N or cpu")
        return gpus
    if value == "auto":
        return gpu_count(environ) or _cpu_count()
    raise ConfigError(f"--nproc-per-node {value!r} is not supported; use a number, auto, cpu or gpu")


def _cpu_count() -> int:
    # like torch._utils.cpu_count: the CPUs this process may run on, not all CPUs of the machine
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _entrypoint(ns: argparse.Namespace, environ: Mapping[str, str], cwd: str) -> tuple[str, ...]:
    script: str = ns.training_script
    args = tuple(ns.training_script_args)
    python = environ.get("PYTHON_EXEC", sys.executable)
    if ns.module and ns.no_python:
        raise ConfigError("--module and --no-python cannot be used together; use one of them")
    if ns.module and ns.run_path:
        raise ConfigError("--module and --run-path cannot be used together: --run-path runs a file; use one of them")
    if ns.module:
        if script.endswith(".py") or os.sep in script:
            raise ConfigError(f"-m/--module expects a module name like 'pkg.train', not the path {script!r}; "
                              "drop -m to run a file")
        return (python, "-u", "-m", script, *args)
    if ns.no_python and not ns.run_path:
        if os.sep in script:
            if not os.access(os.path.join(cwd, script), os.X_OK):
                raise ConfigError(f"--no-python: program {script!r} not found or not executable (cwd {cwd}); "
                                  "check the path")
        elif shutil.which(script, path=environ.get("PATH")) is None:
            raise ConfigError(f"--no-python: program {script!r} not found on PATH; give its path")
        return (script, *args)
    path = os.path.join(cwd, script)
    if not os.path.isfile(path):
        raise ConfigError(f"training script {script!r} not found (cwd {cwd}); give a path relative to the current "
                          "directory or an absolute one, or use -m for a module")
    if ns.run_path:
        return (python, "-u", os.path.abspath(path), *args)
    return (python, "-u", script, *args)


def _parse_streams(value: str, flag: str, nproc: int) -> tuple[Streams, ...]:
    text = value.strip()
    if re.fullmatch(r"\d+", text):
        return (_stream(text, flag, value),) * nproc
    per_rank = [Streams.NONE] * nproc
    for item in text.split(","):
        rank_text, sep, std_text = item.partition(":")
        if not sep or not re.fullmatch(r"\s*\d+\s*", rank_text) or not re.fullmatch(r"\s*\d+\s*", std_text):
            raise ConfigError(f"{flag} {value!r} is not valid; use 0-3 (0 none, 1 stdout, 2 stderr, 3 both) "
                              "or LOCAL_RANK:VALUE pairs like 0:1,1:2")
        rank = int(rank_text)
        if rank >= nproc:
            raise ConfigError(f"{flag} {value!r} names local rank {rank} but there are {nproc} per node; "
                              f"use local ranks 0-{nproc - 1}")
        per_rank[rank] = _stream(std_text, flag, value)
    return tuple(per_rank)


def _stream(text: str, flag: str, value: str) -> Streams:
    number = int(text)
    if not 0 <= number <= 3:
        raise ConfigError(f"{flag} {value!r}: {number} is out of range; use 0 none, 1 stdout, 2 stderr, 3 both")
    return Streams(number)


def _parse_ranks_filter(value: str) -> frozenset[int]:
    if not value.strip():
        return frozenset()
    items = [v.strip() for v in value.split(",")]
    if not all(v.isdigit() for v in items):
        raise ConfigError(f"--local-ranks-filter {value!r} must be comma-separated local ranks, e.g. 0,1,2")
    return frozenset(int(v) for v in items)


def _parse_rdzv_conf(value: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    if not value.strip():
        return conf
    known = sorted((*RDZV_CONF_SETTINGS, *RDZV_CONF_IGNORED))
    for item in value.split(","):
        key, _, raw = (part.strip() for part in item.partition("="))
        if not key or not raw:
            raise ConfigError(f"--rdzv-conf {value!r} is not valid; use KEY=VALUE,KEY=VALUE, "
                              "e.g. join_timeout=600,last_call_timeout=30")
        if key not in RDZV_CONF_SETTINGS and key not in RDZV_CONF_IGNORED:
            raise ConfigError(f"--rdzv-conf: unknown key {key!r}; known keys: {', '.join(known)}")
        if key in RDZV_CONF_SETTINGS:
            try:
                seconds = float(raw)
            except ValueError:
                seconds = -1.0
            if not seconds > 0:
                raise ConfigError(f"--rdzv-conf {key}={raw!r} must be a positive number of seconds")
        else:
            log.warning("rdzv_conf_key_ignored", key=key, value=raw)
        conf[key] = raw
    return conf


def _settings_overrides(rdzv_conf: Mapping[str, str], assignments: Sequence[str],
                        shutdown_timeout: float | None) -> dict[str, str]:
    implied = {RDZV_CONF_SETTINGS[key]: (f"--rdzv-conf {key}", raw) for key, raw in rdzv_conf.items()
               if key in RDZV_CONF_SETTINGS}
    if shutdown_timeout is not None:
        implied["worker_stop_grace_s"] = ("--shutdown-timeout", str(shutdown_timeout))
    explicit = parse_settings(assignments)
    for name, (source, raw) in implied.items():
        if name in explicit and explicit[name] != raw:
            raise ConfigError(f"{source}={raw} and --set {name}={explicit[name]} disagree; give only one of them")
    return {**{name: raw for name, (_, raw) in implied.items()}, **explicit}


def parse_setting(assignment: str) -> tuple[str, str]:
    """The name and value of ``--set NAME=VALUE``, without the spaces around either; ConfigError for a name that
    is not one (:data:`SETTING_NAME`): lowercase letters, digits, '_' and '.', a letter first."""
    name, sep, raw = assignment.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(f"--set {assignment!r} is not NAME=VALUE; e.g. --set heartbeat_timeout_s=10")
    if not SETTING_NAME.fullmatch(name):
        raise ConfigError(f"--set {assignment!r}: {name!r} is not a setting's name; a name is lowercase letters, "
                          "digits, '_' and '.', starting with a letter, e.g. heartbeat_timeout_s or ckpt.keep_last")
    return name, raw.strip()


def parse_settings(assignments: Sequence[str]) -> dict[str, str]:
    """Every ``--set NAME=VALUE`` (:func:`parse_setting`) by name; a name given twice with different values is
    refused, never last-wins (a later ``--set`` must not quietly undo an earlier one, e.g. one the operator set)."""
    found: dict[str, str] = {}
    for assignment in assignments:
        name, raw = parse_setting(assignment)
        if found.get(name, raw) != raw:
            raise ConfigError(f"--set {name}={found[name]} and --set {name}={raw} disagree; give {name} once")
        found[name] = raw
    return found


#: the platform of a job over several machines (torchrun's multi-node flags; not an entry point: `stead run` sets
#: it up itself, see stead.cli.run)
HOSTS_PLATFORM = "hosts"
#: the Slurm platform's name (:mod:`stead.platforms.hosts.slurm`): the hosts platform, its hosts started as steps
SLURM_PLATFORM = "slurm"
#: torchrun's default ports: a static rendezvous's --master-port, a c10d --rdzv-endpoint's
STATIC_PORT, C10D_PORT = 29500, 29400
#: etcd's client port, where torchrun's etcd rendezvous looks when --rdzv-endpoint names no port
ETCD_PORT = 2379
#: the rendezvous backends whose hosts elect the job's master through etcd (torchrun's names)
ELECTED_BACKENDS = ("etcd", "etcd-v2")


def _hosts_endpoint(ns: argparse.Namespace, min_nodes: int, max_nodes: int) -> str:
    """``HOST:PORT`` where the job's master serves when the flags spread the job over several machines (torchrun's
    multi-node command lines); "" when every node runs on this machine (no such flag, or one node)."""
    backend, endpoint = ns.rdzv_backend, ns.rdzv_endpoint
    if max_nodes <= 1:
        return ""
    if backend == "static":
        if ns.node_rank is None and ns.master_addr is None:
            return ""  # --nnodes N alone: N nodes on this machine
        if min_nodes != max_nodes:
            raise ConfigError(f"a static rendezvous over several hosts needs a fixed node count, not --nnodes "
                              f"{ns.nnodes}: give --nnodes {max_nodes}, or use --rdzv-backend c10d --rdzv-endpoint "
                              "HOST:PORT for an elastic job")
        return _hostport(ns.master_addr or "127.0.0.1", ns.master_port or STATIC_PORT)
    if not endpoint and not (backend in ELECTED_BACKENDS and (ns.store or "").startswith("etcd://")):
        return ""  # no endpoint: every node on this machine
    if backend == "c10d":
        return _endpoint(endpoint)
    if backend in ELECTED_BACKENDS:
        return _etcd_endpoint(ns)
    raise ConfigError(f"--rdzv-backend {backend!r} is not one stead knows over several hosts: use static "
                      "(--node-rank, --master-addr) or c10d (--rdzv-endpoint)")


def _etcd_endpoint(ns: argparse.Namespace) -> str:
    """The etcd server of a job whose hosts elect its master (``--rdzv-backend etcd``): ``--rdzv-endpoint`` (as
    torchrun's etcd rendezvous takes it, port 2379 when left out), else ``--store etcd://HOST:PORT``'s first."""
    store = ns.store or ""
    if store and not store.startswith("etcd://"):
        raise ConfigError(f"--rdzv-backend {ns.rdzv_backend} keeps the job in etcd, but --store is {store!r}: drop "
                          "--store (the job goes to the etcd at --rdzv-endpoint) or give --store etcd://HOST:PORT")
    if not ns.rdzv_endpoint:
        return _endpoint(store.removeprefix("etcd://").split("/")[0].split("?")[0].split(",")[0],
                         default_port=ETCD_PORT)
    endpoint = _endpoint(ns.rdzv_endpoint, default_port=ETCD_PORT)
    if store and endpoint not in store:
        raise ConfigError(f"--rdzv-endpoint {ns.rdzv_endpoint} and --store {store} name different etcd servers: "
                          "give one of them")
    return endpoint


def _endpoint(text: str, *, default_port: int = 0) -> str:
    """``HOST:PORT`` from torchrun's ``--rdzv-endpoint`` (HOST, HOST:PORT, [V6], [V6]:PORT; port 29400 by default)."""
    host, port = text.strip(), str(default_port or C10D_PORT)
    if host.startswith("["):
        inside, _, rest = host[1:].partition("]")
        host, port = inside, rest[1:] if rest.startswith(":") else port
    elif host.count(":") == 1:
        host, port = host.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint {text!r} is not HOST:PORT (a port 1-65535); e.g. node0.example:29400")
    return _hostport(host, int(port))


def _slurm_allocation(ns: argparse.Namespace, env: Mapping[str, str], in_step: bool,
                      min_nodes: int) -> SlurmAllocation | None:
    """The allocation the Slurm platform runs the job on (:func:`~stead.cli.slurm_env.platform_allocation`); None
    for every other platform. A host step the platform started (:data:`HOST_STEP_ENV`) is one host of the job, not
    a Slurm platform of its own: its flags come from its master (``PET_*``), so ``--platform slurm`` in the command
    line it shares is dropped there."""
    if env.get(HOST_STEP_ENV):
        if ns.platform == SLURM_PLATFORM:
            ns.platform = "local"
        return None
    flagged = ns.rdzv_backend != "static" or bool(ns.rdzv_endpoint) or ns.node_rank is not None \
        or ns.master_addr is not None
    return platform_allocation(env, asked=ns.platform == SLURM_PLATFORM, default=ns.platform == "local",
                               in_step=in_step, standalone=ns.standalone, flagged=flagged, min_nodes=min_nodes)


def _hostport(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (as stead.core.rpc.address writes it; not imported: startup time)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _job_name(explicit: str | None, rdzv_id: str, script: str) -> str:
    if explicit is not None:
        if not _JOB_NAME.fullmatch(explicit):
            raise ConfigError(f"--job-name {explicit!r} is not valid; use lowercase letters, digits and '-', "
                              "starting and ending with a letter or digit, at most 63 characters")
        return explicit
    if rdzv_id not in ("", "none"):
        return _slug(rdzv_id, limit=63) or "job"
    stem = _slug(os.path.splitext(os.path.basename(script))[0], limit=30) or "job"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _slug(text: str, *, limit: int) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower())[:limit].strip("-")
