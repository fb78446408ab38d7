"""A torch.distributed.checkpoint StorageReader over a step's parts: DCP plans a reshard, stead reads the bytes.

DCP's own FileSystemReader unpickles ``.metadata`` and hands every plain value's
record to ``torch.load(weights_only=False)``. :class:`ManifestReader` gives DCP the
step's ``Metadata`` built from the (hashed, JSON) manifests or slot layouts, drops the
plain values' reads from the plan (they are in the state already, from the JSON tree)
and has each tensor chunk read from its raw bytes (a data file, a slot in some node's
memory), checked against its checksum, into memory of its own: the copies into the
destinations are made once every chunk has passed (:func:`stage_chunks` returns them).
Imported only when a step is resharded: importing DCP takes most of a second.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Generic

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt._codec import TensorMeta, dtype_from_name
from stead.plugins.ckpt.errors import CheckpointError, StateMismatch

__all__ = ["ManifestReader", "stage_chunks"]

#: reads tensor ``index`` of a part into the memory given (its exact bytes) and checks it against its checksum
ReadChunk = Callable[[_disk.P, int, memoryview], None]


def stage_chunks(target: dict[Any, Any], index: _disk.DcpIndex[_disk.P], read: ReadChunk[_disk.P]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The copies that fill ``target``'s tensors (DTensors resharded) from the step ``index`` describes: (a view
    of a destination, the checked bytes that go there), for every chunk this rank reads; nothing is copied yet.

    DCP's default planner resolves a destination to a view of the state's tensor and has nothing to do once it
    is filled (``commit_tensor``), so the copies can be made after the load returns, all chunks checked.

    This rank plans its reads alone (``no_dist``): every rank's manifest is in ``index``, so no
    plan (a pickle) is exchanged over the process group, and a rank's failure is its own to report:
    the error raised is the one that stopped the load (DCP wraps it in a CheckpointException, which is
    no ``Exception``).
    """
    reader = ManifestReader(index, read)
    try:
        with warnings.catch_warnings():  # no_dist is the intent here, not a process group that went missing
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(target, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        failure = next((error for error, _trace in exc.failures.values()), None)
        if failure is None:
            raise
        raise failure from exc
    return reader.staged


class ManifestReader(StorageReader, Generic[_disk.P]):
    """torch.distributed.checkpoint's reads of one step, served from stead's parts (see the module docstring)."""

    def __init__(self, index: _disk.DcpIndex[_disk.P], read: ReadChunk[_disk.P]) -> None:
        super().__init__()
        self._index, self._read = index, read
        #: (a view of a destination, the checked bytes that go there), for every chunk read
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: the reader is made for one step, from its manifests."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._index.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the chunks' places come with the index."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # plain values are in place already, from the JSON tree: their records (pickles) are not read
        return dataclasses.replace(plan, items=[item for item in plan.items if item.type is not LoadItemType.BYTE_IO])

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            chunk = self._index.chunks.get(item.storage_index) if item.type is LoadItemType.TENSOR else None
            if chunk is None:
                raise CheckpointError(f"torch.distributed.checkpoint asked for {item.storage_index.fqn} as "
                                      f"{item.type.name}, which stead does not read from its parts; "
                                      "report this as a stead bug")
            part, index = chunk
            meta = TensorMeta.from_json(part.tensors[index], where=part.label)
            chunk_tensor = torch.empty(meta.shape, dtype=dtype_from_name(meta.dtype, where=part.label))
            self._read(part, index, _disk.tensor_bytes(chunk_tensor))  # checked
            piece = chunk_tensor
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                piece = piece.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != piece.size():
                raise StateMismatch(f"{item.storage_index.fqn}: torch.distributed.checkpoint planned "
                                    f"{list(target.size())} from a chunk of {list(piece.size())}")
            # only the part this rank restores is kept: the rest of a larger chunk is let go
            self.staged.append((target, piece if piece.numel() == chunk_tensor.numel() else piece.clone()))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never chosen for a path: it is made for one step, from its manifests
