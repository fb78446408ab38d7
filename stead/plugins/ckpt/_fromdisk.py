"""Restoring a persisted step from stead's manifests and raw tensor bytes: nothing on disk is unpickled.

At the world size that saved it (:func:`read_step`), a rank reads a copy's tensors' bytes
straight into the destination tensors once the whole file, open on the same handle, was
checked against the XXH3 checksums (:func:`_disk.verify_data`): nothing unverified reaches them.

At another world size, with sharded tensors (FSDP2, DTensor), torch.distributed.checkpoint
plans the reshard (:func:`stage_resharded`), but reads nothing itself: it is handed the
step's ``Metadata`` built in memory from the manifests (:func:`_disk.dcp_index`; the
``.metadata`` pickle beside them is for torch's own tools) and a storage reader
(:mod:`._dcp_reader`) that reads each chunk's raw bytes and checks its checksum. Every
chunk and tensor this rank restores is read and checked into memory of its own (the size
of what the rank restores) before any byte is copied into the caller's tensors
(:meth:`Staged.copy_in`): a corrupt chunk leaves them as they were.
Plain values (and the tensors DCP keeps inside one, in a tuple) come from the manifest's
JSON tree and raw bytes: DCP's records of them would be read with
``torch.load(weights_only=False)``, so they are never handed to it. Each rank plans its
reads alone (``no_dist``): every rank's manifest is on the shared disk, so no pickled
plan crosses the process group either.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from stead.plugins.ckpt import _disk
from stead.plugins.ckpt._codec import TensorMeta, decode, dtype_from_name, find
from stead.plugins.ckpt._restore import Template, as_dict, destination
from stead.plugins.ckpt.errors import CheckpointError, StateMismatch

__all__ = ["Staged", "read_step", "stage_parts", "stage_resharded"]


@dataclasses.dataclass(frozen=True)
class Staged:
    """A step read and checked whole, waiting to be copied into the caller's tensors."""

    #: the restored state: the caller's tensors where it had them (still unchanged), new ones elsewhere
    state: dict[Any, Any]
    #: (destination, its checked bytes), for every destination that is not a new tensor of ``state``'s own
    copies: list[tuple[torch.Tensor, torch.Tensor]]

    def copy_in(self) -> dict[Any, Any]:
        """Copy the checked bytes into their destinations; the state."""
        with torch.no_grad():
            for destination_, checked in self.copies:
                destination_.copy_(checked)
        return self.state


def read_step(manifest: _disk.Manifest, template: Mapping[str, Any] | None, handle: Any) -> dict[Any, Any]:
    """The state ``manifest`` describes, read from its data file open as ``handle`` and checked whole by
    :func:`_disk.verify_data` on that handle, its tensors copied into ``template``'s where it has them."""
    metas = _metas(manifest)

    def leaf(index: int, path: tuple[object, ...]) -> Any:
        existing = find(template, path) if template is not None else None
        value, target = destination(metas[index], existing, path)
        _read_into(manifest, handle, index, target, check=False)
        return value

    with torch.no_grad():
        return as_dict(decode(manifest.tree, leaf, where=str(manifest.dir)))


def stage_resharded(manifest: _disk.Manifest, given: Template, *, world: int) -> Staged:
    """``manifest``'s step, saved by ``manifest.world`` ranks with shards, read for this job's ``world`` ranks and
    checked, ready to go into the caller's tensors (DTensors resharded), the replicated tensors and plain values
    alongside; nothing of the caller's is written until :meth:`Staged.copy_in`.

    A chunk that fails its checksum raises :class:`CheckpointError` (an older step can be tried); a state that
    cannot take the step raises :class:`StateMismatch`.
    """
    parts = [manifest if rank == manifest.rank else _disk.read_manifest(manifest.root, manifest.step, rank)
             for rank in range(manifest.world)]
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def read(part: _disk.Manifest, index: int, target: memoryview) -> None:
            handle = handles.get(part.data_file)
            if handle is None:
                handle = handles[part.data_file] = stack.enter_context(_disk.open_data(part))
            _disk.read_tensor_into(part, handle, index, target)

        return stage_parts(parts, manifest, given, step=manifest.step, world=world, where=manifest.dir, read=read)


