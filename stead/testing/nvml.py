"""A fake NVML, so the GPU health rules can be tested on machines without a GPU (CI, laptops).

:class:`FakeNvml` stands in for the ``pynvml`` module: it has the functions,
constants and exception classes that :class:`stead.core.agent.gpu.GpuHealth`
calls, with the same names, signatures, handle types and error codes, so
``GpuHealth(nvml=FakeNvml(gpus=2))`` runs the code that runs against the real
module. What the GPUs do is scripted::

    nvml = FakeNvml(gpus=2)
    health = GpuHealth(nvml=nvml)
    health.open()
    nvml.xid(1, 79)        # GPU 1 falls off the bus...
    nvml.lose(1)           # ...and every later call on it fails with GPU_IS_LOST
    health.check()         # [XID 79 on GPU 1, GPU 1 lost]

Import it directly: ``from stead.testing.nvml import FakeNvml``.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import pynvml

__all__ = [
    "FakeNvml", "NVMLError", "NVMLError_DriverNotLoaded", "NVMLError_GpuIsLost", "NVMLError_InvalidArgument",
    "NVMLError_NotSupported", "NVMLError_Timeout", "NVMLError_Uninitialized", "NVMLError_Unknown",
]

#: where the fake's device and event-set handles point: made-up addresses, never dereferenced
_DEVICE_ADDRESS_BASE: Final = 0x1000
_EVENT_SET_ADDRESS_BASE: Final = 0x100000

#: pynvml's own texts, so a reason built from the fake reads like one built from the real module
_ERROR_TEXT: Final = {
    pynvml.NVML_ERROR_UNINITIALIZED: "Uninitialized",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    pynvml.NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    pynvml.NVML_ERROR_TIMEOUT: "Timeout",
    pynvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    pynvml.NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """The fake's ``NVMLError``: ``.value`` is the NVML return code, ``str()`` pynvml's text for it."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")


class NVMLError_Uninitialized(NVMLError):
    def __init__(self) -> None:
        super().__init__(pynvml.NVML_ERROR_UNINITIALIZED)


