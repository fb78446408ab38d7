"""`stead run` with torchrun's multi-node flags: one job over several machines, each running the same command.

Every host runs one node. Which host serves the job's master: in a static rendezvous (``--nnodes N --node-rank R
--master-addr H --master-port P``) the host of node rank 0, at ``H:P``; in a c10d one (``--rdzv-backend c10d
--rdzv-endpoint H:P``) the host that can listen at ``H:P`` (its address is H, and no `stead run` serves there
yet). That host's `stead run` runs the master (under its supervisor, as on one machine) with the hosts platform
(:mod:`stead.platforms.hosts`); every other host's joins it (:func:`stead.platforms.hosts.join_job`).

Every host needs the job's token, the same on each: ``STEAD_JOB_TOKEN`` in its environment, or the
``job_token_file`` setting naming a file on a filesystem every host reads.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from stead.cli.run_args import ELECTED_BACKENDS
from stead.cli.slurm_signals import slurm_warnings
from stead.cli.supervisor import listen
from stead.core.errors import ConfigError
from stead.core.jobtoken import JOB_TOKEN_ENV
from stead.core.platform import Platform
from stead.core.rpc.address import parse_address
from stead.core.runspec import RunConfig
from stead.core.tokenfile import check_token, read_token_file

__all__ = ["HOST_KEEPALIVE_S", "hosts_platform", "hosts_token", "join", "listening_host", "serving_socket",
           "slurm_platform", "tell_hosts"]

#: how often the master writes to a host's stream when it has nothing to say; a host that hears nothing for three
#: times this long offers itself again (a broken link found in seconds, not at the TCP timeout)
HOST_KEEPALIVE_S = 2.0


def hosts_token(config: RunConfig) -> str:
    """The job's token on this host: the ``job_token_file`` setting's file, else ``STEAD_JOB_TOKEN``."""
    path = config.settings.job_token_file
    if path:
        return read_token_file(path)
    value = os.environ.get(JOB_TOKEN_ENV, "").strip()
    if not value:
        raise ConfigError(
            f"a job over several machines needs the same job token on every host: set {JOB_TOKEN_ENV} to one secret "
            "on each (make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`), or --set "
            "job_token_file=PATH naming a file every host reads")
    try:
        return check_token(value)
    except ConfigError:
        raise ConfigError(f"{JOB_TOKEN_ENV} is not a job token: use letters, digits and '._~+/-=' only (e.g. "
                          "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`), the same on every "
                          "host") from None


def serving_socket(config: RunConfig) -> socket.socket | None:
    """The socket this host's master serves on, when this host serves the job; None when it joins another's, or
    when the hosts elect the master (``--rdzv-backend etcd``: see :mod:`stead.cli.elected`)."""
    host, port = parse_address(config.hosts_endpoint)
    if (config.rdzv_backend == "static" and config.node_rank != 0) or config.rdzv_backend in ELECTED_BACKENDS:
        return None
    try:
        return listen(host, port)
    except OSError as exc:
        if config.rdzv_backend == "static":
            raise ConfigError(_static_bind_error(config, exc)) from None
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL) or isinstance(exc, socket.gaierror):
            return None  # another host's address, or another `stead run` serves there: join it
        raise ConfigError(f"cannot listen at --rdzv-endpoint {config.hosts_endpoint}: {exc}; check the "
                          "address") from None


def listening_host(listen_fd: int | None) -> str:
    """The address the socket ``listen_fd`` (inherited, left open) is bound to: where an elected master serves."""
    if listen_fd is None:
        raise ConfigError("an elected master serves on the socket its host's `stead run` bound: run `stead run` "
                          "with --rdzv-backend etcd on each host, not the master by itself")
    with socket.socket(fileno=os.dup(listen_fd)) as sock:
        return str(sock.getsockname()[0])


def _static_bind_error(config: RunConfig, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"--node-rank 0 serves the job's master at {config.hosts_endpoint}, but the port is taken ({exc}): "
                "another job or program listens there; give another --master-port, the same on every host")
    return (f"--node-rank 0 serves the job's master at --master-addr:--master-port {config.hosts_endpoint}, but "
            f"this host cannot listen there ({exc}): run node rank 0 on the host whose address --master-addr is, "
            "or give this host's address")


def join(config: RunConfig, *, token: str, node_spec: Any, local: Callable[[], Awaitable[Platform]]) -> int:
    """This host's node of a job another host serves, on the platform ``local()`` makes for this machine; the
    job's exit code (told by its master)."""
    from stead.platforms.hosts import join_job  # not at import: a one-machine `stead run` never needs it

    async def run() -> int:
        async with slurm_warnings(os.environ):  # a Slurm job's host step says what Slurm's warning announced
            return await join_job(config, token=token, local=await local(), node_spec=node_spec,
                                  keepalive_s=HOST_KEEPALIVE_S)

    return asyncio.run(run())