class _Whole(_disk.Part, Protocol):
    """A part that also holds the state's tree (every rank's part has it, the same)."""

    @property
    def tree(self) -> Any: ...


W = TypeVar("W", bound=_Whole)


def stage_parts(parts: Sequence[W], own: W, given: Template, *, step: int, world: int, where: Path | str,
                read: Callable[[W, int, memoryview], None]) -> Staged:
    """The step whose every rank's part is in ``parts`` (``own``: the one whose tree and unsharded values this
    rank takes), resharded for ``world`` ranks as :func:`stage_resharded` says; ``read(part, index, target)``
    reads a tensor of a part, checked (a data file on disk, a slot in some node's memory)."""
    what = f"step {step}"
    saved = len(parts)
    metas = [TensorMeta.from_json(t, where=own.label) for t in own.tensors]
    skeleton = decode(own.tree, lambda i, _path: metas[i], where=what)
    template = given(skeleton) if callable(given) else given
    index = _disk.dcp_index(where, parts)
    dcp_tensors = {int(item["tensor"]) for item in own.dcp if "tensor" in item}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def leaf(i: int, path: tuple[object, ...]) -> Any:
        meta, existing = metas[i], find(template, path) if template is not None else None
        if i not in dcp_tensors:  # inside a value DCP stores whole (a tuple): stead's own copy of it
            if meta.sharded:
                raise StateMismatch(f"{what}: the shard at {list(path)} sits inside a tuple, which "
                                    "torch.distributed.checkpoint cannot reshard; restore it with the "
                                    f"{saved} ranks that saved it")
            value, target = destination(meta, existing, path)
            if value is not existing and target.device.type == "cpu" and target.is_contiguous():
                read(own, i, _disk.tensor_bytes(target))  # a new tensor, nobody's yet
                return value
            checked = torch.empty(meta.shape, dtype=target.dtype)
            read(own, i, _disk.tensor_bytes(checked))
            copies.append((target, checked))
            return value
        if isinstance(existing, torch.Tensor):
            return existing
        if meta.sharded:
            raise StateMismatch(f"{what} was saved by {saved} ranks and this job has {world}: its "
                                f"shard at {list(path)} can only be resharded into the current state dict "
                                "(with its DTensors); pass it to load()")
        return torch.empty(meta.shape, dtype=dtype_from_name(meta.dtype, where=what))

    with torch.no_grad():
        target = decode(own.tree, leaf, where=what)
    _disk.load_dcp()
    from stead.plugins.ckpt._dcp_reader import stage_chunks  # torch.distributed.checkpoint takes a while to import

    try:
        copies += stage_chunks(target, index, read)
    except CheckpointError:
        raise
    except Exception as exc:  # DCP's own errors (a missing key, a shape it cannot reshard) say what is wrong
        raise StateMismatch(f"{what} (saved by {saved} ranks) could not be resharded into this job's "
                            f"{world} ranks: {exc}; nothing was loaded") from exc
    return Staged(state=as_dict(target), copies=copies)


def _metas(manifest: _disk.Manifest) -> list[TensorMeta]:
    return [TensorMeta.from_json(t, where=str(manifest.dir)) for t in manifest.tensors]


def _read_into(manifest: _disk.Manifest, handle: Any, index: int, target: torch.Tensor, *, check: bool) -> None:
    """Tensor ``index`` of ``manifest`` read into ``target``: checked as it is read, unless ``check`` is False
    because the file open as ``handle`` was verified whole."""
    if target.device.type == "cpu" and target.is_contiguous():
        _disk.read_tensor_into(manifest, handle, index, _disk.tensor_bytes(target), check=check)
    else:
        staging = torch.empty(target.shape, dtype=target.dtype)
        _disk.read_tensor_into(manifest, handle, index, _disk.tensor_bytes(staging), check=check)
        target.copy_(staging)
