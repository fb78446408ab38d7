"""What a container process is started with: image, environment, command, working directory.

Pure functions of the pod, the container and the Secrets/ConfigMaps the kubelet read,
so the kubelet's rules (``$(VAR)`` expansion, ``valueFrom``, ``envFrom``, the variables a
kubelet adds) are tested without processes. Path translation, the fake node's stand-in
for mounts, is here too: see :func:`translate`.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stead.core.quantity import QuantityError, quantity_in_units

__all__ = ["ConfigError", "PodRefs", "container_env", "expand", "image_id", "image_name_problem",
           "local_image_env", "needed_refs", "translate"]

Obj = Mapping[str, Any]

# the reference grammar of container images (docker/distribution), without the domain's case folding
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*"
_IMAGE = re.compile(rf"(?:{_DOMAIN}(?::[0-9]+)?/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
                    r"(?::[\w][\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")


class ConfigError(Exception):
    """The container cannot be configured yet (CreateContainerConfigError): a Secret, ConfigMap or key is missing."""


def local_image_env(*, pythonpath: Sequence[str | os.PathLike[str]] = (),
                    extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an "image" that is this machine with this interpreter: its bin directory first on
    PATH (so ``python`` in a pod is this venv's), a UTF-8 locale, unbuffered output; PYTHONPATH only when
    ``pythonpath`` is given; ``extra`` last."""
    bin_dir = str(Path(sys.executable).parent)  # not resolved: a venv's bin holds the venv's python
    env = {"PATH": os.pathsep.join([bin_dir, "/usr/local/bin", "/usr/bin", "/bin"]), "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env.update(extra or {})
    return env


def image_name_problem(image: str) -> str | None:
    """Why ``image`` is not a valid reference (the InvalidImageName message), or None."""
    if _IMAGE.fullmatch(image) is None:
        return (f'Failed to apply default image tag "{image}": couldn\'t parse image name "{image}": invalid reference '
                f"format" + (": repository name must be lowercase" if image.lower() != image else ""))
    return None


def image_id(image: str) -> str:
    return f"docker.io/library/{image.split('@')[0]}@sha256:{hashlib.sha256(image.encode()).hexdigest()}"


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, undefined ones left as written,
    ``$$`` is a literal ``$``."""
    out, i = [], 0
    while i < len(text):
        char = text[i]
        if char == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env[name] if name in env else text[i:end + 1])
                    i = end + 1
                    continue
        out.append(char)
        i += 1
    return "".join(out)


def translate(value: str, mounts: Sequence[tuple[str, str]]) -> str:
    """``value`` with a leading mount path replaced by its host directory: a value equal to a ``mountPath`` or
    starting with ``mountPath + "/"`` is rewritten (``mounts`` sorted longest path first)."""
    for mount_path, host_path in mounts:
        if value == mount_path:
            return host_path
        if value.startswith(mount_path.rstrip("/") + "/"):
            return host_path + value[len(mount_path.rstrip("/")):]
    return value


@dataclass(frozen=True)
class PodRefs:
    """The Secrets and ConfigMaps (by name) a pod's containers read, as the kubelet fetched them (None: absent)."""

    secrets: Mapping[str, Obj | None]
    configmaps: Mapping[str, Obj | None]


def needed_refs(pod: Obj) -> tuple[set[str], set[str]]:
    """The names of the Secrets and ConfigMaps the containers' env, envFrom and volumes refer to."""
    secrets, configmaps = set(), set()
    spec = pod.get("spec") or {}
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for env in container.get("env") or []:
            source = env.get("valueFrom") or {}
            if "secretKeyRef" in source:
                secrets.add(source["secretKeyRef"].get("name", ""))
            if "configMapKeyRef" in source:
                configmaps.add(source["configMapKeyRef"].get("name", ""))
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                secrets.add(source["secretRef"].get("name", ""))
            if "configMapRef" in source:
                configmaps.add(source["configMapRef"].get("name", ""))
    for volume in spec.get("volumes") or []:
        if "secret" in volume:
            secrets.add(volume["secret"].get("secretName", ""))
        if "configMap" in volume:
            configmaps.add(volume["configMap"].get("name", ""))
    return secrets, configmaps


def data_of(obj: Obj | None, *, secret: bool) -> dict[str, str]:
    """A Secret's data decoded (and its stringData), or a ConfigMap's data."""
    if obj is None:
        return {}
    if not secret:
        return {k: str(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
    data.update({k: str(v) for k, v in (obj.get("stringData") or {}).items()})
    return data


def _key_ref(ref: Obj, refs: PodRefs, namespace: str, *, secret: bool) -> str | None:
    name, key, optional = ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional", False))
    objects = refs.secrets if secret else refs.configmaps
    kind = "Secret" if secret else "ConfigMap"
    obj = objects.get(name)
    if obj is None:
        if optional:
            return None
        raise ConfigError(f'{"secret" if secret else "configmap"} "{name}" not found')
    data = data_of(obj, secret=secret)
    if key not in data:
        if optional:
            return None
        raise ConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}")
    return data[key]


def _field_ref(path: str, pod: Obj, node_name: str, pod_ip: str) -> str:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match is not None:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    values = {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "spec.nodeName": node_name,
        "spec.serviceAccountName": spec.get("serviceAccountName", ""), "status.podIP": pod_ip,
        "status.podIPs": pod_ip, "status.hostIP": pod_ip, "status.hostIPs": pod_ip,
    }
    if path not in values:
        raise ConfigError(f'unsupported fieldRef fieldPath "{path}": use metadata.name, metadata.namespace, '
                          f"metadata.uid, metadata.labels['k'], metadata.annotations['k'], spec.nodeName, "
                          f"spec.serviceAccountName, status.podIP or status.hostIP")
    return str(values[path])


def _resource_ref(ref: Obj, pod: Obj, container: Obj, node_allocatable: Mapping[str, str]) -> str:
    target = container
    if ref.get("containerName"):
        target = next((c for c in (pod.get("spec") or {}).get("containers") or []
                       if c.get("name") == ref["containerName"]), container)
    section, _, resource = str(ref.get("resource", "")).partition(".")
    resources = target.get("resources") or {}
    value = (resources.get(section) or {}).get(resource)
    if value is None:
        value = node_allocatable.get(resource, "0") if section == "limits" else "0"
    try:
        return quantity_in_units(value, ref.get("divisor") or "1")
    except (QuantityError, ArithmeticError):
        raise ConfigError(f"resourceFieldRef {ref.get('resource')!r} with divisor {ref.get('divisor')!r} is not a "
                          f"quantity") from None


def container_env(container: Obj, pod: Obj, refs: PodRefs, *, node_name: str, pod_ip: str,
                  api_host: str, api_port: int, node_allocatable: Mapping[str, str]) -> dict[str, str]:
    """The variables a kubelet gives the container (the image's own environment excluded): the API server's
    service variables, ``envFrom``, then ``env`` with ``$(VAR)`` expanded against what is defined before it.
    Raises ConfigError for a missing Secret, ConfigMap or key that is not optional."""
    namespace = (pod.get("metadata") or {}).get("namespace", "")
    env: dict[str, str] = {"KUBERNETES_SERVICE_HOST": api_host, "KUBERNETES_SERVICE_PORT": str(api_port),
                           "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
                           "KUBERNETES_PORT": f"tcp://{api_host}:{api_port}"}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for field, secret in (("secretRef", True), ("configMapRef", False)):
            if field not in source:
                continue
            ref = source[field]
            objects = refs.secrets if secret else refs.configmaps
            obj = objects.get(ref.get("name", ""))
            if obj is None and not ref.get("optional", False):
                raise ConfigError(f'{"secret" if secret else "configmap"} "{ref.get("name", "")}" not found')
            for key, data in data_of(obj, secret=secret).items():
                if _ENV_NAME.fullmatch(prefix + key):  # the kubelet skips keys that are not variable names
                    env[prefix + key] = data
    for item in container.get("env") or []:
        name = item.get("name", "")
        source = item.get("valueFrom")
        if source is None:
            env[name] = expand(str(item.get("value", "")), env)
            continue
        value: str | None
        if "secretKeyRef" in source:
            value = _key_ref(source["secretKeyRef"], refs, namespace, secret=True)
        elif "configMapKeyRef" in source:
            value = _key_ref(source["configMapKeyRef"], refs, namespace, secret=False)
        elif "fieldRef" in source:
            value = _field_ref(source["fieldRef"].get("fieldPath", ""), pod, node_name, pod_ip)
        elif "resourceFieldRef" in source:
            value = _resource_ref(source["resourceFieldRef"], pod, container, node_allocatable)
        else:
            raise ConfigError(f"env {name!r}: valueFrom needs secretKeyRef, configMapKeyRef, fieldRef or "
                              f"resourceFieldRef")
        if value is not None:
            env[name] = value
    return env
