"""One error hierarchy for stead.

Every message says what was wrong and what to do about it. Errors are split into
*retryable* (the same call may succeed later: a store that is down, a lost
connection) and *permanent* (bad input, corrupt data: retrying will not help)::

    SteadError
    ├── RetryableError
    │   ├── StoreUnavailable        the state store cannot be reached
    │   ├── RpcUnavailable          the master cannot be reached over RPC
    │   ├── PlatformUnavailable     the platform's API (Kubernetes) cannot be reached
    │   ├── ReactorStopped          the master stopped before it recorded a submitted event
    │   └── MasterTaskFailed        a background task of the master kept failing: the master stopped
    └── PermanentError
        ├── ConfigError             bad configuration or command-line input
        ├── CodecError              a stored or received record cannot be decoded
        ├── LogCorrupt              the event log has a gap, duplicate or bad record
        ├── LogConflict             another writer appended the same seq first
        ├── StoreError              the store refused an operation
        │   └── WriteTooLarge       a write (or an event) is larger than the store takes in one write
        ├── PluginError             a plugin failed to load or validate
        ├── PlatformError           the platform could not launch or kill a node
        │   └── PlatformRejected    the platform refuses the node as specified: retrying cannot help
        ├── Unauthenticated         an RPC carried a missing or wrong job token
        └── InvalidRequest          an RPC or API call carried bad arguments
"""

from __future__ import annotations

__all__ = [
    "CodecError",
    "ConfigError",
    "EffectDeclined",
    "HungUp",
    "InvalidRequest",
    "LogConflict",
    "LogCorrupt",
    "MasterTaskFailed",
    "Overloaded",
    "PermanentError",
    "PlatformError",
    "PlatformRejected",
    "PlatformUnavailable",
    "PluginError",
    "ReactorStopped",
    "RetryableError",
    "RpcUnavailable",
    "SteadError",
    "StoreError",
    "StoreUnavailable",
    "Unauthenticated",
    "WriteTooLarge",
]


class SteadError(Exception):
    """Base of every error stead raises on purpose."""


class RetryableError(SteadError):
    """The same operation may succeed if tried again later."""

    #: how long the other side asked the caller to wait before trying again (a master shedding load); 0: no hint
    retry_after_s: float = 0.0


class PermanentError(SteadError):
    """Retrying the same operation will not help; the input or data must change."""


class StoreUnavailable(RetryableError):
    """The state store could not be reached or timed out."""


class RpcUnavailable(RetryableError):
    """The master's RPC endpoint could not be reached."""


class HungUp(RpcUnavailable):
    """The master closed the connection before it said anything: TLS refused it (a plain-text client, a
    certificate it does not trust), or it shed the connection at its limit. Retryable, since the second is
    transient; a caller that sees it again and again may say that TLS is the likelier cause."""


class PlatformUnavailable(RetryableError):
    """The platform's API (the Kubernetes API server) could not be reached or timed out."""


class Overloaded(RetryableError):
    """The master sheds load: it refused the call for now, and says how long to wait (``retry_after_s``)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ReactorStopped(RetryableError):
    """The master stopped before it processed a submitted event; the next master will take it."""


class MasterTaskFailed(RetryableError):
    """A background task of the master kept failing; the master stopped rather than run half-blind."""


class ConfigError(PermanentError):
    """Configuration or command-line input is invalid."""


class CodecError(PermanentError):
    """A record could not be encoded or decoded."""


class LogCorrupt(PermanentError):
    """The event log is not a gap-free sequence of valid records."""


class LogConflict(PermanentError):
    """Another writer appended the sequence number this writer wanted."""


class StoreError(PermanentError):
    """The store rejected an operation (bad key, unknown lease, ...)."""


class WriteTooLarge(StoreError):
    """A write is larger than the store takes at once (its ``max_write_bytes``; etcd's ``--max-request-bytes``):
    refused before the store was asked, nothing was written."""


class PluginError(PermanentError):
    """A plugin could not be loaded or does not satisfy the plugin protocol."""


class PlatformError(PermanentError):
    """The platform could not carry out a launch or kill."""


class PlatformRejected(PlatformError):
    """The platform refuses the node as it is specified (an invalid resource request, a name it does not allow,
    no permission): launching it again would fail the same way."""


class EffectDeclined(PermanentError):
    """This master cannot carry out the effect (a node launch without a platform): it stays unclaimed, for a
    master that can (one started with a platform, resuming the job) to run it."""


class Unauthenticated(PermanentError):
    """An RPC carried no job token or the wrong one."""


class InvalidRequest(PermanentError):
    """A request carried arguments that cannot be honoured."""
