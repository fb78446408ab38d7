"""Where restored bytes go: into the caller's tensors (in place) or new ones, with clear refusals."""

from __future__ import annotations

from typing import Any

import torch

from stead.plugins.ckpt._codec import TensorMeta, dtype_from_name, local_part
from stead.plugins.ckpt.errors import CheckpointError, StateMismatch

__all__ = ["Unusable", "as_dict", "destination"]


class Unusable(Exception):
    """A persisted step this rank cannot use (another world size)."""


def as_dict(value: Any) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise CheckpointError("the checkpoint's root is not a dict")
    return value


def _describe(path: tuple[object, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the root"


def destination(meta: TensorMeta, existing: Any, path: tuple[object, ...]) -> tuple[Any, torch.Tensor]:
    """(value to put in the restored state dict, tensor to copy the bytes into)."""
    dtype = dtype_from_name(meta.dtype, where="a restored tensor")
    if isinstance(existing, torch.Tensor):
        local, _, offsets = local_part(existing)
        if tuple(local.shape) != meta.shape or local.dtype != dtype:
            raise StateMismatch(
                f"the checkpoint's tensor at {_describe(path)} is {meta.dtype}{list(meta.shape)}, the state dict "
                f"passed to load() has {str(local.dtype).removeprefix('torch.')}{list(local.shape)}: load into a "
                "state dict of the same model (and sharding), or call load() without one")
        if meta.sharded and offsets is not None and meta.offsets != offsets:
            raise StateMismatch(f"the shard at {_describe(path)} starts at {list(offsets)} in this rank, the "
                                  f"checkpoint's at {list(meta.offsets or ())}: restore with the same sharding")
        return existing, local.detach()
    if meta.sharded:
        raise StateMismatch(f"{_describe(path)} is a shard of a distributed tensor: pass the current state "
                               "dict (with its DTensors) to load() so the shard can be restored into it")
    device = torch.device(meta.device) if meta.device == "cpu" or _device_available(meta.device) else None
    tensor = torch.empty(meta.shape, dtype=dtype, device=device)
    return tensor, tensor


def _device_available(kind: str) -> bool:
    module = getattr(torch, kind, None)
    return bool(module is not None and hasattr(module, "is_available") and module.is_available())

