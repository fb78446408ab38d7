"""RPC between the master, the agents and the workers (grpclib, betterproto2).

The wire schema is ``proto/stead/v1/*.proto``; ``_proto/`` is generated from it
by ``make proto`` (scripts/gen_proto.sh) and never edited by hand. Protobuf
types stay inside this package: the master implements :class:`AgentBackend`
with plain dataclasses (an agent's report is the event it reports, in an
:class:`AgentReport`), agents use :class:`MasterClient`;
:class:`RpcConnection` is the channel plugins' clients build on. Every call carries
the job token (see :mod:`.auth`); with the ``tls_*`` settings every connection is mutual TLS
(:mod:`.tls`: :func:`client_tls` for clients, :func:`server_context` for servers).

What any client may send, and how a refusal reads, are public too, for a plugin's
own messages and for clients that are not stead's: every string is bounded
(:data:`MAX_TEXT_CHARS` unless :data:`FIELD_BOUNDS` says otherwise), every repeated
field (:data:`MAX_ENTRIES` unless :data:`COUNT_BOUNDS` says otherwise), a message
holds at most :data:`MAX_UNKNOWN_FIELDS` fields its schema does not know
(:func:`check_wire` checks a request's bytes against all that), and a refusal
carries a :class:`Refusal` as gRPC status details (:class:`RefusalCodec`). Which
connections a server keeps, lets go first and closes for waiting too long is
:class:`Links`' rule (one :class:`Link` per connection). :func:`length_delimited` writes one
length-delimited field, for a client that builds a message's bytes itself.
"""

from stead.core.rpc._checks import FIELD_BOUNDS, MAX_TEXT_CHARS
from stead.core.rpc._links import Link, Links
from stead.core.rpc._protowire import length_delimited
from stead.core.rpc._refusals import Refusal, RefusalCodec
from stead.core.rpc._wire import COUNT_BOUNDS, MAX_ENTRIES, MAX_UNKNOWN_FIELDS, check_wire
from stead.core.rpc.address import format_address, parse_address
from stead.core.rpc.agent_service import AgentServicer
from stead.core.rpc.auth import AUTH_METADATA_KEY, attach_token, require_token
from stead.core.rpc.backend import (
    AgentBackend,
    AgentCommand,
    AgentReport,
    CheckHealthCmd,
    DumpStacksCmd,
    HeartbeatInfo,
    RegisterInfo,
    RegisterResult,
    StartWorkersCmd,
    StopNodeCmd,
    StopWorkersCmd,
)
from stead.core.rpc.client import HeartbeatStream, MasterClient, RpcConnection, retrying
from stead.core.rpc.server import RpcServer, Servicer
from stead.core.rpc.tls import TLS_HINT, TlsFiles, client_context, client_tls, server_context, tls_files
from stead.core.tokenfile import check_token, new_token, read_token_file, token_verifier, verifies, write_token_file

__all__ = [
    "AUTH_METADATA_KEY",
    "COUNT_BOUNDS",
    "FIELD_BOUNDS",
    "MAX_ENTRIES",
    "MAX_TEXT_CHARS",
    "MAX_UNKNOWN_FIELDS",
    "AgentBackend",
    "AgentCommand",
    "AgentReport",
    "AgentServicer",
    "CheckHealthCmd",
    "DumpStacksCmd",
    "HeartbeatInfo",
    "HeartbeatStream",
    "Link",
    "Links",
    "MasterClient",
    "Refusal",
    "RefusalCodec",
    "RegisterInfo",
    "RegisterResult",
    "RpcConnection",
    "RpcServer",
    "Servicer",
    "StartWorkersCmd",
    "StopNodeCmd",
    "StopWorkersCmd",
    "TLS_HINT",
    "TlsFiles",
    "attach_token",
    "check_token",
    "check_wire",
    "client_context",
    "client_tls",
    "format_address",
    "length_delimited",
    "new_token",
    "parse_address",
    "read_token_file",
    "require_token",
    "retrying",
    "server_context",
    "tls_files",
    "token_verifier",
    "verifies",
    "write_token_file",
]
