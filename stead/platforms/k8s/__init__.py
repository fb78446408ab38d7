"""The Kubernetes platform: each node's agent is a pod; the master watches them through the Kubernetes API.

Registered as ``k8s`` in the ``stead.platforms`` entry-point group through
:data:`platform_factory`. Its settings (``--set k8s.<name>=value``) are
:class:`~stead.platforms.k8s.settings.K8sSettings`. :class:`Kube` is the platform's
client of the Kubernetes API (plain JSON objects, errors mapped to stead's), with
the collections it uses (:data:`PODS`, :data:`SECRETS`, ...): for tools and tests
that make what a job needs beside its pods, e.g. its token Secret.
"""

from __future__ import annotations

from collections.abc import Sequence

from stead.core.config import Settings, load_settings
from stead.core.errors import ConfigError
from stead.core.runspec import RunConfig
from stead.platforms.k8s._client import (
    CONFIGMAPS,
    EVENTS,
    JOBS,
    NETWORK_POLICIES,
    NODES,
    PODS,
    ROLE_BINDINGS,
    ROLES,
    SECRETS,
    SERVICE_ACCOUNTS,
    SERVICES,
    Kube,
    Resource,
)
from stead.platforms.k8s._platform import K8sPlatform
from stead.platforms.k8s.settings import K8sSettings

__all__ = ["CONFIGMAPS", "EVENTS", "JOBS", "NETWORK_POLICIES", "NODES", "PODS", "ROLES", "ROLE_BINDINGS", "SECRETS",
           "SERVICES", "SERVICE_ACCOUNTS", "K8sPlatform", "K8sSettings", "Kube", "Resource", "create",
           "platform_factory"]


async def create(settings: Settings, **options: object) -> K8sPlatform:
    """A K8sPlatform with the ``k8s.*`` settings of ``settings``, not yet entered; it takes no options."""
    if options:
        raise ConfigError(f"the k8s platform takes no options, got {', '.join(sorted(options))}; use --set k8s.NAME")
    return K8sPlatform(settings, load_settings(K8sSettings, "k8s", settings))


async def launch_job(config: RunConfig, argv: Sequence[str]) -> int:
    """`stead run --platform k8s` from outside the cluster: the master runs in a pod (see :mod:`.launcher`)."""
    from stead.platforms.k8s.launcher import launch_job as launch

    return await launch(config, argv)


platform_factory = create
#: what `--set k8s.NAME=VALUE` may name (checked when the command line is read)
create.settings_class = K8sSettings  # type: ignore[attr-defined]
#: `stead run --platform k8s` hands the job to this instead of running its master here
create.launch_job = launch_job  # type: ignore[attr-defined]
