"""Persisted checkpoints: a torch.distributed.checkpoint layout plus stead's own JSON manifests.

``<ckpt_dir>/<job>/step_<N>/`` holds, per rank, ``__<rank>_0.distcp`` (each tensor
and each non-tensor value as torch.distributed.checkpoint's FileSystemWriter
writes them) and ``rank_<rank>.json`` (stead's manifest: the state dict's tree,
each tensor's dtype, shape, byte offset in the data file and XXH3-64 checksum, and
the manifest's own digest over all of that, so a changed learning rate or string in
the tree is caught as surely as a changed weight). Once every
rank's manifest is there, whoever wrote the last one adds ``.metadata`` (what
``torch.distributed.checkpoint.load`` reads; it is a pickle, written by us from
the manifests for torch's own tools and never read back by stead) and moves the
tracker ``<ckpt_dir>/<job>/latest`` to the step (temp file, fsync, rename, under a
lock), then keeps only the newest ``ckpt_keep_last`` complete steps.

stead restores from the manifests only: JSON, then raw bytes read straight into
the destination tensors and checked against the checksums. Nothing is unpickled:
neither ``.metadata`` (its existence marks a complete step; a reshard gets the same
``Metadata`` from :func:`dcp_index`, built from the manifests) nor the
``torch.save`` records of the data files (stead reads the raw tensor bytes inside
them, and plain values from the JSON tree).
Manifests of format 1 (a sum of words as checksum, no digest) are still read.
Every file is created readable by its owner only (0600).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import io
import json
import os
import re
import shutil
import struct
import threading
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import structlog

from stead.plugins.ckpt._checksum import checksum, hasher, sum64, with_digest, without_digest
from stead.plugins.ckpt.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

__all__ = [
    "DcpIndex",
    "Manifest",
    "Part",
    "candidates",
    "dcp_index",
    "flat_records",
    "finish_step",
    "progress",
    "is_complete",
    "read_manifest",
    "read_tensor_into",
    "read_tracker",
    "step_dir",
    "verify_data",
    "written_ranks",
    "write_rank",
]

log = structlog.get_logger("stead.plugins.ckpt")

TRACKER = "latest"
METADATA = ".metadata"
FORMAT = 2
#: format 1: tensor checksums are sum64, the manifest has no digest (read, never written)
_LEGACY = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_RANK_MANIFEST = re.compile(r"^rank_(\d+)\.json$")
_MANIFEST = re.compile(r"^rank_(\d+)\.json$")
#: the buffer a restore hashes a data file through before it reads the file into the caller's tensors: small
#: enough to stay in the CPU's cache, so that the check costs about one read of the file, not two
_VERIFY_CHUNK = 1 << 20



_DCP_IMPORT = threading.Lock()


def load_dcp() -> None:
    """Import torch.distributed.checkpoint once, whichever thread asks first.

    Two threads importing it at the same moment can fail with "partially initialized
    module" (its modules import each other); the agent imports it ahead in one
    thread while a persist after a failure may need it in another.
    """
    with _DCP_IMPORT:
        import torch.distributed.checkpoint  # noqa: F401


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def _manifest_path(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank_{rank}.json"


def _data_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_private(path: Path, mode: str) -> Any:
    """``open(path, mode)`` for a new file only its owner can read and write (0600)."""
    return open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600), mode)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with _create_private(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def tensor_bytes(tensor: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _owning(tensor: Any) -> Any:
    """``tensor`` itself when it owns exactly its bytes (torch.save writes whole storages), else a copy."""
    import torch

    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.cpu()
    nbytes = tensor.numel() * tensor.element_size()
    if (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == nbytes):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


class _Window(io.RawIOBase):
    """A read-only view of ``[start, start + length)`` of an open file (for zipfile)."""

    def __init__(self, handle: Any, start: int, length: int) -> None:
        self._handle, self._start, self._length, self._pos = handle, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def read(self, size: int = -1) -> bytes:
        size = self._length - self._pos if size is None or size < 0 else min(size, self._length - self._pos)
        self._handle.seek(self._start + self._pos)
        data: bytes = self._handle.read(size)
        self._pos += len(data)
        return data


def _record_offset(handle: Any, start: int, end: int, nbytes: int) -> int:
    """File offset of the raw tensor bytes inside the torch.save archive at ``[start, end)``."""
    with zipfile.ZipFile(_Window(handle, start, end - start)) as archive:
        infos = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
    if len(infos) != 1 or infos[0].compress_type != zipfile.ZIP_STORED or infos[0].file_size != nbytes:
        raise CheckpointError("torch.save wrote a tensor archive stead cannot index; "
                              "use the torch version stead was released with")
    handle.seek(start + infos[0].header_offset)
    header = handle.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    handle.seek(end)
    return int(start + infos[0].header_offset + 30 + name_len + extra_len)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """One rank's part of a persisted step, as read back from ``rank_<rank>.json``."""

    root: Path
    step: int
    round: int
    rank: int
    world: int
    data_file: str
    tree: Any
    tensors: list[dict[str, Any]]
    #: the data file's records as torch.distributed.checkpoint indexes them: fqn, path, offset, length (and the
    #: tensor's index when the record is one of the manifest's tensors)
    dcp: list[dict[str, Any]]
    format: int = FORMAT

    def checksum(self, buf: memoryview) -> int:
        """The checksum of ``buf`` as this manifest's format computes it."""
        return sum64(buf) if self.format == _LEGACY else checksum(buf)

    @property
    def dir(self) -> Path:
        return step_dir(self.root, self.step)

    @property
    def label(self) -> str:
        """Where this part of the step lives, for messages: the manifest's path."""
        return str(_manifest_path(self.root, self.step, self.rank))


