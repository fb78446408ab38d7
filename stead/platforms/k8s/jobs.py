"""A job's objects on the cluster and its master pod: made once, kept running until the job ends.

Shared by ``stead run --platform k8s`` (run from a laptop, no CRD needed) and by
the operator (a ``SteadJob`` resource): both make the job's token Secret, its
master's ServiceAccount, Role and RoleBinding (:mod:`.isolation`: per job, so that
a master reads only its own job's Secret), the master's Service, the job's
NetworkPolicies and the master pod, and both start a
new master pod when the one running is deleted before the job ended (the new
master replays the job's log and adopts the node pods that still run).

Creation is all or nothing: a failure deletes what this call made, so a bad
image name or a missing RBAC rule leaves nothing half-created behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import structlog

from stead.core.errors import ConfigError, PlatformError, PlatformUnavailable
from stead.core.rpc import new_token
from stead.platforms.k8s import names
from stead.platforms.k8s._client import (
    NETWORK_POLICIES,
    PODS,
    ROLE_BINDINGS,
    ROLES,
    SECRETS,
    SERVICE_ACCOUNTS,
    SERVICES,
    Kube,
    Resource,
)
from stead.platforms.k8s.isolation import job_rbac, network_policies
from stead.platforms.k8s.pods import JobObjects, Owner, master_pod, master_service, token_secret
from stead.platforms.k8s.policy import JobRefused
from stead.platforms.k8s.settings import K8sSettings
from stead.platforms.k8s.status import parse_time

__all__ = ["MasterPods", "MasterSpec", "check_store", "create_job_objects", "master_pods", "start_master"]

log = structlog.get_logger("stead.k8s")

JsonObject = dict[str, Any]

#: where each kind of a job's objects is created
_RESOURCES = {"ServiceAccount": SERVICE_ACCOUNTS, "Role": ROLES, "RoleBinding": ROLE_BINDINGS, "Service": SERVICES,
              "NetworkPolicy": NETWORK_POLICIES}
#: the k8s settings that only mean something where the command runs (a laptop's kubeconfig), not in the master pod
_LOCAL_ONLY = frozenset({"api_url", "api_ca_file", "kubeconfig", "context", "pod_api_url", "namespace"})


@dataclasses.dataclass(frozen=True)
class MasterSpec:
    """What a job's master pod runs: its store, its `stead run` arguments and its k8s settings."""

    job: str
    store_url: str
    run_args: tuple[str, ...]
    settings: K8sSettings
    #: the master pod's environment (settings exported as ``STEAD_*``)
    env: tuple[tuple[str, str], ...] = ()
    log_format: str = "json"

    def master_args(self) -> list[str]:
        """The run arguments with every k8s setting that is not a default, so that the master pod builds its
        nodes' pods from the same values as whoever made it (settings given by environment included)."""
        defaults = K8sSettings()
        extra = []
        for field in dataclasses.fields(K8sSettings):
            value = getattr(self.settings, field.name)
            if field.name not in _LOCAL_ONLY and value != getattr(defaults, field.name):
                extra.append(f"--set=k8s.{field.name}={str(value).lower() if isinstance(value, bool) else value}")
        if self.settings.pod_api_url:
            extra.append(f"--set=k8s.api_url={self.settings.pod_api_url}")
        return [*extra, *self.run_args]


@dataclasses.dataclass(frozen=True)
class MasterPods:
    """The job's master pods as the API server has them."""

    running: list[str]
    #: name -> how it ended ("Succeeded", "Failed: ...")
    ended: dict[str, str]
    #: the highest suffix used (the next master pod is ``<job>-master-<last_index + 1>``)
    last_index: int


async def master_pods(kube: Kube, job: str) -> MasterPods:
    items, _ = await kube.list(PODS, label_selector=f"{names.LABEL_JOB}={job},{names.LABEL_ROLE}={names.ROLE_MASTER}")
    running, ended, last = [], {}, 0
    for pod in sorted(items, key=lambda p: parse_time(p["metadata"].get("creationTimestamp"))):
        name = str(pod["metadata"]["name"])
        suffix = name.rsplit("-", 1)[-1]
        if suffix.isdigit():
            last = max(last, int(suffix))
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            ended[name] = str(phase)
        elif not pod["metadata"].get("deletionTimestamp"):
            running.append(name)
    return MasterPods(running=running, ended=ended, last_index=last)


