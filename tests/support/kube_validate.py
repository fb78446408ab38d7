"""Offline checks of Kubernetes objects: what the API server would reject, found without a cluster.

:func:`validate_builtin` checks a built-in object (Pod, Deployment, Role, ...)
against the OpenAPI schemas of one Kubernetes release that kubernetes-validate
ships, in strict mode, so a misspelt or misplaced field fails as it would with
``kubectl apply --validate=strict``. :func:`validate_custom` checks a custom
resource against its CRD's ``openAPIV3Schema``, turned into a JSON schema that
jsonschema understands. Both raise :class:`ManifestInvalid` naming the field.
:func:`pod_security_violations` checks the pod (or a Deployment's, StatefulSet's
or Job's pod template) against a level of the Pod Security Standards, the rules
the API server's Pod Security Admission enforces on a namespace labelled
``pod-security.kubernetes.io/enforce``.

kubernetes-validate and jsonschema are development dependencies (``pip install
'stead[dev]'``): they are imported when a check runs, and a missing one is a
ConfigError that says what to install.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from stead.core.errors import ConfigError

__all__ = ["KUBERNETES_VERSION", "PSS_LEVELS", "ManifestInvalid", "json_schema", "pod_security_violations",
           "validate_builtin", "validate_custom"]

#: the Kubernetes release whose schemas built-in objects are checked against by default (kubernetes-validate
#: 1.37.0 ships 1.25 to 1.37): one that current managed clusters run, so a field only newer releases know fails
KUBERNETES_VERSION = "1.33"

_INSTALL_HINT = "install stead's development dependencies: pip install 'stead[dev]'"
#: the OpenAPI extensions a CRD schema may carry; jsonschema does not know them (int-or-string is mapped)
_KUBERNETES_EXTENSIONS = ("x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource",
                          "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type",
                          "x-kubernetes-validations")


class ManifestInvalid(ConfigError):
    """A Kubernetes object the API server would reject; ``field`` is where (``spec.template.spec.containers[0]``)."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def validate_builtin(obj: Mapping[str, Any], kubernetes_version: str = KUBERNETES_VERSION) -> None:
    """Check a built-in object against Kubernetes ``kubernetes_version``'s strict schema; raise ManifestInvalid."""
    try:
        import kubernetes_validate
        from kubernetes_validate.utils import all_versions, major_minor
    except ImportError as exc:
        raise ConfigError(f"validate_builtin needs kubernetes-validate ({exc}); {_INSTALL_HINT}") from None
    shipped = sorted({major_minor(v) for v in all_versions()}, key=lambda v: tuple(int(p) for p in v.split(".")))
    if major_minor(kubernetes_version) not in shipped:
        raise ConfigError(f"kubernetes-validate has no schemas for Kubernetes {kubernetes_version}; use one of "
                          f"{', '.join(shipped)}")
    what = _describe(obj)
    try:
        kubernetes_validate.validate(dict(obj), kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        field = _field(exc.path)
        raise ManifestInvalid(f"{what} is not a valid Kubernetes {kubernetes_version} object: {field or '(top)'}: "
                              f"{exc.message}", field=field) from None
    except kubernetes_validate.SchemaNotFoundError:
        raise ConfigError(f"{what}: Kubernetes {kubernetes_version} has no built-in kind {obj.get('kind')!r} in "
                          f"{obj.get('apiVersion')!r}; check apiVersion and kind, or check a custom resource with "
                          "validate_custom(obj, crd)") from None


def validate_custom(obj: Mapping[str, Any], crd: Mapping[str, Any], *, strict: bool = True) -> None:
    """Check a custom resource against its CRD's schema for the object's version; raise ManifestInvalid.

    ``strict`` rejects fields the schema does not declare (outside free-form parts), as ``kubectl apply``'s
    strict field validation does; without it the API server would drop them silently.
    """
    try:
        import jsonschema
    except ImportError as exc:
        raise ConfigError(f"validate_custom needs jsonschema ({exc}); {_INSTALL_HINT}") from None
    spec = crd.get("spec", {})
    group, _, version = str(obj.get("apiVersion", "")).rpartition("/")
    what = _describe(obj)
    kind = spec.get("names", {}).get("kind")
    if group != spec.get("group") or obj.get("kind") != kind:
        raise ConfigError(f"{what} is not a {kind} of {spec.get('group')}: its apiVersion is "
                          f"{obj.get('apiVersion')!r}; use {spec.get('group')}/VERSION and kind {kind}")
    validator = jsonschema.Draft7Validator(json_schema(crd, version, strict=strict))
    errors = sorted(validator.iter_errors(dict(obj)), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        fields = [_field(e.absolute_path) for e in errors]
        details = "; ".join(f"{field or '(top)'}: {e.message}" for field, e in zip(fields, errors, strict=True))
        raise ManifestInvalid(f"{what} does not match the {kind} schema of {obj.get('apiVersion')}: {details}",
                              field=fields[0])


def json_schema(crd: Mapping[str, Any], version: str, *, strict: bool = True) -> dict[str, Any]:
    """The CRD's ``openAPIV3Schema`` of ``version`` as a JSON schema (draft 7) that jsonschema can apply.

    ``x-kubernetes-int-or-string`` becomes ``anyOf: [integer, string]``, the other ``x-kubernetes-*`` keys are
    dropped; ``strict`` closes every object that declares its properties (except ``metadata``, which the API
    server defines) to undeclared ones.
    """
    served = [v for v in crd.get("spec", {}).get("versions", []) if v.get("name") == version]
    if not served:
        names = [v.get("name") for v in crd.get("spec", {}).get("versions", [])]
        raise ConfigError(f"CRD {crd.get('metadata', {}).get('name')!r} has no version {version!r} (it has "
                          f"{', '.join(map(str, names)) or 'none'}); use one of those in the object's apiVersion")
    schema = served[0].get("schema", {}).get("openAPIV3Schema")
    if not isinstance(schema, Mapping):
        raise ConfigError(f"CRD {crd.get('metadata', {}).get('name')!r} version {version!r} has no "
                          "openAPIV3Schema; give it a structural schema")
    converted = _convert(schema, strict=strict, path=())
    converted["$schema"] = "http://json-schema.org/draft-07/schema#"
    return converted


def _convert(node: Mapping[str, Any], *, strict: bool, path: tuple[str, ...]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in node.items():
        if key in _KUBERNETES_EXTENSIONS or key == "x-kubernetes-int-or-string":
            continue
        if key == "properties":
            result[key] = {name: _convert(sub, strict=strict, path=(*path, name)) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, Mapping):
            result[key] = _convert(value, strict=strict, path=(*path, key))
        elif key in ("anyOf", "allOf", "oneOf"):
            result[key] = [_convert(sub, strict=strict, path=path) for sub in value]
        else:
            result[key] = value
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in result:
        result["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    free = node.get("x-kubernetes-preserve-unknown-fields", False)
    if strict and not free and "properties" in node and "additionalProperties" not in node and path != ("metadata",):
        result["additionalProperties"] = False
    return result


# -- the Pod Security Standards ----------------------------------------------------------------------------------
# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (the "baseline" and "restricted" tables),
# as the policy version "latest" of Kubernetes 1.33 has them

#: the levels, least restricted first: a pod that passes one passes every level before it
PSS_LEVELS = ("privileged", "baseline", "restricted")
#: capabilities baseline lets a container add (restricted: NET_BIND_SERVICE only)
_BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
_SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes"})
_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
#: the volume types restricted allows
_RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                                 "projected", "secret"})
_POD_TEMPLATE_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})