def write_rank(root: Path, *, step: int, round_: int, rank: int, world: int, tree: Any,
               metas: list[dict[str, Any]], tensors: list[Any], expected: list[int] | None = None) -> None:
    """Write one rank's shard of ``step`` (tensors: contiguous CPU tensors owning exactly their bytes).

    ``expected`` are checksums the tensors must match (the agent computed them after the
    save); a mismatch raises :class:`CheckpointError` and nothing is written.
    """
    load_dcp()
    import torch

    tensors = [_owning(t) for t in tensors]
    sums = [checksum(tensor_bytes(t)) for t in tensors]
    if expected is not None:
        bad = [i for i, (a, b) in enumerate(zip(sums, expected, strict=True)) if a != b]
        if bad:
            raise CheckpointError(f"step {step} of rank {rank}: {len(bad)} tensors fail their checksums in shared "
                                  "memory; not persisting a corrupt copy")
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    raw: dict[int, int] = {}
    items: list[dict[str, Any]] = []
    data = folder / _data_name(rank)
    tmp = folder / f".{data.name}.tmp-{os.getpid()}"
    with _create_private(tmp, "w+b") as handle:
        for fqn, path, value, index in flat_records(tree, tensors, where=f"step {step} rank {rank}"):
            start = handle.tell()
            torch.save(value, handle)
            end = handle.tell()
            item: dict[str, Any] = {"fqn": fqn, "path": path, "offset": start, "length": end - start}
            if index is not None and index not in raw:
                raw[index] = _record_offset(handle, start, end, int(metas[index]["nbytes"]))
                item["tensor"] = index
            items.append(item)
        for index, tensor in enumerate(tensors):  # tensors DCP stores inside a value (a tuple): raw copy for stead
            if index not in raw:
                raw[index] = handle.tell()
                handle.write(tensor_bytes(tensor))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, data)
    entries = [{**meta, "file_offset": raw[i], "checksum": sums[i]} for i, meta in enumerate(metas)]
    manifest = {"format": FORMAT, "step": step, "round": round_, "rank": rank, "world": world,
                "file": data.name, "tensors": entries, "tree": tree, "dcp": items}
    _write_atomic(_manifest_path(root, step, rank), with_digest(json.dumps(manifest, separators=(",", ":")).encode()))