def hosts_platform(config: RunConfig, local: Platform, *, home: str | None = None) -> tuple[Platform, list[Any]]:
    """The platform of the serving host's master (this machine's node on ``local``; none for an elected master,
    whose host at ``home`` offers itself as the others do), and the RPC service the hosts offer themselves on."""
    from stead.platforms.hosts import HostServicer, HostsPlatform, job_shape

    static = config.rdzv_backend == "static"
    platform = HostsPlatform(local=local, shape=job_shape(config), local_rank=config.node_rank if static else None,
                             static=static, host_name=socket.gethostname(), keepalive_s=HOST_KEEPALIVE_S,
                             pending_after_s=config.last_call_timeout_s, home=home)
    return platform, [HostServicer(platform, keepalive_s=HOST_KEEPALIVE_S)]


def slurm_platform(config: RunConfig, local: Platform, *, token: str | None,
                   takeover: bool) -> tuple[Platform, list[Any]]:
    """The Slurm platform (:mod:`stead.platforms.hosts.slurm`) of a `stead run` in a Slurm job's batch script or
    salloc shell: the hosts platform, with a host step started on every node of the allocation, each joining this
    master by the flags given here in its environment (torchrun's ``PET_*``), with the job's token."""
    from stead.cli.slurm_env import HOST_STEP_ENV, slurm_allocation
    from stead.platforms.hosts import HostServicer, HostsPlatform, job_shape
    from stead.platforms.hosts.slurm import SlurmPlatform

    allocation = slurm_allocation(os.environ)
    if allocation is None:
        raise ConfigError("the Slurm platform's master runs in the Slurm job's batch script or salloc shell, where "
                          "SLURM_JOB_ID and SLURM_JOB_NODELIST are set: run `stead run` there")
    hosts = HostsPlatform(local=local, shape=job_shape(config), local_rank=None, static=False,
                          host_name=allocation.here or socket.gethostname(), keepalive_s=HOST_KEEPALIVE_S,
                          pending_after_s=config.last_call_timeout_s, nodes_here=False)
    env = {HOST_STEP_ENV: allocation.job_id, "PET_NNODES": f"{config.min_nodes}:{config.max_nodes}",
           "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": config.hosts_endpoint, "PET_RDZV_ID": config.rdzv_id}
    if token:
        env[JOB_TOKEN_ENV] = token
    platform = SlurmPlatform(hosts, job_id=allocation.job_id, nodes=allocation.nodes, cpus=allocation.cpus,
                             argv=[sys.executable, "-m", "stead", "run", *config.argv], env=env, takeover=takeover)
    return platform, [HostServicer(hosts, keepalive_s=HOST_KEEPALIVE_S)]


def tell_hosts(platform: Platform | None, *, exit_code: int, summary: str) -> None:
    """The job ended: what the other hosts' `stead run` print and exit with (told as the platform closes)."""
    end = getattr(platform, "end", None)
    assert callable(end), platform
    end(exit_code=exit_code, summary=summary)
