"""A worker's mapping of one slot segment, and the copies in and out of it.

CPU tensors are copied with ``memmove`` (libc's copy, the GIL released); CUDA
tensors with ``copy_(non_blocking=True)`` on a side stream, into the mapping
registered as pinned host memory (``cudaHostRegister``) when that works. Pages
are pre-faulted in the background (``MADV_POPULATE_WRITE``, or touching one byte
per page on older kernels) so that even the first save copies at memory speed;
in a process that already uses CUDA the background thread then registers the
mapping too (seconds for tens of GiB), so that no save or restore waits for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from typing import Any

import structlog
import torch

from stead.plugins.ckpt._shm import map_segment

__all__ = ["MappedSlot"]

log = structlog.get_logger("stead.ckpt")

_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
#: cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the registering thread's
_REGISTER_PORTABLE = 1


class MappedSlot:
    """One slot's data segment mapped into the worker."""

    def __init__(self, name: str, gen: int, capacity: int) -> None:
        self.name, self.gen, self.capacity = name, gen, capacity
        self.mm = map_segment(name, capacity)
        self._anchor: Any = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self._bytes: torch.Tensor | None = None
        self._pinned = False
        self._pin_lock = threading.Lock()
        self._pin_failed = False
        self._populating: threading.Thread | None = None
        self._stop_populating = threading.Event()
        self._populate_lock = threading.Lock()

    # -- views ---------------------------------------------------------------------------

    @property
    def as_bytes(self) -> torch.Tensor:
        if self._bytes is None:
            self._bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self._bytes

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self.as_bytes[offset:offset + nbytes].view(dtype).view(shape)

    def memory(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.mm)[offset:offset + nbytes]

    # -- pre-faulting ------------------------------------------------------------------------

    def populate_in_background(self, cuda_device: int | None = None) -> None:
        """Fault every page in now, off the training thread (a later copy then runs at memory speed); with
        ``cuda_device``, register the mapping as pinned memory after (on that device's context)."""
        if self._populating is not None:
            return
        thread = threading.Thread(target=self.prepare, args=(cuda_device,), name=f"stead-ckpt-populate-{self.gen}",
                                  daemon=True)
        self._populating = thread
        thread.start()

    def stop_populating(self) -> None:
        self._stop_populating.set()

    def populate(self) -> None:
        """Fault every page in (in the calling thread), unless stop_populating() was called."""
        chunk = 64 << 20  # in steps, so that close() can stop it quickly
        for start in range(0, self.capacity, chunk):
            with self._populate_lock:  # close() unmaps only between two steps
                if self._stop_populating.is_set():
                    return
                length = min(chunk, self.capacity - start)
                if _libc.madvise(self.base + start, length, _MADV_POPULATE_WRITE) != 0:
                    # Older kernels: read one byte per page. Never write: a save may be copying into
                    # this slot at the same time, and writing a byte back could undo its copy.
                    view = memoryview(self.mm)
                    try:
                        for page in range(start, start + length, _PAGE):
                            view[page]  # the read faults the page in
                    finally:
                        view.release()

    def prepare(self, cuda_device: int | None) -> None:
        """populate(), then, with ``cuda_device``, pin_for_cuda() on that device (in the calling thread)."""
        self.populate()
        if cuda_device is not None and not self._stop_populating.is_set():
            with torch.cuda.device(cuda_device):
                self.pin_for_cuda()

    def wait_populated(self) -> None:
        if self._populating is not None:
            self._populating.join()

    # -- copies ------------------------------------------------------------------------------

    def pin_for_cuda(self) -> None:
        """Register the mapping as pinned memory so device-to-host copies run asynchronously at full speed
        (once: a call while another thread registers it waits for that one)."""
        with self._pin_lock:
            if self._pinned or self._pin_failed or self._anchor is None or not torch.cuda.is_available():
                return
            error = ""
            try:
                result = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                    self.base, self.capacity, _REGISTER_PORTABLE)
                self._pinned = int(result) == 0
                error = "" if self._pinned else f"cudaHostRegister returned {result}"
            except (RuntimeError, AttributeError) as exc:
                error = repr(exc)
            if not self._pinned:
                self._pin_failed = True  # not again for every save
                log.warning("ckpt_pin_failed", segment=self.name, error=error,
                            effect="CUDA copies of this slot use pageable memory (slower, synchronous)")

    def copy_in(self, tensor: torch.Tensor, offset: int, nbytes: int, stream: Any = None) -> None:
        """Copy ``tensor`` (this rank's local data) into the slot at ``offset``."""
        if nbytes == 0:
            return
        if tensor.device.type == "cpu":
            if tensor.is_contiguous():
                ctypes.memmove(self.base + offset, tensor.data_ptr(), nbytes)
            else:
                self.view(offset, nbytes, tensor.dtype, tuple(tensor.shape)).copy_(tensor)
            return
        target = self.view(offset, nbytes, tensor.dtype, tuple(tensor.shape))
        if stream is not None:
            with torch.cuda.stream(stream):
                target.copy_(tensor, non_blocking=True)
        else:
            target.copy_(tensor, non_blocking=self._pinned)

    def copy_out(self, target: torch.Tensor, offset: int, nbytes: int) -> None:
        """Copy the slot's bytes at ``offset`` into ``target`` (same dtype and shape)."""
        if nbytes == 0:
            return
        if target.device.type == "cpu" and target.is_contiguous():
            ctypes.memmove(target.data_ptr(), self.base + offset, nbytes)
            return
        source = self.view(offset, nbytes, target.dtype, tuple(target.shape))
        target.copy_(source, non_blocking=target.device.type == "cuda" and self._pinned)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        self.stop_populating()
        self.wait_populated()
        with self._populate_lock:
            pass  # a populate() running in another thread has stopped
        with self._pin_lock:
            if self._pinned:
                with contextlib.suppress(RuntimeError, AttributeError):
                    torch.cuda.cudart().cudaHostUnregister(self.base)  # type: ignore[no-untyped-call]
                self._pinned = False
        self._bytes = None
        self._anchor = None
        try:
            self.mm.close()
        except BufferError:  # a view handed out is still alive: the mapping goes when it does
            log.debug("ckpt_mapping_in_use", segment=self.name)
