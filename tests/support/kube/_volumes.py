"""A fake node's volumes: host directories standing in for what a real kubelet mounts.

Every volume of a pod becomes a directory on this machine; a container sees it through
path translation (see :mod:`tests.support.kube.kubelet`). Where each kind lives:

- ``emptyDir``: ``root/<node>/pods/<pod uid>/volumes/<volume>``; with ``medium: Memory``
  under the kubelet's own directory in ``/dev/shm`` (real tmpfs) instead;
- ``persistentVolumeClaim``: ``root/pvc/<namespace>/<claimName>``, the same on every node
  (ReadWriteMany);
- ``secret`` / ``configMap``: files written into the pod's volume directory (``items`` and
  ``defaultMode`` honoured);
- ``hostPath``: ``root/<node>/host/<path>``.

A mount at ``/tmp`` is set up but not translated (see :data:`UNTRANSLATED`): a fake
node's ``/tmp`` is this machine's, where the tests' own paths (a working directory,
a script) live, and where a program's unix sockets keep their paths short.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.kube._podenv import PodRefs, data_of

__all__ = ["UNTRANSLATED", "MountError", "PodVolumes", "container_mounts", "prepare_volumes"]

Obj = Mapping[str, Any]

#: mount paths a container sees as this machine's own: a pod's writable /tmp under a read-only root filesystem
#: (which a fake node does not enforce) would otherwise move every test path under /tmp into the volume, and a
#: unix socket under a volume's directory can pass the 107-byte limit of its path
UNTRANSLATED = frozenset({"/tmp"})


class MountError(Exception):
    """A volume cannot be set up yet (the container waits in ContainerCreating)."""


@dataclass
class PodVolumes:
    #: volume name -> its host directory
    paths: dict[str, Path] = field(default_factory=dict)
    #: what goes when the pod terminates (emptyDirs, secret and configMap files); PVCs and hostPaths stay
    ephemeral: list[Path] = field(default_factory=list)


def prepare_volumes(pod: Obj, *, pod_dir: Path, shm_dir: Path, pvc_root: Path, host_root: Path,
                    refs: PodRefs) -> PodVolumes:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    namespace = meta.get("namespace", "")
    volumes = PodVolumes()
    for volume in spec.get("volumes") or []:
        name = volume["name"]
        if "emptyDir" in volume:
            memory = (volume["emptyDir"] or {}).get("medium") == "Memory"
            path = (shm_dir if memory else pod_dir / "volumes") / name
            path.mkdir(parents=True, exist_ok=True)
            volumes.ephemeral.append(path)
        elif "persistentVolumeClaim" in volume:
            path = pvc_root / namespace / volume["persistentVolumeClaim"]["claimName"]
            path.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            path = host_root / str(volume["hostPath"].get("path", "")).lstrip("/")
            path.mkdir(parents=True, exist_ok=True)
        elif "secret" in volume or "configMap" in volume:
            secret = "secret" in volume
            source = volume["secret" if secret else "configMap"] or {}
            ref_name = source.get("secretName" if secret else "name", "")
            obj = (refs.secrets if secret else refs.configmaps).get(ref_name)
            if obj is None and not source.get("optional", False):
                raise MountError(f'MountVolume.SetUp failed for volume "{name}" : '
                                 f'{"secret" if secret else "configmap"} "{ref_name}" not found')
            path = pod_dir / "volumes" / name
            _write_files(path, data_of(obj, secret=secret), source)
            volumes.ephemeral.append(path)
        else:
            kinds = sorted(k for k in volume if k != "name")
            raise MountError(f'MountVolume.SetUp failed for volume "{name}" : the fake kubelet does not support '
                             f"volume type {kinds}; use emptyDir, persistentVolumeClaim, secret, configMap or hostPath")
        volumes.paths[name] = path
    return volumes


def _write_files(path: Path, data: Mapping[str, str], source: Obj) -> None:
    path.mkdir(parents=True, exist_ok=True)
    mode = int(source.get("defaultMode", 0o644))
    items = source.get("items")
    files = {item["path"]: (data.get(item["key"], ""), int(item.get("mode", mode))) for item in items} if items \
        else {key: (value, mode) for key, value in data.items()}
    for relative, (content, file_mode) in files.items():
        target = path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        os.chmod(target, file_mode | 0o200)  # the kubelet itself must be able to remove it


def container_mounts(container: Obj, volumes: PodVolumes) -> list[tuple[str, str]]:
    """``(mountPath, host path)`` of the container's mounts (``subPath`` followed, :data:`UNTRANSLATED` left out),
    longest mount path first."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        if str(mount["mountPath"]).rstrip("/") in UNTRANSLATED:
            continue
        host = volumes.paths[mount["name"]]
        if mount.get("subPath"):
            host = host / mount["subPath"]
            host.mkdir(parents=True, exist_ok=True)
        mounts.append((str(mount["mountPath"]).rstrip("/") or "/", str(host)))
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)
