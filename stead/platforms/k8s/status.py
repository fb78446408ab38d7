"""What a pod's status means for stead: running, ended (and why), unschedulable, unable to start.

Pure functions over the pod object as the API server returns it, so that every
case is a row of a table test:

- ``OOMKilled`` (the container's terminated reason) -> an out-of-memory kill,
  which the diagnosis rules classify as OOM;
- exit code 137 / 143 without it -> killed by SIGKILL / SIGTERM;
- ``Evicted``, ``Preempting``, ``NodeLost``, ``Shutdown`` and the like (the pod's
  own reason) -> the node was lost with its host, relaunched elsewhere;
- ``ErrImagePull``, ``ImagePullBackOff``, ``InvalidImageName``,
  ``CreateContainerConfigError``, ``CreateContainerError`` (a container that
  waits) -> the pod can never start as specified: the job fails fast with the
  reason instead of relaunching the same mistake;
- ``PodScheduled=False`` -> no host has room for it (pending capacity).
"""

from __future__ import annotations

import dataclasses
import datetime
import signal
from typing import Any

from stead.platforms.k8s import names

__all__ = ["CANNOT_START", "Ended", "PodView", "cannot_start", "parse_time", "view"]

JsonObject = dict[str, Any]

#: container waiting reasons that no wait or relaunch cures: the image or the pod's configuration is wrong
CANNOT_START = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                          "CreateContainerError", "ErrImageNeverPull"})
#: signals a container's exit code can carry (128 + N)
_SIGNALS = {int(s) for s in signal.Signals}


@dataclasses.dataclass(frozen=True)
class Ended:
    """How a node's pod ended, in the words of a NodeExited event."""

    exit_code: int | None
    signal: int | None
    reason: str = ""
    #: the container was killed for using more memory than its limit (OOMKilled)
    oom: bool = False


@dataclasses.dataclass(frozen=True)
class PodView:
    """The parts of a pod the platform acts on."""

    name: str
    node_id: str
    incarnation: int
    #: the Kubernetes node it was scheduled on ("" before)
    host: str
    running: bool
    ended: Ended | None
    #: why it cannot start ("ErrImagePull: ..."); "" when nothing says so
    cannot_start: str
    #: why it is not scheduled yet ("Unschedulable: 0/3 nodes are available: ..."); "" when it is, or no reason yet
    unschedulable: str
    created_at: float
    deleting: bool
    #: the agent container's limits (memory, cpu), as the platform reports what a node got
    limits: tuple[tuple[str, str], ...] = ()


def view(pod: JsonObject) -> PodView | None:
    """The pod as stead sees it; None for a pod that is not a stead node's (no node id or incarnation label)."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    node_id = labels.get(names.LABEL_NODE_ID)
    try:
        incarnation = int(labels.get(names.LABEL_INCARNATION, ""))
    except ValueError:
        return None
    if not node_id:
        return None
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    containers = status.get("containerStatuses") or []
    return PodView(
        name=str(metadata.get("name", "")), node_id=str(node_id), incarnation=incarnation,
        host=str(spec.get("nodeName") or ""),
        running=status.get("phase") == "Running" and any("running" in (c.get("state") or {}) for c in containers),
        ended=_ended(status, containers), cannot_start=cannot_start(pod),
        unschedulable=_unschedulable(status), created_at=parse_time(metadata.get("creationTimestamp")),
        deleting=bool(metadata.get("deletionTimestamp")), limits=_limits(spec))


def parse_time(text: object) -> float:
    """An RFC 3339 timestamp as seconds since the epoch; 0.0 when absent or unreadable."""
    if not isinstance(text, str) or not text:
        return 0.0
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _ended(status: JsonObject, containers: list[JsonObject]) -> Ended | None:
    phase = status.get("phase")
    terminated = [t for c in containers if (t := (c.get("state") or {}).get("terminated"))]
    if phase not in ("Succeeded", "Failed"):
        return None
    pod_reason = str(status.get("reason") or "")
    if pod_reason:  # the pod itself ended (evicted, its node lost or shut down): the node went with its host
        message = str(status.get("message") or "").strip()
        code = _exit_code(terminated[0]) if terminated else None
        return Ended(exit_code=code[0] if code else None, signal=code[1] if code else None,
                     reason=f"{pod_reason}: {message}" if message else pod_reason)
    if not terminated:
        return Ended(exit_code=0 if phase == "Succeeded" else None, signal=None,
                     reason="" if phase == "Succeeded" else "the pod failed with no container status")
    worst = max(terminated, key=lambda t: t.get("exitCode") != 0)  # a failed container tells how the pod failed
    exit_code, sig = _exit_code(worst)
    reason = str(worst.get("reason") or "")
    if reason in ("Completed", "Error"):
        reason = ""  # says no more than the exit code
    message = str(worst.get("message") or "").strip()
    oom = reason == "OOMKilled"
    if reason and message:
        reason = f"{reason}: {message}"
    return Ended(exit_code=exit_code, signal=sig, reason=reason, oom=oom)


def _limits(spec: JsonObject) -> tuple[tuple[str, str], ...]:
    containers = spec.get("containers") or []
    limits = ((containers[0].get("resources") or {}).get("limits") or {}) if containers else {}
    return tuple(sorted((str(k), str(v)) for k, v in limits.items() if k in ("memory", "cpu", "nvidia.com/gpu")))


def _exit_code(terminated: JsonObject) -> tuple[int | None, int | None]:
    """(exit code, signal): a container runtime reports death by signal N as exit code 128 + N."""
    code = terminated.get("exitCode")
    if not isinstance(code, int):
        return None, None
    if terminated.get("signal"):
        return None, int(terminated["signal"])
    if code > 128 and code - 128 in _SIGNALS:
        return None, code - 128
    return code, None


def cannot_start(pod: JsonObject) -> str:
    """Why the pod can never start as it is ("ErrImagePull: ..."); "" when nothing says so."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason in CANNOT_START:
            message = str(waiting.get("message") or "").strip()
            return f"{reason}: {message}" if message else str(reason)
    return ""


def _unschedulable(status: JsonObject) -> str:
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            reason = str(condition.get("reason") or "Unschedulable")
            message = str(condition.get("message") or "").strip()
            return f"{reason}: {message}" if message else reason
    return ""