def pod_security_violations(obj: Mapping[str, Any], level: str = "restricted") -> list[str]:
    """What keeps ``obj`` (a Pod, or a workload's pod template) from passing ``level`` of the Pod Security
    Standards, one line per violation naming the field; an empty list when it passes."""
    if level not in PSS_LEVELS:
        raise ConfigError(f"Pod Security Standards level {level!r} does not exist; use one of {', '.join(PSS_LEVELS)}")
    kind = obj.get("kind")
    if kind == "Pod":
        spec, where = obj.get("spec") or {}, "spec"
    elif kind in _POD_TEMPLATE_KINDS:
        template = (obj.get("spec") or {}).get("template") or {}
        spec, where = template.get("spec") or {}, "spec.template.spec"
    else:
        raise ConfigError(f"{_describe(obj)} has no pod: check a Pod or a {', '.join(sorted(_POD_TEMPLATE_KINDS))}")
    found: list[str] = []
    if level != "privileged":
        found += _baseline(spec, where)
    if level == "restricted":
        found += _restricted(spec, where)
    return [f"{_describe(obj)}: {line}" for line in found]


def _containers(spec: Mapping[str, Any], where: str) -> list[tuple[str, Mapping[str, Any]]]:
    return [(f"{where}.{group}[{i}]", container) for group in ("initContainers", "containers", "ephemeralContainers")
            for i, container in enumerate(spec.get(group) or [])]


