"""Run stead's control plane inside your own asyncio program: what a platform team embeds.

::

    import stead.embed as embed

    spec = embed.JobSpec(entrypoint=("train.py", "--steps", "100"), nproc_per_node=2, job_name="nightly",
                         store_url="sqlite:///runs/state.db", settings={"heartbeat_timeout_s": 10})
    async with embed.run(spec) as job:
        running = await job.wait(embed.JobPhase.RUNNING)
        print(running.rdzv.members)
        final = await job.wait()            # the job ended: SUCCEEDED, FAILED or STOPPED
        print(final.phase, final.reason)

:class:`JobSpec` holds what `stead run`'s flags say, typed; :func:`run` starts a
master for it (store, plugins, RPC server, platform) and submits the job (or
resumes it, when its store already holds it); :class:`Job` is the handle: the
state, waiting for a phase or any condition, resizing within MIN:MAX
(:meth:`Job.scale`, what `stead scale` does), stopping. Leaving the block stops
the master and the nodes it launched. Bad input raises
:class:`~stead.core.errors.ConfigError` before anything starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from stead.cli.run import started_job
from stead.cli.run_args import parse_run_args
from stead.core.events import JobStopped
from stead.core.master import Master, MasterConfig
from stead.core.rpc import client_tls
from stead.core.runspec import RunConfig
from stead.core.statemachine import JobPhase, JobState, NodePhase, NodeState
from stead.plugins.scaler.client import ScaleResult, request_scale

__all__ = ["Job", "JobPhase", "JobSpec", "JobState", "Master", "MasterConfig", "NodePhase", "NodeState", "ScaleResult",
           "run"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A job as `stead run` describes it; every field is one of its flags."""

    #: the training script and its arguments (a module name with ``module=True``)
    entrypoint: Sequence[str]
    #: nodes: a count, or an elastic range ``"MIN:MAX"``
    nnodes: int | str = 1
    nproc_per_node: int | str = 1
    max_restarts: int = 0
    job_name: str | None = None
    #: ``sqlite:///path``, ``etcd://host:port`` or ``memory://`` (default: ``sqlite:///.stead/<job>.db``)
    store_url: str | None = None
    platform: str = "local"
    #: ``--set`` values: stead's settings and plugins' (``"ckpt.keep_last": 3``)
    settings: Mapping[str, str | int | float | bool] = dataclasses.field(default_factory=dict)
    #: plugins to run (None: every installed one) and plugins not to run
    plugins: Sequence[str] | None = None
    disabled_plugins: Sequence[str] = ()
    module: bool = False
    #: any other `stead run`/torchrun flags, verbatim (e.g. ``("--log-dir", "logs")``)
    extra_args: Sequence[str] = ()

    def to_argv(self) -> list[str]:
        """The `stead run` arguments this spec stands for."""
        argv = ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node),
                "--max-restarts", str(self.max_restarts), "--platform", self.platform]
        if self.job_name is not None:
            argv += ["--job-name", self.job_name]
        if self.store_url is not None:
            argv += ["--store", self.store_url]
        for name, value in self.settings.items():
            argv += ["--set", f"{name}={value}"]
        if self.plugins is not None:
            argv += ["--plugins", ",".join(self.plugins)]
        for name in self.disabled_plugins:
            argv += ["--no-plugin", name]
        if self.module:
            argv.append("--module")
        return [*argv, *self.extra_args, *self.entrypoint]


class Job:
    """A running job's handle (see :func:`run`)."""

    def __init__(self, config: RunConfig, master: Master) -> None:
        self.config = config
        self.master = master

    @property
    def name(self) -> str:
        return self.config.job_name

    @property
    def state(self) -> JobState:
        """The job's state now."""
        return self.master.state

    @property
    def phase(self) -> JobPhase:
        return self.master.state.phase

    @property
    def address(self) -> str:
        """The master's RPC address (agents started by hand connect here)."""
        return self.master.address

    async def wait(self, until: JobPhase | Callable[[JobState], bool] | None = None, *,
                   timeout_s: float | None = None) -> JobState:
        """The state once the job is in phase ``until`` (or ended), ``until(state)`` holds, or (None) it ended."""
        return await self.master.wait(until, timeout_s=timeout_s)

    async def scale(self, nodes: int, *, reason: str = "", by: str = "the embedding program") -> ScaleResult:
        """Ask for ``nodes`` nodes (within MIN:MAX), as `stead scale` does: the scaler's policy decides the
        target, which the result holds; a refusal (out of range, the job ended) raises InvalidRequest."""
        return await request_scale(self.master.address, self.master.token, nodes=nodes, by=by, reason=reason,
                                   timeout_s=self.master.settings.rpc_timeout_s, tls=client_tls(self.master.settings))

    async def stop(self, reason: str = "stopped by the embedding program") -> JobState:
        """Stop the job (its workers are told to stop; ``job.stopped`` is recorded) and wait until it ended."""
        if not self.phase.terminal:
            await self.master.submit(JobStopped(reason=reason))
        return await self.wait()


@contextlib.asynccontextmanager
async def run(spec: JobSpec, *, token_file: str | None = None, host: str = "127.0.0.1") -> AsyncIterator[Job]:
    """Start a master for ``spec`` and submit the job; leaving the block stops the master and its nodes."""
    argv = spec.to_argv()
    config = parse_run_args(argv)
    async with started_job(config, token_file=token_file, host=host) as master:
        yield Job(config, master)
