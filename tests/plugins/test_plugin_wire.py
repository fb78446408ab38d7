"""The bundled plugins' services keep the wire they had when their protos were generated into stead.core: the same
method paths (an agent or a worker of either release calls them) with the same messages, in package stead.v1."""

from __future__ import annotations

import betterproto2

from stead.plugins.ckpt import proto as ckpt_pb
from stead.plugins.scaler import proto as scaler_pb
from stead.plugins.sharding import proto as sharding_pb

#: every method a bundled plugin serves: its path and (request, reply) messages, as they were in proto/stead/v1
ROUTES = {
    "/stead.v1.CheckpointService/ReportSaved": ("ReportSavedRequest", "ReportSavedReply"),
    "/stead.v1.CheckpointService/GetCommitted": ("GetCommittedRequest", "GetCommittedReply"),
    "/stead.v1.CheckpointService/ReportRestored": ("ReportRestoredRequest", "Ack"),
    "/stead.v1.CheckpointService/ReportCorrupt": ("ReportCorruptRequest", "Ack"),
    "/stead.v1.ShardService/RegisterDataset": ("RegisterDatasetRequest", "Ack"),
    "/stead.v1.ShardService/LeaseShards": ("LeaseShardsRequest", "LeaseShardsReply"),
    "/stead.v1.ShardService/CompleteShards": ("CompleteShardsRequest", "Ack"),
    "/stead.v1.ShardService/SaveCursor": ("SaveCursorRequest", "SaveCursorReply"),
    "/stead.v1.ShardService/RestoreCursor": ("RestoreCursorRequest", "Ack"),
    "/stead.v1.ScalerService/Scale": ("ScaleRequest", "ScaleReply"),
    "/stead.v1.ScalerService/BatchHint": ("BatchHintRequest", "BatchHintReply"),
}


def test_the_bundled_plugins_serve_the_method_paths_of_package_stead_v1() -> None:
    bases = (ckpt_pb.CheckpointServiceBase, sharding_pb.ShardServiceBase, scaler_pb.ScalerServiceBase)
    served = {path: (handler.request_type.__name__, handler.reply_type.__name__)
              for base in bases for path, handler in base().__mapping__().items()}  # type: ignore[abstract]
    assert served == ROUTES


def test_each_plugins_messages_are_named_in_package_stead_v1() -> None:
    for module in (ckpt_pb, sharding_pb, scaler_pb):
        pool = module.default_message_pool  # the generated module's own pool, as it registered its messages
        messages = [cls for cls in vars(module).values()
                    if isinstance(cls, type) and issubclass(cls, betterproto2.Message)]
        assert messages
        assert {pool.type_to_url[cls] for cls in messages} == {
            f"type.googleapis.com/stead.v1.{cls.__name__}" for cls in messages}