def flat_records(tree: Any, tensors: Sequence[Any], *, where: str
                 ) -> list[tuple[str, list[Any], Any, int | None]]:
    """The state ``tree`` describes (``tensors``: its leaves) as torch.distributed.checkpoint stores it, one record
    per value: (fqn, path, value, the index of the tensor when the value is one of ``tensors``, else None)."""
    load_dcp()
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from stead.plugins.ckpt._codec import decode

    flat, mappings = flatten_state_dict(decode(tree, lambda i, _path: tensors[i], where=where))
    index_of = {id(t): i for i, t in enumerate(tensors)}
    return [(fqn, list(mappings[fqn]), value, index_of.get(id(value)) if isinstance(value, torch.Tensor) else None)
            for fqn, value in flat.items()]


def read_manifest(root: Path, step: int, rank: int) -> Manifest:
    """Read and check one rank's manifest; FileNotFoundError when the rank never wrote the step."""
    path = _manifest_path(root, step, rank)
    raw = path.read_bytes()
    try:
        obj = json.loads(raw)
        if obj.get("format") == FORMAT:
            if without_digest(raw) is None:
                raise CheckpointError(f"{path} fails its digest: the manifest (its tree, learning rate, strings "
                                      "or tensor table) was changed or damaged after it was written")
        elif obj.get("format") != _LEGACY:
            raise CheckpointError(f"{path}: format {obj.get('format')!r} is not {FORMAT}; read it with the stead "
                                  "version that wrote it")
        manifest = Manifest(root=root, step=int(obj["step"]), round=int(obj["round"]), rank=int(obj["rank"]),
                            world=int(obj["world"]), data_file=str(obj["file"]), tree=obj["tree"],
                            tensors=list(obj["tensors"]), dcp=list(obj["dcp"]), format=int(obj["format"]))
        for t in manifest.tensors:
            if int(t["file_offset"]) < 0 or int(t["nbytes"]) < 0 or not isinstance(t["checksum"], int):
                raise ValueError("bad tensor entry")
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path} is not a readable stead manifest ({exc!r})") from exc
    if manifest.step != step or manifest.rank != rank or "/" in manifest.data_file:
        raise CheckpointError(f"{path} describes step {manifest.step} of rank {manifest.rank}, not step {step} "
                              f"of rank {rank}")
    return manifest


def read_tensor_into(manifest: Manifest, handle: Any, index: int, target: memoryview, *, check: bool = True) -> None:
    """Read tensor ``index`` of ``manifest`` into ``target`` (its exact bytes) and check its checksum (``check``:
    False only when :func:`verify_data` checked the file open as ``handle``)."""
    entry = manifest.tensors[index]
    nbytes = int(entry["nbytes"])
    if len(target) != nbytes:
        raise CheckpointError(f"step {manifest.step} rank {manifest.rank}: tensor {index} has {nbytes} bytes, "
                              f"the destination {len(target)}")
    handle.seek(int(entry["file_offset"]))
    done = 0
    while done < nbytes:
        got = handle.readinto(target[done:])
        if not got:
            raise CheckpointError(f"{manifest.dir / manifest.data_file} is truncated (tensor {index})")
        done += got
    if check and manifest.checksum(target) != int(entry["checksum"]):
        raise CheckpointError(f"{manifest.dir / manifest.data_file}: tensor {index} fails its checksum (corrupt)")


