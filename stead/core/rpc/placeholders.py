"""Servicers for services this stead version declares but does not implement yet.

Every call is answered UNIMPLEMENTED with a message that says so, instead of
grpclib's bare "Method not found", so that a newer client knows what to do.
"""

from __future__ import annotations

from typing import NoReturn

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from stead.core.rpc._proto.stead.v1 import (
    Ack,
    CheckpointServiceBase,
    CompleteShardsRequest,
    GetCommittedReply,
    GetCommittedRequest,
    LeaseShardsReply,
    LeaseShardsRequest,
    RegisterDatasetRequest,
    ReportCorruptRequest,
    ReportRestoredRequest,
    ReportSavedReply,
    ReportSavedRequest,
    ShardServiceBase,
)

__all__ = ["CheckpointServicer", "ShardServicer"]


def _unimplemented(method: str) -> NoReturn:
    raise GRPCError(Status.UNIMPLEMENTED, f"{method} is not available in this stead version: "
                                          "upgrade stead on the master, or do not use this feature")


class ShardServicer(ShardServiceBase):
    """ShardService placeholder: dynamic data sharding is provided by a later version."""

    async def register_dataset(self, message: RegisterDatasetRequest) -> Ack:
        _unimplemented("ShardService.RegisterDataset")

    async def lease_shards(self, message: LeaseShardsRequest) -> LeaseShardsReply:
        _unimplemented("ShardService.LeaseShards")

    async def complete_shards(self, message: CompleteShardsRequest) -> Ack:
        _unimplemented("ShardService.CompleteShards")


class CheckpointServicer(CheckpointServiceBase):
    """CheckpointService placeholder: checkpoint coordination is provided by a later version."""

    async def report_saved(self, message: ReportSavedRequest) -> ReportSavedReply:
        _unimplemented("CheckpointService.ReportSaved")

    async def get_committed(self, message: GetCommittedRequest) -> GetCommittedReply:
        _unimplemented("CheckpointService.GetCommitted")

    async def report_restored(self, message: ReportRestoredRequest) -> Ack:
        _unimplemented("CheckpointService.ReportRestored")

    async def report_corrupt(self, message: ReportCorruptRequest) -> Ack:
        _unimplemented("CheckpointService.ReportCorrupt")
