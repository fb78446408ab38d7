"""stead's plugin SDK: everything a plugin author needs, from one public, typed module.

A master plugin::

    import dataclasses
    from stead.plugin import Plugin, PluginContext, Record, WorkerFailed, setting

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NotifierSettings:
        url: str = setting("", help="where to post")

    class Notifier(Plugin[NotifierSettings]):
        name = "notifier"                     # also the entry point's name and the settings' namespace
        subscriptions = (WorkerFailed,)
        settings_class = NotifierSettings     # --set notifier.url=... or STEAD_NOTIFIER_URL=...

        async def handle(self, *, record: Record, ctx: PluginContext[NotifierSettings]) -> None:
            ctx.state                          # the job's state right after this record
            await ctx.emit(...)                # an event of yours (see event_kind) or of stead's

registered in the package's ``pyproject.toml``::

    [project.entry-points."stead.plugins"]
    notifier = "my_package:Notifier"

What is here:

* the contract: :class:`MasterPlugin` (what the master calls: ``name``,
  ``subscriptions``, ``handle``), :class:`Plugin` (its base class: ``start``/``handle``/
  ``stop``, all optional), the per-plugin :class:`PluginContext` (settings, store keys,
  state, ``emit``, ``request_restart``, ``request_relaunch``, ``add_rpc_handler``, and
  ``tasks``, the plugin's :class:`PluginTasks`: background work goes there, as
  ``ctx.tasks.start(self._watch, ctx, name="watch")``, never a bare
  ``asyncio.create_task``; the master cancels and awaits those tasks when it stops,
  before ``stop()``, and a task that raises disables the plugin with a ``PluginFailed``),
  typed settings (:func:`setting`, :func:`load_settings`);
* events: :class:`Event`, :func:`event_kind` for your own kinds, :class:`Record`,
  and every event kind of stead (``WorkerFailed``, ``NodeLost``, ...); ``TimerFired``
  names its timer by a typed :data:`TimerName` (``DecisionTimeout(round=3)``, ...);
* the job's state: :class:`JobState`, :class:`JobPhase`, :class:`NodeState`, ...;
* the default recovery policy (:func:`classify`, :func:`default_decision`);
* errors, the store protocol (:class:`ChunkedValue` for a value larger than one
  store write, :func:`write_size` to measure one), retry helpers;
* RPC: :func:`invalid`, :func:`backend_errors` and the request checks (:func:`check_name`,
  :func:`name_problem`, :func:`at_least`, :func:`finite_figure`) for servicers and :class:`RpcConnection`
  for clients (:func:`client_tls` gives its ``tls`` from the settings), and ``proto`` (the generated messages
  of the agents' protocol; a plugin generates its own: ``proto/stead/plugins/NAME/v1`` into
  ``stead/plugins/NAME/_proto`` for a bundled one, which its package exports as ``proto``, see
  ``scripts/gen_proto.sh``);
* the node side: :class:`AgentExtension` (``stead.agent_extensions`` entry points),
  :class:`AgentContext`, :class:`RoundInfo`; for an extension that talks to its peers on other hosts,
  :data:`HOST_ENV` (the variable naming the node's host), :func:`interface_toward` (the local address that
  reaches the master) and the job's TLS (:func:`tls_files`, :func:`server_context`, :func:`client_context`).

Imports are lazy: a training script that imports a worker-side helper from here
pays only for what that helper needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # explicit re-exports for type checkers; at run time __getattr__ imports on first use
    from stead.core.agent.extensions import (
        AgentContext as AgentContext,
    )
    from stead.core.agent.extensions import (
        AgentExtension as AgentExtension,
    )
    from stead.core.agent.extensions import (
        RoundInfo as RoundInfo,
    )
    from stead.core.agent.netif import (
        interface_toward as interface_toward,
    )
    from stead.core.config import (
        Settings as Settings,
    )
    from stead.core.config import (
        env_name as env_name,
    )
    from stead.core.config import (
        load_settings as load_settings,
    )
    from stead.core.config import (
        setting as setting,
    )
    from stead.core.entrypoints import (
        load_named as load_named,
    )
    from stead.core.errors import (
        CodecError as CodecError,
    )
    from stead.core.errors import (
        ConfigError as ConfigError,
    )
    from stead.core.errors import (
        InvalidRequest as InvalidRequest,
    )
    from stead.core.errors import (
        LogCorrupt as LogCorrupt,
    )
    from stead.core.errors import (
        PermanentError as PermanentError,
    )
    from stead.core.errors import (
        PluginError as PluginError,
    )
    from stead.core.errors import (
        RetryableError as RetryableError,
    )
    from stead.core.errors import (
        RpcUnavailable as RpcUnavailable,
    )
    from stead.core.errors import (
        SteadError as SteadError,
    )
    from stead.core.errors import (
        StoreError as StoreError,
    )
    from stead.core.errors import (
        StoreUnavailable as StoreUnavailable,
    )
    from stead.core.errors import (
        WriteTooLarge as WriteTooLarge,
    )
    from stead.core.events import (
        CheckpointCommitted as CheckpointCommitted,
    )
    from stead.core.events import (
        CheckpointPersisted as CheckpointPersisted,
    )
    from stead.core.events import (
        CheckpointRestored as CheckpointRestored,
    )
    from stead.core.events import (
        EffectFailed as EffectFailed,
    )
    from stead.core.events import (
        Event as Event,
    )
    from stead.core.events import (
        EventMark as EventMark,
    )
    from stead.core.events import (
        JobFailed as JobFailed,
    )
    from stead.core.events import (
        JobStopped as JobStopped,
    )
    from stead.core.events import (
        JobSubmitted as JobSubmitted,
    )
    from stead.core.events import (
        JobSucceeded as JobSucceeded,
    )
    from stead.core.events import (
        MembershipDecided as MembershipDecided,
    )
    from stead.core.events import (
        NodeExited as NodeExited,
    )
    from stead.core.events import (
        NodeJoined as NodeJoined,
    )
    from stead.core.events import (
        NodeLost as NodeLost,
    )
    from stead.core.events import (
        NodePending as NodePending,
    )
    from stead.core.events import (
        NodeRequested as NodeRequested,
    )
    from stead.core.events import (
        NodeResourcesDecided as NodeResourcesDecided,
    )
    from stead.core.events import (
        NodeStarted as NodeStarted,
    )
    from stead.core.events import (
        NumericsNote as NumericsNote,
    )
    from stead.core.events import (
        NumericsReported as NumericsReported,
    )
    from stead.core.events import (
        PluginFailed as PluginFailed,
    )
    from stead.core.events import (
        PluginsStarted as PluginsStarted,
    )
    from stead.core.events import (
        Record as Record,
    )
    from stead.core.events import (
        RecoveryAction as RecoveryAction,
    )
    from stead.core.events import (
        RecoveryDecided as RecoveryDecided,
    )
    from stead.core.events import (
        RelaunchRequested as RelaunchRequested,
    )
    from stead.core.events import (
        RestartRequested as RestartRequested,
    )
    from stead.core.events import (
        RoomFound as RoomFound,
    )
    from stead.core.events import (
        RoundCompleted as RoundCompleted,
    )
    from stead.core.events import (
        RoundStarted as RoundStarted,
    )
    from stead.core.events import (
        StackSample as StackSample,
    )
    from stead.core.events import (
        StacksDumped as StacksDumped,
    )
    from stead.core.events import (
        StacksRequested as StacksRequested,
    )
    from stead.core.events import (
        StepProgress as StepProgress,
    )
    from stead.core.events import (
        TimerFired as TimerFired,
    )
    from stead.core.events import (
        TimerName as TimerName,
    )
    from stead.core.events import (
        TransitionRejected as TransitionRejected,
    )
    from stead.core.events import (
        WorkerFailed as WorkerFailed,
    )
    from stead.core.events import (
        WorkersStarted as WorkersStarted,
    )
    from stead.core.events import (
        WorkersSucceeded as WorkersSucceeded,
    )
    from stead.core.events import (
        event_kind as event_kind,
    )
    from stead.core.platform import (
        HOST_ENV as HOST_ENV,
    )
    from stead.core.plugins import (
        MasterPlugin as MasterPlugin,
    )
    from stead.core.plugins import (
        NodeTelemetry as NodeTelemetry,
    )
    from stead.core.plugins import (
        NoSettings as NoSettings,
    )
    from stead.core.plugins import (
        Plugin as Plugin,
    )
    from stead.core.plugins import (
        PluginContext as PluginContext,
    )
    from stead.core.plugins import (
        PluginTasks as PluginTasks,
    )
    from stead.core.retry import (
        Backoff as Backoff,
    )
    from stead.core.retry import (
        retrying as retrying,
    )
    from stead.core.rpc import (
        RpcConnection as RpcConnection,
    )
    from stead.core.rpc import (
        client_tls as client_tls,
    )
    from stead.core.rpc import (
        read_token_file as read_token_file,
    )
    from stead.core.rpc._checks import (
        MAX_NODE_ID_CHARS as MAX_NODE_ID_CHARS,
    )
    from stead.core.rpc._checks import (
        check_name as check_name,
    )
    from stead.core.rpc._checks import (
        name_problem as name_problem,
    )
    from stead.core.rpc._proto.stead import v1 as proto
    from stead.core.rpc._status import (
        at_least as at_least,
    )
    from stead.core.rpc._status import (
        backend_errors as backend_errors,
    )
    from stead.core.rpc._status import (
        finite_figure as finite_figure,
    )
    from stead.core.rpc._status import (
        invalid as invalid,
    )
    from stead.core.rpc.tls import (
        client_context as client_context,
    )
    from stead.core.rpc.tls import (
        server_context as server_context,
    )
    from stead.core.rpc.tls import (
        tls_files as tls_files,
    )
    from stead.core.statemachine import (
        JobPhase as JobPhase,
    )
    from stead.core.statemachine import (
        JobState as JobState,
    )
    from stead.core.statemachine import (
        NodePhase as NodePhase,
    )
    from stead.core.statemachine import (
        NodeState as NodeState,
    )
    from stead.core.statemachine import (
        RendezvousState as RendezvousState,
    )
    from stead.core.statemachine.policy import (
        DEFAULT_DECIDER as DEFAULT_DECIDER,
    )
    from stead.core.statemachine.policy import (
        DETERMINISTIC as DETERMINISTIC,
    )
    from stead.core.statemachine.policy import (
        classify as classify,
    )
    from stead.core.statemachine.policy import (
        default_decision as default_decision,
    )
    from stead.core.statemachine.policy import (
        last_exception as last_exception,
    )
    from stead.core.statemachine.policy import (
        last_traceback as last_traceback,
    )
    from stead.core.store import (
        write_size as write_size,
    )
    from stead.core.store.base import (
        KeyValue as KeyValue,
    )
    from stead.core.store.base import (
        StateStore as StateStore,
    )
    from stead.core.store.chunked import (
        ChunkedValue as ChunkedValue,
    )
    from stead.core.worker.numerics_settings import (
        NumericsSettings as NumericsSettings,
    )

_WHERE = {
    "stead.core.agent.extensions": ("AgentContext", "AgentExtension", "RoundInfo"),
    "stead.core.config": ("Settings", "env_name", "load_settings", "setting"),
    "stead.core.entrypoints": ("load_named",),
    "stead.core.errors": ("CodecError", "ConfigError", "InvalidRequest", "LogCorrupt", "PermanentError", "PluginError",
                          "RetryableError", "RpcUnavailable", "SteadError", "StoreError", "StoreUnavailable",
                          "WriteTooLarge"),
    "stead.core.events": ("CheckpointCommitted", "CheckpointPersisted", "CheckpointRestored", "EffectFailed", "Event",
                          "EventMark", "JobFailed", "JobStopped", "JobSubmitted",
                          "JobSucceeded", "MembershipDecided", "NodeExited", "NodeJoined", "NodeLost", "NodePending",
                          "NodeRequested", "NodeResourcesDecided", "NodeStarted",
                          "NumericsNote", "NumericsReported", "PluginFailed", "PluginsStarted", "Record",
                          "RecoveryAction", "RecoveryDecided",
                          "RelaunchRequested", "RestartRequested", "RoundCompleted", "RoundStarted", "StackSample",
                          "StacksDumped", "StacksRequested", "StepProgress", "RoomFound",
                          "TimerFired", "TimerName", "TransitionRejected", "WorkerFailed", "WorkersStarted",
                          "WorkersSucceeded", "event_kind"),
    "stead.core.plugins": ("MasterPlugin", "NoSettings", "NodeTelemetry", "Plugin", "PluginContext", "PluginTasks"),
    "stead.core.retry": ("Backoff", "retrying"),
    "stead.core.rpc": ("RpcConnection", "client_tls", "read_token_file"),
    "stead.core.rpc.tls": ("client_context", "server_context", "tls_files"),
    "stead.core.agent.netif": ("interface_toward",),
    "stead.core.platform": ("HOST_ENV",),
    "stead.core.rpc._checks": ("MAX_NODE_ID_CHARS", "check_name", "name_problem"),
    "stead.core.rpc._status": ("at_least", "backend_errors", "finite_figure", "invalid"),
    "stead.core.statemachine": ("JobPhase", "JobState", "NodePhase", "NodeState", "RendezvousState"),
    "stead.core.statemachine.policy": ("DEFAULT_DECIDER", "DETERMINISTIC", "classify", "default_decision",
                                       "last_exception", "last_traceback"),
    "stead.core.store": ("write_size",),
    "stead.core.store.base": ("KeyValue", "StateStore"),
    "stead.core.store.chunked": ("ChunkedValue",),
    "stead.core.worker.numerics_settings": ("NumericsSettings",),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = [
    "AgentContext",
    "AgentExtension",
    "Backoff",
    "CheckpointCommitted",
    "CheckpointPersisted",
    "CheckpointRestored",
    "ChunkedValue",
    "CodecError",
    "ConfigError",
    "DEFAULT_DECIDER",
    "DETERMINISTIC",
    "EffectFailed",
    "Event",
    "EventMark",
    "InvalidRequest",
    "JobFailed",
    "JobPhase",
    "JobState",
    "JobStopped",
    "JobSubmitted",
    "JobSucceeded",
    "KeyValue",
    "LogCorrupt",
    "MAX_NODE_ID_CHARS",
    "MasterPlugin",
    "MembershipDecided",
    "NoSettings",
    "NodeExited",
    "NodeJoined",
    "NodeLost",
    "NodePending",
    "NodePhase",
    "NodeRequested",
    "NodeResourcesDecided",
    "NodeStarted",
    "NodeState",
    "NodeTelemetry",
    "PermanentError",
    "Plugin",
    "PluginContext",
    "PluginError",
    "PluginFailed",
    "PluginTasks",
    "PluginsStarted",
    "Record",
    "RecoveryAction",
    "RecoveryDecided",
    "RelaunchRequested",
    "RendezvousState",
    "RestartRequested",
    "RetryableError",
    "RoomFound",
    "RoundCompleted",
    "RoundInfo",
    "RoundStarted",
    "RpcConnection",
    "RpcUnavailable",
    "Settings",
    "StateStore",
    "StackSample",
    "NumericsNote",
    "NumericsReported",
    "NumericsSettings",
    "StacksDumped",
    "StacksRequested",
    "SteadError",
    "StepProgress",
    "StoreError",
    "StoreUnavailable",
    "TimerFired",
    "TimerName",
    "TransitionRejected",
    "WorkerFailed",
    "WorkersStarted",
    "WorkersSucceeded",
    "at_least",
    "WriteTooLarge",
    "backend_errors",
    "check_name",
    "classify",
    "client_context",
    "client_tls",
    "interface_toward",
    "server_context",
    "tls_files",
    "HOST_ENV",
    "default_decision",
    "env_name",
    "event_kind",
    "finite_figure",
    "invalid",
    "last_exception",
    "last_traceback",
    "load_named",
    "load_settings",
    "name_problem",
    "proto",
    "read_token_file",
    "retrying",
    "setting",
    "write_size",
]


def __getattr__(name: str) -> Any:
    if name == "proto":
        return importlib.import_module("stead.core.rpc._proto.stead.v1")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'stead.plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