def verify_data(manifest: Manifest, handle: Any) -> None:
    """Check every tensor of ``manifest`` in its data file against its checksum, reading through a buffer of
    ``_VERIFY_CHUNK`` bytes (nothing is kept); CheckpointError names the first that fails.

    A restore verifies a step this way before any of its bytes reach the caller's tensors, then reads the same
    open file (the same inode: stead never writes a data file in place, it renames a new one over it) into them,
    from the page cache when the file fits there.
    """
    largest = max((int(t["nbytes"]) for t in manifest.tensors), default=0)
    buffer = memoryview(bytearray(min(_VERIFY_CHUNK, largest)))
    for index, entry in enumerate(manifest.tensors):
        nbytes = int(entry["nbytes"])
        if manifest.format == _LEGACY:  # sum64 is not computed piece by piece: the tensor is read whole
            whole = memoryview(bytearray(nbytes))
            read_tensor_into(manifest, handle, index, whole)
            continue
        state = hasher()
        handle.seek(int(entry["file_offset"]))
        done = 0
        while done < nbytes:
            got = handle.readinto(buffer[:min(_VERIFY_CHUNK, nbytes - done)])
            if not got:
                raise CheckpointError(f"{manifest.dir / manifest.data_file} is truncated (tensor {index})")
            state.update(buffer[:got])
            done += got
        if state.intdigest() != int(entry["checksum"]):
            raise CheckpointError(f"{manifest.dir / manifest.data_file}: tensor {index} fails its checksum "
                                  "(corrupt)")


def candidates(root: Path, rank: int, *, any_rank: bool = False) -> list[int]:
    """Steps for which ``rank`` wrote its manifest (with ``any_rank``: or any rank did, so that a rank of a resized
    job, or a replacement, finds them too), newest first."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    steps = []
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if match and ((entry / f"rank_{rank}.json").is_file() or (any_rank and written_ranks(root, int(match[1])))):
            steps.append(int(match[1]))
    return sorted(steps, reverse=True)


def written_ranks(root: Path, step: int) -> list[int]:
    """The ranks whose manifest of ``step`` is on disk, in order."""
    return progress(root, step)[1]


def progress(root: Path, step: int) -> tuple[bool, list[int]]:
    """Whether ``step`` is complete on disk, and the ranks whose manifest of it is there (one directory read)."""
    try:
        names = [entry.name for entry in step_dir(root, step).iterdir()]
    except OSError:
        return False, []
    return METADATA in names, sorted(int(match[1]) for name in names if (match := _RANK_MANIFEST.match(name)))


def is_complete(root: Path, step: int) -> bool:
    return (step_dir(root, step) / METADATA).is_file()


def read_tracker(root: Path) -> int | None:
    try:
        obj = json.loads((root / TRACKER).read_bytes())
        return int(obj["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _job_lock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def finish_step(root: Path, step: int, world: int, *, keep_last: int) -> bool:
    """Complete ``step`` if every rank wrote it: .metadata, tracker, retention. True when complete."""
    import pickle

    folder = step_dir(root, step)
    if is_complete(root, step):
        return True
    manifests: list[Manifest] = []
    for rank in range(world):
        try:
            manifests.append(read_manifest(root, step, rank))
        except OSError:
            return False  # not written yet
        except CheckpointError as exc:
            log.warning("ckpt_step_not_completed", step=step, rank=rank, error=str(exc),
                        effect="the step is left incomplete (no .metadata, not in the tracker)")
            return False
    if {(m.round, m.world) for m in manifests} != {(manifests[0].round, world)}:
        return False  # ranks of different rounds (a step re-saved after a rollback): not one checkpoint yet
    with _job_lock(root):
        if not is_complete(root, step):  # for torch's own readers: stead never reads it back
            _write_atomic(folder / METADATA, pickle.dumps(dcp_index(folder, manifests).metadata))
        newest = read_tracker(root)
        if newest is None or newest <= step or not is_complete(root, newest):
            _write_atomic(root / TRACKER, json.dumps({"step": step, "path": folder.name, "world": world}).encode())
        _retain(root, keep_last)
    return True


def _retain(root: Path, keep_last: int) -> None:
    steps = sorted((int(m[1]) for e in root.iterdir() if (m := _STEP_DIR.match(e.name))), reverse=True)
    complete = [s for s in steps if is_complete(root, s)]
    if keep_last <= 0 or len(complete) <= keep_last:
        return
    oldest_kept = complete[keep_last - 1]
    for step in steps:
        if step < oldest_kept:
            shutil.rmtree(step_dir(root, step), ignore_errors=True)
            log.debug("ckpt_step_removed", step=step, keep_last=keep_last)


class Part(Protocol):
    """One rank's part of a step as :func:`dcp_index` reads it: a manifest on disk, or a slot in some node's memory
    (:mod:`._memreshard`)."""

    @property
    def rank(self) -> int: ...
    @property
    def data_file(self) -> str: ...
    @property
    def tensors(self) -> list[dict[str, Any]]: ...
    @property
    def dcp(self) -> list[dict[str, Any]]: ...
    @property
    def label(self) -> str: ...


P = TypeVar("P", bound=Part)


@dataclasses.dataclass(frozen=True)
class DcpIndex(Generic[P]):
    """A step as torch.distributed.checkpoint sees it, built from its ranks' parts (manifests, or slots)."""

    #: what ``.metadata`` holds: every tensor's chunks, every plain value's record, in each rank's data file
    metadata: Metadata
    #: each tensor chunk's part and index in it: where stead finds the chunk's raw bytes and checksum
    chunks: dict[MetadataIndex, tuple[P, int]]


