"""One typed configuration object with defaults that work on a laptop, and the same rules for plugins'.

Every timeout and interval stead uses is a named, documented setting here, never
a magic number in the code. Settings can be overridden from the command line
(``--set name=value``) or the ``STEAD_<NAME>`` environment variables.

Plugins have settings of their own, in their own namespace: a plugin declares a
frozen dataclass (its ``settings_class``) and users set its fields with
``--set <plugin>.<name>=value`` or ``STEAD_<PLUGIN>_<NAME>``. The dotted values
travel inside :class:`Settings` (``plugin_values``) until the plugin's class is
known; :func:`load_settings` turns them into the typed object with the same
conversion and checks as stead's own: numbers are finite, not negative, and
within the bounds a field declares with :func:`setting`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from stead.core.errors import ConfigError

__all__ = ["HEALTH_CHECK_CHOICES", "Settings", "env_name", "load_settings", "setting", "settings_env", "settings_help"]

T = TypeVar("T")

#: field metadata keys of :func:`setting`
_MIN, _MAX, _HELP = "stead.min", "stead.max", "stead.help"


def setting(default: Any, *, help: str = "", min: float | None = None, max: float | None = None) -> Any:
    """A settings field with a default, a one-line description and optional bounds (checked when set)."""
    return dataclasses.field(default=default, metadata={_HELP: help, _MIN: min, _MAX: max})


#: the health_check setting's values ("auto" is resolved by the platform when a job is submitted)
HEALTH_CHECK_CHOICES = ("auto", "off", "relaunched", "all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    #: seconds between an agent's heartbeats
    heartbeat_interval_s: float = setting(0.5, min=0.001)
    #: a node whose agent sent no heartbeat for this long is declared lost
    heartbeat_timeout_s: float = setting(5.0, min=0.001)
    #: after MIN nodes joined, wait this long for more (up to MAX) before a round starts
    last_call_timeout_s: float = 1.0
    #: fail the job when fewer than MIN nodes joined within this time
    join_timeout_s: float = 600.0
    #: a worker failure that no diagnosis plugin decided within this time is decided by the default policy
    decision_timeout_s: float = 3.0
    #: which joining nodes must pass a health check (a matmul, then all-reduces in pairs) before they train:
    #: "off", "relaunched" (nodes relaunched after a loss or failure), "all", or "auto" (all on Kubernetes,
    #: off on the local platform, whose nodes share one machine); a node that fails it, or is more than
    #: health_slow_factor times slower than the median, is relaunched and its host excluded
    health_check: str = "auto"
    #: a node that has not finished its health check within this time fails it
    health_timeout_s: float = setting(60.0, min=1.0)
    #: a node whose matmul takes more than this many times the median of the other nodes' fails its check
    health_slow_factor: float = setting(2.0, min=1.0)
    #: the master serves Prometheus metrics on this port of metrics_host: -1 none (the default), 0 a free port (its
    #: URL is logged and shown by `stead status --json`); `stead master` has --metrics-port
    metrics_port: int = setting(-1, min=-1, max=65535)
    #: the address metrics are served on: loopback unless told otherwise (0.0.0.0 or a pod's IP for a Prometheus
    #: elsewhere, with metrics_token_file)
    metrics_host: str = "127.0.0.1"
    #: a file holding the bearer token a scrape must send (Prometheus' authorization.credentials_file); a request
    #: without it is answered 401 ("": no token asked)
    metrics_token_file: str = ""
    #: a file holding the job token (on a filesystem every host reads), for a job over several machines whose hosts
    #: do not have STEAD_JOB_TOKEN in their environment ("": STEAD_JOB_TOKEN)
    job_token_file: str = ""
    #: a metrics connection that sends nothing for this long while its request is read (or takes no answer) is
    #: closed (each connection holds a thread of the master while it is open)
    metrics_request_timeout_s: float = setting(10.0, min=0.001)
    #: the most metrics connections served at once; one more is closed at once, unread (a scrape is one)
    metrics_max_connections: int = setting(16, min=1)
    #: an effect (launching or killing a node, starting workers) running longer than this has failed
    effect_timeout_s: float = setting(60.0, min=0.001)
    #: a plugin handler running longer than this is cancelled and counted as a failure
    plugin_timeout_s: float = setting(10.0, min=0.001)
    #: a plugin that failed this many times in a row is disabled
    plugin_max_failures: int = setting(3, min=1)
    #: a background task of the master (heartbeat watcher, platform events) that failed this many times fails the
    #: master, which stops loudly (its successor replays the log); the state store being away is not counted
    #: (the task waits for it, up to retry_deadline_s)
    master_task_max_failures: int = setting(3, min=1)
    #: write a snapshot of the folded state every this many events (or every 2 events per node, when more)
    snapshot_every: int = setting(500, min=1)
    #: after a snapshot, the store's change history older than this many revisions is compacted (0: never)
    store_history_keep: int = 100_000
    #: first delay when retrying an unavailable store or master; doubled up to the max
    retry_initial_s: float = setting(0.2, min=0.001)
    retry_max_s: float = setting(5.0, min=0.001)
    #: give up retrying an unavailable store or master after this long: a running master rides out a store outage
    #: this long (then it stops and leaves the nodes to the next master), and a master taking over a running job
    #: waits this long for the store
    retry_deadline_s: float = 60.0
    #: an agent whose master has been gone this long stops its workers (they checkpoint on the way out) and
    #: exits cleanly: the job needs its master to go on, and `stead run` with the same job name resumes it
    master_gone_timeout_s: float = setting(60.0, min=0.001)
    #: a connection to the workers' rendezvous host that has not proven it holds the job's token within this long is
    #: closed by the host; a master that gets no proof from what listens at the host's recorded address within it
    #: refuses it and starts a new host
    rdzv_host_auth_timeout_s: float = setting(10.0, min=0.001)
    #: the most connections the rendezvous host holds that have not proven the job's token yet; one more closes the
    #: oldest (a local process opening connections cannot lock a master out)
    rdzv_host_max_pending: int = setting(16, min=1)
    #: how many times `stead run` starts a new master after one died while the job ran (the agents and workers
    #: keep running meanwhile, and the new master adopts them)
    master_max_restarts: int = setting(3, min=0)
    #: a master starting a job gives up on a store it cannot reach after this long (a running one rides out
    #: outages for retry_deadline_s, and one taking over a running job waits that long)
    store_connect_timeout_s: float = setting(5.0, min=0.001)
    #: the largest write the store takes, bytes: one value, or every key and value of one transaction together
    #: (0: the backend's own: etcd's default --max-request-bytes, 1.5 MiB; sqlite and memory: 1 GB; at least
    #: 64 KiB otherwise); set it to the --max-request-bytes of an etcd started with another. Larger values
    #: (snapshots) are written in chunks of this size, and a larger event is refused
    store_max_write_bytes: int = setting(0, min=0)
    #: a store call that takes longer than this counts as "store unavailable"
    store_timeout_s: float = setting(5.0, min=0.001)
    #: the etcd store over TLS: the CA that signed etcd's server certificate (PEM); "" = plain HTTP. Also
    #: ``ca_file=`` in the ``etcd://`` URL, which wins (as for every etcd_* setting)
    etcd_ca_file: str = ""
    #: a client certificate and its key (PEM) for an etcd with ``--client-cert-auth``; both or neither
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    #: log in to etcd as this user (etcd's authentication); also ``etcd://USER@host:port``
    etcd_user: str = ""
    #: the file holding etcd_user's password (one line); a password never goes in a URL or on a command line
    etcd_password_file: str = ""
    #: send etcd_user's password to an etcd without TLS (no etcd_ca_file), where anyone on the path reads it:
    #: refused unless this is true (an etcd on loopback, a test)
    etcd_allow_plaintext_password: bool = False
    #: an RPC to the master that takes longer than this counts as "master unavailable"
    rpc_timeout_s: float = setting(5.0, min=0.001)
    #: the largest RPC message the master accepts, bytes (gRPC's own default is 4 MiB); a larger one is refused
    #: RESOURCE_EXHAUSTED on its length prefix, before its body is read
    rpc_max_message_bytes: int = setting(4 << 20, min=64 << 10, max=1 << 30)
    #: the most connections the master's RPC server holds (fewer where its open-files limit would run out first);
    #: at the limit a new one makes it let go of an unauthenticated connection first, else of the one idle the
    #: longest (each agent and each worker that reads sharded data holds one)
    rpc_max_connections: int = setting(65_536, min=1)
    #: a connection with no call open for this long is closed (an agent's command stream is a call: it stays);
    #: the client's next call connects again
    rpc_idle_timeout_s: float = setting(300.0, min=0.001)
    #: a connection that made no call with the job's token within this long of opening is closed (a TLS one that
    #: has not finished its handshake too)
    rpc_auth_timeout_s: float = setting(10.0, min=0.001)
    #: mutual TLS for every RPC (the master's server, agents, spares, workers' clients, `stead scale`): the CA that
    #: signed every host's certificate (PEM; `stead certs` makes one per job); "" = plain TCP. All three tls_*
    #: settings or none, the same files' contents on every host; the job token is checked on top
    tls_ca_file: str = setting("")
    #: this host's certificate (PEM, signed by tls_ca_file; server and client use, with SANs for the names and
    #: addresses the master is reached by) and its private key
    tls_cert_file: str = setting("")
    tls_key_file: str = setting("")
    #: polling interval of the sqlite watch (other processes' writes)
    sqlite_watch_poll_s: float = setting(0.05, min=0.001)
    #: how long workers get between SIGTERM and SIGKILL when stopped
    worker_stop_grace_s: float = 3.0
    #: how long a round's workers wait for the warm zygote that is still importing torch before they start as
    #: fresh interpreters instead (forking from it beats a fresh interpreter importing torch beside it)
    zygote_wait_s: float = setting(30.0, min=0.0)
    #: how long an agent waits for its workers' stack dumps (a stopped worker never writes one)
    stacks_timeout_s: float = setting(2.0, min=0.1)
    #: the master sheds load while its event loop runs this late: registrations are refused with a retry-after
    #: (10,000 agents coming back at once after a master restart wait their turn instead of timing out)
    shed_lag_s: float = setting(2.0, min=0.01)
    #: every this often the master freezes the objects that survived the young collections out of CPython's full
    #: collections (at 10,000 nodes a full collection over them pauses the master for seconds; see
    #: stead/core/master/gcsteward.py); 0: the collector is left alone
    gc_freeze_every_s: float = setting(1.0, min=0.0)
    #: every this often the master thaws them and runs one full collection, which frees frozen garbage cycles
    gc_full_every_s: float = setting(600.0, min=1.0)
    #: the most nodes the platform may run for one job at once (0: no cap): `stead run` starts with at most this
    #: many and the scaler never aims at more (on the local platform: what this machine can hold)
    capacity_nodes: int = setting(0, min=0)
    #: a running round changes size (`stead scale`, a node that became available) at the next checkpoint commit,
    #: a step boundary every rank holds; when none comes within this long it changes size anyway
    resize_wait_s: float = setting(30.0, min=0.0)
    #: a running round grows once for the nodes that become ready within this long of the first (they were asked
    #: for together), instead of once per node; the job trains meanwhile
    grow_window_s: float = setting(5.0, min=0.0)
    #: how many trailing lines of a failed worker's stderr are reported
    error_tail_lines: int = 40
    #: how often the agent samples step progress, and the master records it as an event
    progress_interval_s: float = setting(1.0, min=0.001)
    #: agents a platform keeps started and warm per job (torch imported, zygote ready), so that a lost node's
    #: replacement skips the seconds of a cold start (the local platform; 0: none)
    spare_agents: int = setting(1, min=0, max=8)
    #: a platform starts its spare agents once no node was launched for this long: not while the job's own
    #: nodes start, which they would slow down
    spare_delay_s: float = setting(5.0, min=0.0)
    #: how long `stead run` waits for nodes to exit after the job ended (their agents write the newest
    #: checkpoint to disk first, see ckpt.persist_on_stop), and the platform again before it kills them
    shutdown_grace_s: float = 30.0
    #: count the workers' optimizer steps as training steps when a script never calls stead.report_step
    auto_step: bool = True
    #: settings of plugins, by plugin name (``--set ckpt.keep_last=3``): raw strings until the plugin is loaded
    plugin_values: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.health_check not in HEALTH_CHECK_CHOICES:
            raise ConfigError(f"setting health_check={self.health_check!r} is not a mode: use one of "
                              f"{', '.join(HEALTH_CHECK_CHOICES)} (--set health_check=all)")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, base: Settings | None = None) -> Settings:
        """Settings with ``values`` (strings or typed) applied over ``base``; ``plugin.name`` keys go to plugins."""
        base = base or cls()
        own: dict[str, Any] = {}
        plugins: dict[str, dict[str, str]] = {name: dict(v) for name, v in base.plugin_values.items()}
        for name, raw in values.items():
            plugin, dot, field = name.partition(".")
            if dot:
                if not plugin or not field:
                    raise ConfigError(f"setting {name!r} must be NAME or PLUGIN.NAME, e.g. ckpt.keep_last")
                plugins.setdefault(plugin, {})[field] = str(raw)
            else:
                own[name] = raw
        changed = _convert_all(cls, own, owner="stead")
        return dataclasses.replace(base, **changed, plugin_values=plugins)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """``STEAD_<NAME>`` variables of stead's own settings (plugins read theirs in :func:`load_settings`)."""
        env = os.environ if environ is None else environ
        values = {name: env[env_name("", name)] for name in _field_names(cls) if env_name("", name) in env}
        return cls.from_mapping(values)

    def to_mapping(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def env_name(plugin: str, name: str) -> str:
    """The environment variable of a setting: ``STEAD_<NAME>``, or ``STEAD_<PLUGIN>_<NAME>`` for a plugin's."""
    parts = [plugin, name] if plugin else [name]
    return "STEAD_" + "_".join(p.upper().replace("-", "_").replace(".", "_") for p in parts)


def settings_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """``--set`` values as the ``STEAD_*`` variables a child process (a worker) reads them from."""
    env = {}
    for name, value in overrides.items():
        plugin, dot, field = name.partition(".")
        env[env_name(plugin, field) if dot else env_name("", name)] = str(value)
    return env


def load_settings(cls: type[T], plugin: str, settings: Settings | None = None,
                  environ: Mapping[str, str] | None = None) -> T:
    """``plugin``'s typed settings: defaults, then ``STEAD_<PLUGIN>_<NAME>``, then ``--set plugin.name`` values."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"plugin {plugin!r}: settings_class must be a dataclass, got {cls!r}")
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {n: env[env_name(plugin, n)] for n in _field_names(cls) if env_name(plugin, n) in env}
    if settings is not None:
        values.update(settings.plugin_values.get(plugin, {}))
    try:
        return cls(**_convert_all(cls, values, owner=plugin))
    except TypeError as exc:  # a field without a default that nobody set
        raise ConfigError(f"plugin {plugin!r} settings: {exc}; set it with --set {plugin}.NAME=VALUE") from None


def settings_help(cls: type, plugin: str = "") -> str:
    """``name=default`` for every field: the list an error shows next to an unknown name."""
    prefix = f"{plugin}." if plugin else ""
    return ", ".join(f"{prefix}{f.name}={f.default!r}" if f.default is not dataclasses.MISSING else prefix + f.name
                     for f in dataclasses.fields(cls) if f.name != "plugin_values")


def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.name != "plugin_values")


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def _convert_all(cls: type, values: Mapping[str, Any], *, owner: str) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "plugin_values"}
    prefix = "" if owner == "stead" else f"{owner}."
    converted: dict[str, Any] = {}
    for name, raw in values.items():
        field = fields.get(name)
        if field is None:
            whose = "stead" if owner == "stead" else f"the {owner} plugin"
            known = settings_help(cls, "" if owner == "stead" else owner)
            raise ConfigError(f"unknown setting {prefix + name!r}; settings of {whose}: {known}")
        converted[name] = _convert(f"{prefix}{name}", _hints(cls)[name], raw, field)
    return converted


def _convert(name: str, kind: Any, raw: Any, field: dataclasses.Field[Any]) -> Any:
    unit = " seconds" if name.endswith("_s") else ""
    if kind is bool:
        text = str(raw).strip().lower()
        if isinstance(raw, bool):
            return raw
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"setting {name}={raw!r} must be true or false (1/0)")
    if kind in (int, float):
        try:
            value = kind(raw) if not isinstance(raw, str) else kind(raw.strip())
        except (TypeError, ValueError):
            raise ConfigError(f"setting {name}={raw!r} is not a valid {kind.__name__}"
                              f"{' (a number of seconds)' if unit else ''}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"setting {name}={raw!r} must be a finite number{' of seconds' if unit else ''}")
        low, high = field.metadata.get(_MIN), field.metadata.get(_MAX)
        if value < 0 and (low is None or low >= 0):  # a field whose min is negative allows it
            raise ConfigError(f"setting {name}={raw!r} must not be negative"
                              f"{' (it is a number of seconds)' if unit else ''}")
        if low is not None and value < low:
            raise ConfigError(f"setting {name}={raw!r} must be at least {low:g}{unit}")
        if high is not None and value > high:
            raise ConfigError(f"setting {name}={raw!r} must be at most {high:g}{unit}")
        return value
    if kind is str:
        return str(raw)
    raise ConfigError(f"setting {name} has a type stead cannot set from text ({kind!r}); use str, int, float or bool")
