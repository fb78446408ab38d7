"""GPU health on this node through NVML: critical XID events, new uncorrected ECC errors, GPUs that are lost.

A worker that dies with "CUDA error: unspecified launch failure" says little
about why; NVML does (XID 79: the GPU fell off the bus). The agent asks
:class:`GpuHealth` what is new at each heartbeat and reports it, so the master
can tell a broken node from a broken job.

This is the one module that talks to NVML. ``pynvml`` is imported lazily, and
every NVML error is caught here: no ``pynvml`` exception leaves this module. A
node without a GPU or without a driver is not an error: :meth:`GpuHealth.open`
returns the reason and every later call does nothing. Tests pass
:class:`stead.testing.nvml.FakeNvml` in place of the module and run the same code.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, Literal

__all__ = ["GpuHealth", "GpuProblem", "GpuProblemKind", "UNKNOWN_GPU", "XID_MEANINGS", "ecc_text", "xid_text"]

GpuProblemKind = Literal["xid", "ecc", "lost"]

#: what well-known XIDs mean (NVIDIA's XID catalog); used only for the human text of a problem
XID_MEANINGS: Final[Mapping[int, str]] = MappingProxyType({
    13: "Graphics engine exception",
    31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream",
    38: "Driver firmware error",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors",
    48: "Double-bit ECC error",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    68: "Video processor exception",
    69: "Graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
})

#: the index of an XID event whose GPU NVML cannot name (never seen in practice: events name a watched handle)
UNKNOWN_GPU: Final = -1

#: check() only drains what is already pending: it must never hold up the heartbeat that calls it
_NO_WAIT_MS: Final = 0
#: an XID storm is read this many events per check at most; the rest wait for the next check
_MAX_EVENTS_PER_CHECK: Final = 256


@dataclasses.dataclass(frozen=True)
class GpuProblem:
    """Something wrong with one GPU, new since the previous check."""

    index: int  # the GPU's NVML index; UNKNOWN_GPU if NVML could not say
    kind: GpuProblemKind
    detail: str  # for people: "XID 79 (GPU has fallen off the bus)"

    def __str__(self) -> str:
        gpu = "?" if self.index == UNKNOWN_GPU else str(self.index)
        return f"GPU {gpu}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class _Watched:
    """What is known of one GPU between checks."""

    index: int
    handle_address: int | None  # how an XID event names its GPU; None when NVML gave no handle at open
    ecc_baseline: int | None  # uncorrected volatile ECC count last seen; None where ECC is off or unsupported
    lost: bool = False  # reported lost once; never probed again


#: a GPU as known after a probe, and its new problem if any
_Probed = tuple[_Watched, GpuProblem | None]


class GpuHealth:
    """Watches this node's GPUs: :meth:`open` once, :meth:`check` at each heartbeat, :meth:`close` at the end.

    No method raises. Each NVML call is short and nothing waits for an event, so
    :meth:`check` may be called from the agent's event loop.
    """

    def __init__(self, nvml: Any | None = None) -> None:
        """``nvml``: a module-like NVML (a fake in tests); None imports ``pynvml`` in :meth:`open`."""
        self._nvml: Any = nvml
        self._initialised = False  # nvmlInit succeeded and nvmlShutdown is still owed
        self._events: Any = None  # the NVML event set for critical XIDs; None where events are unsupported
        self._watched: list[_Watched] = []

    @property
    def gpus(self) -> int:
        """How many GPUs are watched: 0 without GPU, before :meth:`open` and after :meth:`close`."""
        return len(self._watched)

    def open(self) -> str:
        """Start watching: "" when GPUs are watched, else why not ("no GPU (NVML: Driver Not Loaded)")."""
        if self._initialised:
            return ""
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                return f"no GPU (pynvml cannot be imported: {exc})"
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return f"no GPU (NVML: {exc})"
        self._initialised = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self.close()
            return f"no GPU (NVML: {exc})"
        if count == 0:
            self.close()
            return "no GPU (NVML sees no device)"
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            self._events = None  # no XID events here (some virtual machines): ECC and loss are still watched
        self._watched = [self._watch(index) for index in range(count)]
        return ""

    def check(self) -> list[GpuProblem]:
        """The problems new since the previous check, each distinct one once; [] when healthy or without GPU."""
        if not self._watched:
            return []
        problems = self._pending_xids()
        watched: list[_Watched] = []
        for gpu in self._watched:
            probed, problem = self._probe(gpu)
            watched.append(probed)
            if problem is not None:
                problems.append(problem)
        self._watched = watched
        # an XID storm repeats the same event many times: the report needs it once
        return list(dict.fromkeys(problems))

    def usage(self) -> tuple[int | None, float | None]:
        """(memory in use on the fullest GPU, bytes; the GPUs' mean utilisation, percent), each None when no GPU
        answered (no GPU, all lost, or NVML refused): an unknown is not a zero."""
        nvml = self._nvml
        used: list[int] = []
        busy: list[float] = []
        for gpu in self._watched:
            if gpu.lost:
                continue
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            except nvml.NVMLError:
                continue
            with contextlib.suppress(nvml.NVMLError):
                used.append(self._memory_used(handle))
            with contextlib.suppress(nvml.NVMLError):
                busy.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        return (max(used) if used else None), (sum(busy) / len(busy) if busy else None)

    def _memory_used(self, handle: Any) -> int:
        """Bytes in use as nvidia-smi counts them: NVML's version 2 answer, whose ``used`` leaves out what the
        driver reserves (version 1 counts it: 480 MiB more on an H100); version 1 where the driver has no v2."""
        nvml = self._nvml
        try:
            return int(nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2).used)
        except (nvml.NVMLError, AttributeError, TypeError):
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).used)

    def close(self) -> None:
        """Stop watching and release NVML; a second call does nothing."""
        self._watched = []
        if not self._initialised:
            return
        nvml = self._nvml
        if self._events is not None:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(self._events)
            self._events = None
        self._initialised = False
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()

    def _watch(self, index: int) -> _Watched:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError:
            # watched all the same: the first check says whether it is lost
            return _Watched(index, handle_address=None, ecc_baseline=None)
        if self._events is not None:
            with contextlib.suppress(nvml.NVMLError):  # unsupported on this GPU: ECC and loss are still watched
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        try:
            baseline: int | None = self._ecc_count(handle)
        except nvml.NVMLError:
            baseline = None  # ECC off or unsupported (most consumer GPUs)
        return _Watched(index, handle_address=_address(handle), ecc_baseline=baseline)

    def _ecc_count(self, handle: Any) -> int:
        nvml = self._nvml
        return int(nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))

    def _pending_xids(self) -> list[GpuProblem]:
        nvml = self._nvml
        if self._events is None:
            return []
        problems: list[GpuProblem] = []
        for _ in range(_MAX_EVENTS_PER_CHECK):
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, _NO_WAIT_MS)
            except nvml.NVMLError_Timeout:
                break  # nothing pending
            except nvml.NVMLError:
                break  # a lost GPU here names no GPU: the probes that follow find which
            if event.eventType & nvml.nvmlEventTypeXidCriticalError:
                problems.append(GpuProblem(self._index_of(event.device), "xid", xid_text(int(event.eventData))))
        return problems

    def _index_of(self, handle: Any) -> int:
        address = _address(handle)
        for gpu in self._watched:
            if gpu.handle_address is not None and gpu.handle_address == address:
                return gpu.index
        nvml = self._nvml
        try:
            return int(nvml.nvmlDeviceGetIndex(handle))
        except nvml.NVMLError:
            return UNKNOWN_GPU

    def _probe(self, gpu: _Watched) -> _Probed:
        """The GPU as now known, and its new problem if any: a rise of ECC errors, or loss."""
        if gpu.lost:
            return gpu, None
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
        except nvml.NVMLError as exc:
            return self._maybe_lost(gpu, exc, answered_at_open=gpu.handle_address is not None)
        if gpu.ecc_baseline is None:
            return gpu, None
        try:
            count = self._ecc_count(handle)
        except nvml.NVMLError as exc:
            return self._maybe_lost(gpu, exc, answered_at_open=True)
        # a lower count is a reset counter (driver reload, GPU reset): the baseline follows it down
        moved = dataclasses.replace(gpu, ecc_baseline=count)
        if count <= gpu.ecc_baseline:
            return moved, None
        return moved, GpuProblem(gpu.index, "ecc", ecc_text(count - gpu.ecc_baseline, count))

    def _maybe_lost(self, gpu: _Watched, exc: Exception, *, answered_at_open: bool) -> _Probed:
        nvml = self._nvml
        if isinstance(exc, nvml.NVMLError_GpuIsLost):
            detail = "GPU is lost"
        elif isinstance(exc, nvml.NVMLError_Unknown) and answered_at_open:
            # the driver no longer answers a question it answered at open: how a lost GPU often looks
            detail = f"GPU is lost (NVML: {exc})"
        else:
            return gpu, None  # anything else may pass (NVML busy, not ready): asked again at the next check
        return dataclasses.replace(gpu, lost=True), GpuProblem(gpu.index, "lost", detail)


def xid_text(code: int) -> str:
    """ "XID 79 (GPU has fallen off the bus)"; "XID 7" for an XID not in :data:`XID_MEANINGS`."""
    meaning = XID_MEANINGS.get(code)
    return f"XID {code}" if meaning is None else f"XID {code} ({meaning})"


def ecc_text(new: int, total: int) -> str:
    """ "3 new uncorrected ECC errors (volatile count now 5)"."""
    errors = "error" if new == 1 else "errors"
    return f"{new} new uncorrected ECC {errors} (volatile count now {total})"


def _address(handle: Any) -> int | None:
    # NVML hands out a new ctypes pointer object for the same device each time: compare where it points
    return ctypes.cast(handle, ctypes.c_void_p).value
