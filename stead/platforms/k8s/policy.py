"""What a job may ask of the cluster beyond a restricted pod, checked against what its configuration allows.

Whoever may create a SteadJob must not get, through the operator, pods with more
rights than their own: the operator creates pods in their namespace, and nothing
in RBAC limits what a pod it creates may mount or run as. So the fields that
escalate are refused unless the operator's settings allow them, one by one:

| a job asks for | allowed by the setting ``k8s.`` |
|---|---|
| its master's ServiceAccount (``spec.serviceAccountName``, ``k8s.service_account``) | ``allowed_service_accounts`` |
| a PersistentVolumeClaim (``spec.checkpointVolume.claimName``, ``k8s.checkpoint_claim``) | ``allowed_claims`` |
| an env value from a Secret (``valueFrom.secretKeyRef``) | ``allowed_env_secrets`` |
| an env value from a ConfigMap (``valueFrom.configMapKeyRef``) | ``allowed_env_config_maps`` |
| CAP_SYS_PTRACE (``spec.ptrace``, ``k8s.ptrace``) | ``allow_ptrace`` |
| any ``k8s.*`` setting in ``spec.settings`` or ``spec.runArgs`` | nothing: the SteadJob's own fields say it |

A SteadJob has no field for a host path, a privileged container, host
namespaces or another volume: its pods are built by :mod:`.pods`, restricted.
``stead run --platform k8s`` applies the same check to its own settings (the one
who runs it is both the asker and the configuration: a ``k8s.ptrace=true`` needs
``k8s.allow_ptrace=true`` beside it, so that an escalation is always said twice).

Pure functions, so that every case is a row of a table test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from stead.core.errors import ConfigError
from stead.core.runspec import SETTING_NAME
from stead.core.store import public_store_url
from stead.platforms.k8s._crd import STORE_PATTERN
from stead.platforms.k8s.settings import K8sSettings

__all__ = ["LAUNCHER_FIELDS", "OPERATOR_FIELDS", "JobRefused", "check_allowed", "check_run_args", "check_store",
           "refusals"]

#: how each checked setting is named to the one who asked: a SteadJob's field, or `stead run`'s setting
OPERATOR_FIELDS = {"service_account": "spec.serviceAccountName", "checkpoint_claim": "spec.checkpointVolume.claimName",
                   "env": "spec.env", "ptrace": "spec.ptrace"}
LAUNCHER_FIELDS = {name: f"k8s.{name}" for name in OPERATOR_FIELDS}


class JobRefused(ConfigError):
    """A job asks for more than its configuration allows; the message names each field and the setting to change."""


def _names(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def _allowed(name: str, setting: str) -> bool:
    found = _names(setting)
    return name in found or "*" in found


def refusals(settings: K8sSettings, policy: K8sSettings, *, fields: Mapping[str, str] = LAUNCHER_FIELDS,
             who: str = "the operator") -> list[str]:
    """Why the pods ``settings`` describe exceed what ``policy`` allows, one line each; empty when they do not.

    ``who`` is whose configuration holds the ``allowed_*`` settings (the operator's, or this command's own).
    """
    found = []

    def refuse(field: str, value: str, what: str, setting: str) -> None:
        found.append(f"{fields[field]}{value}: {what}; {who} allows it with k8s.{setting} "
                     f"(STEAD_K8S_{setting.upper()})")

    account = settings.service_account
    if account and account not in _names(policy.allowed_service_accounts):
        refuse("service_account", f"={account}", "a job's master runs as its own ServiceAccount, whose Role reads only "
               "its own Secret", "allowed_service_accounts")
    claim = settings.checkpoint_claim
    if claim and not _allowed(claim, policy.allowed_claims):
        refuse("checkpoint_claim", f"={claim}", "this claim is not one a job may mount", "allowed_claims")
    for i, item in enumerate(_env(settings.env)):
        source = item.get("valueFrom") or {}
        for key, setting, kind in (("secretKeyRef", "allowed_env_secrets", "Secret"),
                                   ("configMapKeyRef", "allowed_env_config_maps", "ConfigMap")):
            ref = source.get(key)
            if isinstance(ref, Mapping):
                name = str(ref.get("name", ""))
                if not _allowed(name, getattr(policy, setting)):
                    refuse("env", f"[{i}].valueFrom.{key}.name={name}", f"the {kind} {name!r} is not one a job may "
                           "read", setting)
    if settings.ptrace and not policy.allow_ptrace:
        refuse("ptrace", "=true", "CAP_SYS_PTRACE takes the node pods past the 'restricted' and 'baseline' Pod "
               "Security levels", "allow_ptrace")
    return found


def check_allowed(settings: K8sSettings, policy: K8sSettings, *, fields: Mapping[str, str] = LAUNCHER_FIELDS,
                  who: str = "the operator", job: str = "") -> None:
    """Raise :class:`JobRefused` listing every :func:`refusals` line, if there is one."""
    found = refusals(settings, policy, fields=fields, who=who)
    if found:
        raise JobRefused(f"job {job!r} is refused: " + "; ".join(found))


def check_run_args(settings: Mapping[str, Any], run_args: Sequence[str]) -> None:
    """A SteadJob's ``spec.settings`` and ``spec.runArgs`` set no ``k8s.*`` setting: its pods are described by
    its own fields, which the operator checks (a ``--set k8s.ptrace=true`` would go around that). A name is read
    as the master reads it (spaces around it do not hide it), and a ``spec.settings`` key that is not a setting's
    name is refused."""
    bad = [repr(key) for key in settings if not SETTING_NAME.fullmatch(str(key).strip())]
    if bad:
        raise JobRefused(f"spec.settings {', '.join(bad)}: not a setting's name; a name is lowercase letters, "
                         "digits, '_' and '.', starting with a letter, e.g. heartbeat_timeout_s or ckpt.keep_last")
    found = [f"spec.settings.{key}" for key in settings if str(key).strip().startswith("k8s.")]
    found += [f"spec.runArgs[{i}]={arg}" for i, arg in enumerate(run_args)
              if str(arg).strip().removeprefix("--set=").strip().startswith("k8s.")]
    if found:
        raise JobRefused(f"{', '.join(found)}: a SteadJob's pods are set by its own fields (image, resources, env, "
                         "checkpointVolume, serviceAccountName, ...), which the operator checks against what it "
                         "allows, never by k8s.* settings; move it to its field, or ask for it in the operator's "
                         "settings")


def check_store(url: str) -> None:
    """A SteadJob's ``spec.store`` names etcd's endpoints and nothing else: no user and no query. The operator
    and the masters it starts open it with their own TLS files and login (``STEAD_ETCD_*``); a URL's
    ``password_file=`` or user would have them read a file of the job author's choosing and send it, as a
    password, to a host of the author's choosing."""
    if not re.fullmatch(STORE_PATTERN, url):
        raise JobRefused(f"spec.store {public_store_url(url)!r} must be etcd://HOST[:PORT][,HOST[:PORT]], with no "
                         "user and no query: the store's TLS files and login are the operator's settings "
                         "(STEAD_ETCD_*), never a job's")


def _env(text: str) -> list[Mapping[str, Any]]:
    if not text.strip():
        return []
    try:
        found = json.loads(text)
    except ValueError:
        return []  # not JSON: the pod builder says so, with the setting's name
    return [item for item in found if isinstance(item, Mapping)] if isinstance(found, list) else []
