"""What ``stead run`` was asked to do, typed: the spec the master, the agents and the platforms read.

:class:`RunConfig` is built once from the command line (:func:`stead.cli.run_args.parse_run_args`); a node's
agent gets it as data (:func:`spec_text` in ``STEAD_RUN_SPEC``, read back by :func:`read_spec`), never argv.
:func:`worker_env` gives each worker exactly the environment torch's ``LocalElasticAgent`` gives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import re
from collections.abc import Mapping

from stead.core.config import Settings
from stead.core.errors import CodecError, ConfigError, InvalidRequest
from stead.core.serde import from_json, to_json

__all__ = ["RUN_SPEC_ENV", "SETTING_NAME", "RunConfig", "Streams", "gpu_count", "read_spec", "spec_text",
           "worker_env"]

#: the variable a node's agent finds its job's :class:`RunConfig` in (:func:`spec_text`), set by whoever starts it
RUN_SPEC_ENV = "STEAD_RUN_SPEC"

#: a setting's name: stead's own (heartbeat_timeout_s) or a plugin's or platform's, after its namespace
#: (ckpt.keep_last, k8s.image)
SETTING_NAME = re.compile(r"[a-z][a-z0-9_.]*")

class Streams(enum.IntFlag):
    """Which standard streams of a worker go to a log file (torchrun's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything ``stead run`` was asked to do, validated and typed."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    #: how many times a lost or killed node is relaunched (JobSubmitted.max_node_relaunches)
    max_node_relaunches: int
    #: the nodes to start with (--start-nodes, capped by capacity_nodes); None: MAX
    start_nodes: int | None
    monitor_interval_s: float
    join_timeout_s: float
    last_call_timeout_s: float
    #: the argv each worker runs: ``(python, "-u", script, *args)``, with ``-m``, or ``(script, *args)``
    entrypoint: tuple[str, ...]
    training_script: str
    training_script_args: tuple[str, ...]
    module: bool
    no_python: bool
    run_path: bool
    rdzv_backend: str
    rdzv_endpoint: str
    #: torchrun's run id, reported to workers as TORCHELASTIC_RUN_ID: ``--rdzv-id``, else the job name
    rdzv_id: str
    rdzv_conf: Mapping[str, str]
    standalone: bool
    node_rank: int
    master_addr: str
    #: None: stead picks a free port
    master_port: int | None
    local_addr: str | None
    role: str
    log_dir: str | None
    #: per local rank, which streams go to a file in ``log_dir``
    redirects: tuple[Streams, ...]
    #: per local rank, which streams go to a file and to the console
    tee: tuple[Streams, ...]
    #: local ranks whose console output is shown; empty: all
    local_ranks_filter: frozenset[int]
    store_url: str
    platform: str
    #: plugins to run: None = every installed one
    plugins: tuple[str, ...] | None
    #: plugins not to run
    disabled_plugins: tuple[str, ...]
    job_name: str
    #: resume a job of this name even though its shape or script changed
    force: bool
    #: the ``name=value`` overrides given (``--set`` and the mapped ``--rdzv-conf`` keys)
    settings_overrides: Mapping[str, str]
    #: Settings from ``STEAD_*`` environment variables with the overrides applied
    settings: Settings
    log_format: str
    log_level: str
    #: None: as OpenTelemetry's OTEL_* variables say
    trace: str | None
    #: ``HOST:PORT`` where the job's master serves when the job spans several machines (torchrun's multi-node
    #: flags, each host running `stead run`); "": every node runs on this machine
    hosts_endpoint: str = ""
    #: the ``stead run`` arguments as given (the Slurm platform starts the same command on every host)
    argv: tuple[str, ...] = ()


def gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """NVIDIA GPUs this process can use (NVML, limited by CUDA_VISIBLE_DEVICES); 0 without GPU or driver."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        count = 0
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count
    # CUDA stops at the first empty or negative entry: "0,1,-1,2" makes two devices visible
    listed = 0
    for entry in visible.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        listed += 1
    return min(count, listed)


def worker_env(
    config: RunConfig,
    *,
    local_rank: int,
    node_rank: int,
    nnodes: int,
    restart_count: int,
    master_addr: str,
    master_port: int,
    world_size: int,
    run_id: str,
    group_world_size: int | None = None,
    local_world_size: int | None = None,
    base_rank: int | None = None,
    error_file: str = "",
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables torch's LocalElasticAgent sets for one worker, set over the inherited environment.

    ``node_rank`` is this node's rank in the round (GROUP_RANK) and ``nnodes`` the number of nodes in
    it (GROUP_WORLD_SIZE unless ``group_world_size`` says otherwise). The worker's global rank is
    ``base_rank + local_rank``, ``base_rank`` defaulting to ``node_rank * local_world_size`` (same
    worker count on every node). ``environ`` (default ``os.environ``) is the agent's environment, read
    for the variables torchrun passes through (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES,
    TORCH_NCCL_ASYNC_ERROR_HANDLING). Workers connect to the store at MASTER_ADDR:MASTER_PORT
    (TORCHELASTIC_USE_AGENT_STORE=True) instead of rank 0 hosting one.
    """
    env = os.environ if environ is None else environ
    nlocal = config.nproc_per_node if local_world_size is None else local_world_size
    ngroup = nnodes if group_world_size is None else group_world_size
    rank = (node_rank * nlocal if base_rank is None else base_rank) + local_rank
    if not 0 <= local_rank < nlocal:
        raise InvalidRequest(f"local rank {local_rank} is outside 0..{nlocal - 1}; pass a rank below the "
                             "local world size")
    if not 0 <= node_rank < ngroup:
        raise InvalidRequest(f"node rank {node_rank} is outside 0..{ngroup - 1}; pass a rank below the node count")
    if not 0 <= rank < world_size:
        raise InvalidRequest(f"global rank {rank} is outside the world of {world_size}; check world_size and "
                             "base_rank")
    result = {
        "RANK": str(rank),
        "GROUP_RANK": str(node_rank),
        "ROLE_RANK": str(rank),  # one role: the role rank is the global rank
        "ROLE_NAME": config.role,
        "LOCAL_WORLD_SIZE": str(nlocal),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(ngroup),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LOCAL_RANK": str(local_rank),
    }
    if "CUDA_VISIBLE_DEVICES" in env:
        result["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
    # torchrun sets OMP_NUM_THREADS=1 for more than one worker per node unless the user chose a value
    if "OMP_NUM_THREADS" in env:
        result["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"]
    elif config.nproc_per_node > 1:
        result["OMP_NUM_THREADS"] = "1"
    result["TORCHELASTIC_ERROR_FILE"] = error_file
    return result


def spec_text(config: RunConfig) -> str:
    """``config`` as a node's agent gets it: JSON of every field but ``settings``, which each agent resolves from
    its own ``STEAD_*`` variables and the spec's ``settings_overrides`` (:func:`read_spec`)."""
    data = to_json(config)
    del data["settings"]
    return json.dumps(data, separators=(",", ":"))


def read_spec(text: str | None, *, environ: Mapping[str, str] | None = None) -> RunConfig:
    """The :class:`RunConfig` :func:`spec_text` wrote, its settings resolved from ``environ`` (default
    ``os.environ``); ConfigError saying what is wrong when it is missing or malformed."""
    where = "`stead agent` is started by `stead run` or a platform, which sets it to the job's run spec"
    if not text:
        raise ConfigError(f"{RUN_SPEC_ENV} is not set; {where}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{RUN_SPEC_ENV} is not JSON ({exc}); {where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{RUN_SPEC_ENV} is not a JSON object; {where}")
    try:
        overrides = from_json(dict[str, str], data.get("settings_overrides", {}), path="settings_overrides")
        settings = Settings.from_mapping(overrides, base=Settings.from_env(os.environ if environ is None else environ))
        return from_json(RunConfig, {**data, "settings": to_json(settings)})
    except CodecError as exc:
        raise ConfigError(f"{RUN_SPEC_ENV} does not hold a run spec ({exc}); {where} (with the "
                          "same stead version as the agent's)") from None
