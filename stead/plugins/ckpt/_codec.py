"""State dicts to a JSON tree plus a flat list of tensors, and back: no pickle anywhere.

The tree is JSON: ``{"t": i}`` is tensor ``i`` of the flat list, ``{"d": [[key, value], ...]}``
a dict (str or int keys), ``{"l": [...]}`` a list, ``{"u": [...]}`` a tuple and
``{"v": x}`` a scalar (int, float, bool, None, str). Anything else is refused with
an error naming where it sits in the state dict and what to do. Tensors carry
their dtype, shape and device; a DTensor (FSDP2, torch.distributed.checkpoint) or
a ShardedTensor is stored as this rank's local shard plus its place in the global
tensor, so each rank keeps only its own shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from stead.plugins.ckpt.errors import UnsupportedState

__all__ = ["Encoded", "TensorMeta", "decode", "dtype_from_name", "encode", "find", "local_part"]

_SCALARS = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a restore needs to know about one tensor leaf."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    device: str = "cpu"
    #: sharded leaves: the global shape and where this rank's shard starts in it
    global_shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
                               "device": self.device}
        if self.global_shape is not None and self.offsets is not None:
            out["global_shape"] = list(self.global_shape)
            out["offsets"] = list(self.offsets)
        return out

    @staticmethod
    def from_json(obj: Any, *, where: str) -> TensorMeta:
        try:
            meta = TensorMeta(
                dtype=str(obj["dtype"]), shape=tuple(int(d) for d in obj["shape"]), nbytes=int(obj["nbytes"]),
                device=str(obj.get("device", "cpu")),
                global_shape=tuple(int(d) for d in obj["global_shape"]) if "global_shape" in obj else None,
                offsets=tuple(int(d) for d in obj["offsets"]) if "offsets" in obj else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedState(f"{where}: malformed tensor entry {str(obj)[:200]} ({exc!r})") from exc
        dtype = dtype_from_name(meta.dtype, where=where)
        numel = 1
        for d in meta.shape:
            if d < 0:
                raise UnsupportedState(f"{where}: negative dimension in {meta.shape}")
            numel *= d
        if numel * dtype.itemsize != meta.nbytes:
            raise UnsupportedState(f"{where}: {meta.nbytes} bytes do not match shape {meta.shape} of {meta.dtype}")
        return meta

    @property
    def sharded(self) -> bool:
        return self.global_shape is not None


def dtype_from_name(name: str, *, where: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedState(f"{where}: unknown tensor dtype {name!r}; was it written by a newer torch?")
    return dtype


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A state dict as a JSON tree, its tensors' metadata, and the local tensors to copy."""

    tree: Any
    metas: tuple[TensorMeta, ...]
    tensors: tuple[torch.Tensor, ...]


def _path(path: Sequence[object]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the state dict"


def local_part(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None, tuple[int, ...] | None]:
    """(this rank's tensor, global shape, offsets) of a DTensor / ShardedTensor; (value, None, None) otherwise."""
    kind = type(value).__name__
    if kind == "DTensor":
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        dtensor: Any = value
        local = dtensor._local_tensor
        local_shape, offsets = compute_local_shape_and_global_offset(
            dtensor.shape, dtensor.device_mesh, dtensor.placements)
        if tuple(local_shape) != tuple(local.shape):  # uneven shards with padding: keep only the real part
            local = local[tuple(slice(0, d) for d in local_shape)]
        return local, tuple(value.shape), tuple(int(o) for o in offsets)
    if kind == "ShardedTensor":
        shards = value.local_shards()  # type: ignore[attr-defined]
        if len(shards) != 1:
            raise UnsupportedState(f"a ShardedTensor with {len(shards)} local shards cannot be stored; "
                                   "use one shard per rank (FSDP) or DTensor")
        shard = shards[0]
        return shard.tensor, tuple(value.size()), tuple(int(o) for o in shard.metadata.shard_offsets)
    return value, None, None


def encode(state: Mapping[Any, Any]) -> Encoded:
    """Split ``state`` into a JSON tree and tensors; refuse what cannot be stored without pickle."""
    metas: list[TensorMeta] = []
    tensors: list[torch.Tensor] = []

    def walk(value: Any, path: tuple[object, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
                local, global_shape, offsets = value, None, None
            else:
                local, global_shape, offsets = local_part(value)
            if local.layout is not torch.strided or local.is_quantized or local.is_nested:
                raise UnsupportedState(f"{_path(path)} is a {local.layout} tensor (or quantized, or nested); only "
                                       "dense (strided) tensors can be stored: convert it, e.g. with .to_dense()")
            metas.append(TensorMeta(dtype=str(local.dtype).removeprefix("torch."), shape=tuple(local.shape),
                                    nbytes=local.numel() * local.element_size(), device=local.device.type,
                                    global_shape=global_shape, offsets=offsets))
            tensors.append(local)
            return {"t": len(tensors) - 1}
        if isinstance(value, Mapping):
            items = []
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise UnsupportedState(f"{_path(path)} has a key {key!r} of type {type(key).__name__}; "
                                           "only str and int keys can be stored: convert the key to a str")
                items.append([key, walk(item, (*path, key))])
            return {"d": items}
        if isinstance(value, list):
            return {"l": [walk(item, (*path, i)) for i, item in enumerate(value)]}
        if isinstance(value, tuple):
            return {"u": [walk(item, (*path, i)) for i, item in enumerate(value)]}
        if isinstance(value, _SCALARS):
            return {"v": value}
        raise UnsupportedState(
            f"{_path(path)} is a {type(value).__module__}.{type(value).__qualname__}, which a flash checkpoint "
            "cannot store without pickle; store tensors, int/float/bool/str/None, and dicts, lists and tuples of "
            "those (convert it, e.g. to a str, a number or a tensor)")

    if not isinstance(state, Mapping):
        raise UnsupportedState(f"a state dict must be a mapping, got {type(state).__name__}")
    tree = walk(state, ())
    return Encoded(tree=tree, metas=tuple(metas), tensors=tuple(tensors))


def decode(tree: Any, leaf: Callable[[int, tuple[object, ...]], Any], *, where: str) -> Any:
    """Rebuild the structure of ``tree``; tensor ``i`` at ``path`` is ``leaf(i, path)``."""

    def walk(node: Any, path: tuple[object, ...]) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise UnsupportedState(f"{where}: malformed node at {_path(path)}: {str(node)[:200]}")
        (kind, body), = node.items()
        if kind == "t" and isinstance(body, int) and not isinstance(body, bool):
            return leaf(body, path)
        if kind == "v" and isinstance(body, _SCALARS):
            return body
        if kind == "d" and isinstance(body, list):
            out: dict[Any, Any] = {}
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))
                        and not isinstance(pair[0], bool)):
                    raise UnsupportedState(f"{where}: malformed dict entry at {_path(path)}")
                out[pair[0]] = walk(pair[1], (*path, pair[0]))
            return out
        if kind in ("l", "u") and isinstance(body, list):
            items = [walk(item, (*path, i)) for i, item in enumerate(body)]
            return items if kind == "l" else tuple(items)
        raise UnsupportedState(f"{where}: unknown node {kind!r} at {_path(path)}")

    return walk(tree, ())


def find(template: Any, path: tuple[object, ...]) -> Any:
    """The value at ``path`` in ``template`` (None when the path does not exist there)."""
    node = template
    for key in path:
        if isinstance(node, Mapping):
            if key not in node:
                return None
            node = node[key]
        elif isinstance(node, (list, tuple)) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return None
    return node

