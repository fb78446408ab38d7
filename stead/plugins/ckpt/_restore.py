"""Where restored bytes go: into the caller's tensors (in place) or new ones, with clear refusals."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from stead.plugins.ckpt._codec import TensorMeta, decode, dtype_from_name, find, local_part
from stead.plugins.ckpt.errors import CheckpointError, StateMismatch

__all__ = ["Template", "as_dict", "check_template", "destination"]

#: what load() restores into: a state dict, or a function of the checkpoint's structure returning one
Template = Mapping[str, Any] | Callable[[Any], Mapping[str, Any] | None] | None


def as_dict(value: Any) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise CheckpointError("the checkpoint's root is not a dict")
    return value


def _describe(path: tuple[object, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the root"


def _tensor_paths(node: Any, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    if isinstance(node, torch.Tensor):
        return [path]
    if isinstance(node, Mapping):
        return [p for key, value in node.items() for p in _tensor_paths(value, (*path, key))]
    if isinstance(node, (list, tuple)):
        return [p for i, value in enumerate(node) for p in _tensor_paths(value, (*path, i))]
    return []


def check_template(template: Mapping[str, Any], tree: Any, metas: list[TensorMeta], *, strict: bool,
                   where: str) -> None:
    """Raise StateMismatch, naming what does not fit, unless every tensor of the checkpoint fits ``template``.

    ``strict``: under each top-level key of ``template``, the tensors must also be the same set on both sides.
    """
    problems: list[str] = []
    found: list[tuple[object, ...]] = []

    def leaf(index: int, path: tuple[object, ...]) -> None:
        found.append(path)
        problem = _misfit(metas[index], find(template, path), path)
        if problem:
            problems.append(problem)

    decode(tree, leaf, where=where)
    if strict:
        keys = set(template)
        mine = {p for p in _tensor_paths(template) if p[0] in keys}
        theirs = {p for p in found if p and p[0] in keys}
        problems += [f"{_describe(p)} is in the state but not in the checkpoint"
                     for p in sorted(mine - theirs, key=str)]
        problems += [f"{_describe(p)} is in the checkpoint but not in the state"
                     for p in sorted(theirs - mine, key=str)]
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise StateMismatch(f"{where} does not fit the state it is loaded into: {'; '.join(problems[:8])}{more}; "
                            "nothing was loaded. Restore into the model, optimizer and sharding the checkpoint was "
                            "saved from, or start the job under a new name to start afresh")


def _misfit(meta: TensorMeta, existing: Any, path: tuple[object, ...]) -> str:
    """Why the checkpoint's tensor at ``path`` cannot go into ``existing`` ("" when it can)."""
    if isinstance(existing, torch.Tensor):
        dtype = dtype_from_name(meta.dtype, where="a restored tensor")
        local, _, offsets = local_part(existing)
        if tuple(local.shape) != meta.shape or local.dtype != dtype:
            return (f"{_describe(path)} is {meta.dtype}{list(meta.shape)} in the checkpoint and "
                    f"{str(local.dtype).removeprefix('torch.')}{list(local.shape)} in the state")
        if meta.sharded and offsets is not None and meta.offsets != offsets:
            return (f"the shard at {_describe(path)} starts at {list(offsets)} here and at "
                    f"{list(meta.offsets or ())} in the checkpoint")
    elif meta.sharded:
        return f"{_describe(path)} is a shard of a distributed tensor and the state has no tensor there for it"
    return ""


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