def _baseline(spec: Mapping[str, Any], where: str) -> list[str]:
    found = [f"{where}.{field}: must be unset or false (host namespaces)"
             for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    pod_context = spec.get("securityContext") or {}
    contexts = [(f"{where}.securityContext", pod_context)]
    contexts += [(f"{path}.securityContext", c.get("securityContext") or {}) for path, c in _containers(spec, where)]
    for path, context in contexts:
        if (context.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{path}.windowsOptions.hostProcess: must be unset or false")
        selinux = context.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in _SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"{path}.seLinuxOptions: type must be one of the container_* types, user and role unset")
        if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"{path}.seccompProfile.type: must not be Unconfined")
        if (context.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            found.append(f"{path}.appArmorProfile.type: must be RuntimeDefault or Localhost")
    for path, container in _containers(spec, where):
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            found.append(f"{path}.securityContext.privileged: must be unset or false")
        added = set((context.get("capabilities") or {}).get("add") or []) - _BASELINE_CAPABILITIES
        if added:
            found.append(f"{path}.securityContext.capabilities.add: {', '.join(sorted(added))} not allowed "
                         f"(baseline allows only {', '.join(sorted(_BASELINE_CAPABILITIES))})")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{path}.securityContext.procMount: must be Default")
        for j, port in enumerate(container.get("ports") or []):
            if port.get("hostPort"):
                found.append(f"{path}.ports[{j}].hostPort: must be unset or 0")
    for i, volume in enumerate(spec.get("volumes") or []):
        if "hostPath" in volume:
            found.append(f"{where}.volumes[{i}].hostPath: host paths are not allowed")
    for i, sysctl in enumerate(pod_context.get("sysctls") or []):
        if sysctl.get("name") not in _SAFE_SYSCTLS:
            found.append(f"{where}.securityContext.sysctls[{i}]: {sysctl.get('name')} is not a safe sysctl")
    return found


def _restricted(spec: Mapping[str, Any], where: str) -> list[str]:
    found = []
    for i, volume in enumerate(spec.get("volumes") or []):
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            found.append(f"{where}.volumes[{i}]: {', '.join(sorted(kinds - _RESTRICTED_VOLUMES))} volumes are not "
                         f"allowed (restricted allows {', '.join(sorted(_RESTRICTED_VOLUMES))})")
    pod = spec.get("securityContext") or {}
    if pod.get("runAsNonRoot") is False:
        found.append(f"{where}.securityContext.runAsNonRoot: must not be false")
    if pod.get("runAsUser") == 0:
        found.append(f"{where}.securityContext.runAsUser: must not be 0")
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    for path, container in _containers(spec, where):
        context = container.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{path}.securityContext.allowPrivilegeEscalation: must be false")
        non_root = context.get("runAsNonRoot", pod.get("runAsNonRoot"))
        if non_root is not True:
            found.append(f"{path}.securityContext.runAsNonRoot: must be true (here or in the pod's securityContext)")
        if context.get("runAsUser") == 0:
            found.append(f"{path}.securityContext.runAsUser: must not be 0")
        seccomp = (context.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{path}.securityContext.seccompProfile.type: must be RuntimeDefault or Localhost (here or "
                         "in the pod's securityContext)")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{path}.securityContext.capabilities.drop: must include ALL")
        added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            found.append(f"{path}.securityContext.capabilities.add: {', '.join(sorted(added))} not allowed "
                         "(restricted allows only NET_BIND_SERVICE)")
    return found


def _describe(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return f"{obj.get('kind', '(no kind)')}/{name or '(no name)'}"


def _field(path: Iterable[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