async def create_job_objects(kube: Kube, spec: MasterSpec, *, owner: Owner | None = None) -> JobObjects:
    """The job's token Secret (kept when it exists: a job run again keeps its token), its master's RBAC, Service
    and NetworkPolicies.

    ``owner``: the SteadJob that owns them; without one the Secret is the job's anchor and owns the rest.
    """
    namespace = kube.namespace
    made: list[tuple[Resource, str]] = []
    try:
        secret = await kube.get(SECRETS, names.secret_name(spec.job))
        if secret is None:
            secret = await kube.create(SECRETS, token_secret(spec.job, namespace, new_token(), owner=owner))
            assert secret is not None
            made.append((SECRETS, names.secret_name(spec.job)))
        anchor = owner or Owner("v1", "Secret", names.secret_name(spec.job), secret["metadata"]["uid"])
        objects = JobObjects(job=spec.job, namespace=namespace, owner=anchor,
                             master_address=f"{names.master_name(spec.job)}.{namespace}.svc:"
                                            f"{spec.settings.master_port}")
        owned = [*job_rbac(spec.job, namespace, spec.settings.service_account), master_service(objects, spec.settings),
                 *network_policies(spec.job, namespace, store_url=spec.store_url,
                                   metrics_port=spec.settings.metrics_port,
                                   egress_cidrs=spec.settings.node_egress_cidrs)]
        for body in owned:
            body["metadata"]["ownerReferences"] = [anchor.reference()]
            resource = _RESOURCES[body["kind"]]
            if await kube.create(resource, body, exist_ok=True) is not None or not await _owned(kube, body, anchor):
                made.append((resource, str(body["metadata"]["name"])))
    except BaseException:
        await _undo(kube, made)
        raise
    return objects


async def _owned(kube: Kube, body: JsonObject, owner: Owner) -> bool:
    """Whether the object of ``body``'s name that is already there is ``owner``'s (made for this job before);
    False when it is gone by now (then made anew). One that is another's is never adopted: a job named so that
    its ``<job>-master`` is another's account would get that account's rights, and lose them to it."""
    resource, name = _RESOURCES[body["kind"]], str(body["metadata"]["name"])
    found = await kube.get(resource, name)
    if found is None:
        await kube.create(resource, body)
        return False
    owners = found["metadata"].get("ownerReferences") or []
    if any(ref.get("uid") == owner.uid for ref in owners):
        return True
    if any(ref.get("kind") == owner.kind and ref.get("name") == owner.name for ref in owners):
        raise PlatformUnavailable(f"{body['kind']} {name!r} in namespace {kube.namespace} belongs to an earlier "
                                  f"{owner.kind} {owner.name!r}, which Kubernetes is deleting with it; retried")
    raise JobRefused(f"{body['kind']} {name!r} in namespace {kube.namespace} is there already and is not job "
                     f"{owner.name!r}'s (it is not owned by its {owner.kind}): a job never takes over an object it "
                     "did not make; delete that object, or give the job another name")


async def start_master(kube: Kube, spec: MasterSpec, objects: JobObjects, *, index: int) -> str:
    """Create the master pod ``<job>-master-<index>``; its name."""
    name = f"{names.master_name(spec.job)}-{index}"
    pod = master_pod(objects, spec.settings, name=name, store_url=spec.store_url, run_args=spec.master_args(),
                     env=dict(spec.env), log_format=spec.log_format)
    await kube.create(PODS, pod)
    log.info("k8s_master_pod_created", job=spec.job, pod=name, namespace=kube.namespace)
    return name


def check_store(url: str) -> None:
    """A job on Kubernetes needs a store its master pods reach and that outlives each of them."""
    scheme = url.partition("://")[0]
    if scheme in ("sqlite", "memory"):
        raise ConfigError(f"--store {url}: a job on Kubernetes needs a store that every master pod reaches and "
                          "that outlives them (etcd): --store etcd://HOST:PORT (`stead k8s manifests --with-etcd` "
                          "gives one to try)")


async def _undo(kube: Kube, made: Sequence[tuple[Resource, str]]) -> None:
    for resource, name in reversed(made):
        try:
            await kube.delete(resource, name, grace_period_s=0)
        except PlatformError as exc:
            log.warning("k8s_undo_failed", resource=resource.plural, name=name, error=str(exc))