def dcp_index(folder: Path | str, manifests: Sequence[P]) -> DcpIndex[P]:
    """The torch.distributed.checkpoint ``Metadata`` of a step (``manifests``: every rank's part), and its chunks.

    A replicated tensor (the same offsets on several ranks) is described once, by the lowest rank,
    as ``dcp.save`` does.
    """
    load_dcp()
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from stead.plugins.ckpt._codec import dtype_from_name

    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    chunks: dict[MetadataIndex, tuple[P, int]] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    chunk_offsets: dict[str, set[tuple[int, ...]]] = {}
    for manifest in sorted(manifests, key=lambda m: m.rank):
        try:
            for item in manifest.dcp:
                fqn = str(item["fqn"])
                info = _StorageInfo(relative_path=manifest.data_file, offset=int(item["offset"]),
                                    length=int(item["length"]))
                if "tensor" not in item:
                    if fqn not in sd_meta:
                        sd_meta[fqn] = BytesStorageMetadata()
                        storage[MetadataIndex(fqn)] = info
                        planner[fqn] = tuple(item["path"])
                    continue
                tensor = int(item["tensor"])
                meta = manifest.tensors[tensor]
                shape = tuple(int(d) for d in meta["shape"])
                global_shape = tuple(int(d) for d in meta.get("global_shape", shape))
                offsets = tuple(int(d) for d in meta.get("offsets", (0,) * len(shape)))
                seen = chunk_offsets.setdefault(fqn, set())
                if offsets in seen:  # replicated (DDP) or already described by a lower rank
                    continue
                seen.add(offsets)
                entry = sd_meta.get(fqn)
                if entry is None:
                    dtype = dtype_from_name(str(meta["dtype"]), where=str(folder))
                    entry = sd_meta[fqn] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=dtype), size=torch.Size(global_shape), chunks=[])
                    planner[fqn] = tuple(item["path"])
                entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)))
                key = MetadataIndex(fqn, offsets, len(entry.chunks) - 1)
                storage[key] = info
                chunks[key] = (manifest, tensor)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{manifest.label}: its record table is malformed ({exc!r}); restore an older "
                                  "step") from exc
    metadata = Metadata(state_dict_metadata=sd_meta, planner_data=planner, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=str(folder), save_id=uuid.uuid4().hex),
                        version="1.0.0")
    return DcpIndex(metadata=metadata, chunks=chunks)


def open_data(manifest: Manifest) -> Any:
    return open(manifest.dir / manifest.data_file, "rb", buffering=0)

