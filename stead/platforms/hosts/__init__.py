"""The hosts platform: one job over several machines that each run `stead run` with torchrun's multi-node flags.

The host that serves the job's master places nodes with :class:`HostsPlatform` (its own on this machine, the
others on the hosts that offered themselves over :class:`HostServicer`); every other host runs :func:`join_job`.
`stead run` sets this up itself from the flags (see :mod:`stead.cli.on_hosts`): it is not an entry point.
"""

from __future__ import annotations

from stead.platforms.hosts._platform import HostServicer, HostsPlatform, job_shape, shape_mismatch, static_rank
from stead.platforms.hosts.launcher import NodeSpecFactory, join_job

__all__ = ["HostServicer", "HostsPlatform", "NodeSpecFactory", "join_job", "job_shape", "shape_mismatch", "static_rank"]