class NVMLError_InvalidArgument(NVMLError):
    def __init__(self) -> None:
        super().__init__(pynvml.NVML_ERROR_INVALID_ARGUMENT)


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(pynvml.NVML_ERROR_NOT_SUPPORTED)


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self) -> None:
        super().__init__(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


class NVMLError_Timeout(NVMLError):
    def __init__(self) -> None:
        super().__init__(pynvml.NVML_ERROR_TIMEOUT)


class NVMLError_GpuIsLost(NVMLError):
    def __init__(self) -> None:
        super().__init__(pynvml.NVML_ERROR_GPU_IS_LOST)


class NVMLError_Unknown(NVMLError):
    def __init__(self) -> None:
        super().__init__(pynvml.NVML_ERROR_UNKNOWN)


# like pynvml, an error raised for a code is an instance of that code's class
_ERROR_CLASSES: Final[dict[int, Callable[[], NVMLError]]] = {
    pynvml.NVML_ERROR_UNINITIALIZED: NVMLError_Uninitialized,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: NVMLError_InvalidArgument,
    pynvml.NVML_ERROR_NOT_SUPPORTED: NVMLError_NotSupported,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: NVMLError_DriverNotLoaded,
    pynvml.NVML_ERROR_TIMEOUT: NVMLError_Timeout,
    pynvml.NVML_ERROR_GPU_IS_LOST: NVMLError_GpuIsLost,
    pynvml.NVML_ERROR_UNKNOWN: NVMLError_Unknown,
}


def _error(code: int) -> NVMLError:
    cls = _ERROR_CLASSES.get(code)
    return NVMLError(code) if cls is None else cls()


class FakeNvml:
    """A scripted stand-in for the ``pynvml`` module (see the module docstring).

    ``gpus``: how many devices NVML counts. ``driver=False``: ``nvmlInit`` fails
    with Driver Not Loaded, as on a machine without the NVIDIA driver.
    ``ecc=False``: ECC counters are Not Supported (consumer GPUs).
    ``xid_events=False``: registering for XID events is Not Supported.
    """

    # the constants GpuHealth reads, with pynvml's values
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED: Final = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC: Final = pynvml.NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError: Final = pynvml.nvmlEventTypeXidCriticalError

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_Unknown = NVMLError_Unknown
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, gpus: int = 1, *, driver: bool = True, ecc: bool = True, xid_events: bool = True) -> None:
        self._gpus = gpus
        self._driver = driver
        self._ecc_supported = ecc
        self._xid_events = xid_events
        self._refcount = 0  # like NVML: each nvmlInit needs its nvmlShutdown
        self._ecc_counts = [0] * gpus
        self._failures: dict[int, int] = {}  # GPU index -> the error code every call on it raises
        self._event_sets: dict[int, tuple[set[int], deque[tuple[int, int]]]] = {}  # address -> (GPUs, events)
        self._next_event_set = _EVENT_SET_ADDRESS_BASE
        self._memory_total = 80 << 30
        #: what the driver keeps for itself (v1 of nvmlDeviceGetMemoryInfo counts it as used)
        self.reserved = 480 << 20
        self._used = [0] * gpus  # bytes in use per GPU
        self._util = [0] * gpus  # utilisation percent per GPU
        #: how many times nvmlShutdown was called
        self.shutdowns = 0

    # -- the script ----------------------------------------------------------------------------------------------

    def xid(self, index: int, code: int) -> None:
        """GPU ``index`` reports critical XID ``code``: queued in every event set registered for it, as NVML does."""
        self._script(index)
        for registered, pending in self._event_sets.values():
            if index in registered:
                pending.append((index, code))

    def ecc(self, index: int, count: int) -> None:
        """GPU ``index`` sees ``count`` more uncorrected ECC errors (the volatile counter rises)."""
        self._script(index)
        self._ecc_counts[index] += count

    def use(self, index: int, *, memory_bytes: int, util_percent: int) -> None:
        """GPU ``index`` has ``memory_bytes`` in use (of 80 GiB) and was ``util_percent`` busy."""
        self._script(index)
        self._used[index], self._util[index] = memory_bytes, util_percent

    def lose(self, index: int) -> None:
        """GPU ``index`` falls off the bus: every later call on it raises GPU_IS_LOST."""
        self.fail(index, pynvml.NVML_ERROR_GPU_IS_LOST)

    def fail(self, index: int, code: int) -> None:
        """Every later call on GPU ``index`` raises the NVML error ``code`` (e.g. ``pynvml.NVML_ERROR_UNKNOWN``)."""
        self._script(index)
        self._failures[index] = code

    @property
    def initialised(self) -> bool:
        """Whether nvmlInit calls outnumber nvmlShutdown calls."""
        return self._refcount > 0

    @property
    def open_event_sets(self) -> int:
        """Event sets created and not yet freed."""
        return len(self._event_sets)

    # -- pynvml's functions -----------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if not self._driver:
            raise NVMLError_DriverNotLoaded()
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self._initialised()
        self._refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._initialised()
        return self._gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._initialised()
        self._device(index)
        return _handle(index)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._index(handle)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        index = self._index(handle)
        if not self._ecc_supported:
            raise NVMLError_NotSupported()
        if errorType != pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED or counterType != pynvml.NVML_VOLATILE_ECC:
            return 0  # only uncorrected volatile errors are scripted
        return self._ecc_counts[index]

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        """Version 1 counts the driver's reserved memory as used (as real drivers do); version 2 apart."""
        index = self._index(handle)
        used = self._used[index]
        if version is None:
            used += self.reserved
            return pynvml.c_nvmlMemory_t(total=self._memory_total, free=self._memory_total - used, used=used)
        return pynvml.c_nvmlMemory_v2_t(version=version, total=self._memory_total, reserved=self.reserved,
                                        free=self._memory_total - used - self.reserved, used=used)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        index = self._index(handle)
        return pynvml.c_nvmlUtilization_t(gpu=self._util[index], memory=0)

    def nvmlEventSetCreate(self) -> Any:
        self._initialised()
        address = self._next_event_set
        self._next_event_set += 1
        self._event_sets[address] = (set(), deque())
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlEventSet_t)

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        index = self._index(handle)
        registered, _ = self._event_set(eventSet)
        if not self._xid_events or eventTypes & ~pynvml.nvmlEventTypeXidCriticalError:
            raise NVMLError_NotSupported()  # NVML's answer when some requested event type is unsupported
        registered.add(index)

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        _, pending = self._event_set(eventSet)
        if not pending:
            raise NVMLError_Timeout()  # the fake never waits: nothing comes unless scripted
        index, code = pending.popleft()
        data = pynvml.c_nvmlEventData_t()
        data.device = _handle(index)  # as NVML does, even for a GPU lost since the event
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = code
        return data

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._event_set(eventSet)
        del self._event_sets[_address(eventSet)]

    # -- checks every call makes, like the NVML library ------------------------------------------------------------

    def _initialised(self) -> None:
        if self._refcount <= 0:
            raise NVMLError_Uninitialized()

    def _script(self, index: int) -> None:
        if not 0 <= index < self._gpus:
            raise ValueError(f"the fake has {self._gpus} GPUs: there is no GPU {index} to script")

    def _device(self, index: int) -> None:
        if not 0 <= index < self._gpus:
            raise NVMLError_InvalidArgument()
        failure = self._failures.get(index)
        if failure is not None:
            raise _error(failure)

    def _index(self, handle: Any) -> int:
        self._initialised()
        index = _address(handle) - _DEVICE_ADDRESS_BASE
        self._device(index)
        return index

    def _event_set(self, event_set: Any) -> tuple[set[int], deque[tuple[int, int]]]:
        self._initialised()
        found = self._event_sets.get(_address(event_set))
        if found is None:
            raise NVMLError_InvalidArgument()
        return found


def _handle(index: int) -> Any:
    # a real pynvml device handle type, so GpuHealth compares fake handles as it compares real ones
    return ctypes.cast(ctypes.c_void_p(_DEVICE_ADDRESS_BASE + index), pynvml.c_nvmlDevice_t)


def _address(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0
