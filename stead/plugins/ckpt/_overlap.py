"""``copy_mode="overlap"``: training goes on while a save's device-to-host copy is in flight.

An overlapped save queues its copies on a side stream and returns. The training stream is
made to wait for them (on the GPU: the host never blocks) only where it would change a
tensor being copied: before any optimizer's ``step()``, and before the forward of a module
in training mode whose buffers are being copied (BatchNorm's running statistics). The next
step's forward and backward overlap the copy. Other in-place changes to a saved tensor
before the next optimizer step are not ordered after the copy: such scripts keep the
default ``sync`` mode.

The optimizer hook, once installed, stays (a hook may not remove itself while the
optimizer iterates its hooks); it costs one call per step. The forward hook is installed
only while a copy is in flight and removes itself after, so that modules keep PyTorch's
hook-free fast path.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["guard", "release"]


@dataclasses.dataclass(frozen=True)
class _InFlight:
    event: Any  # torch.cuda.Event recorded after the copies
    pointers: frozenset[int]  # data_ptr() of every tensor being copied


_lock = threading.Lock()
_in_flight: list[_InFlight] = []
_optimizer_hook: RemovableHandle | None = None
_forward_hook: RemovableHandle | None = None


def guard(event: Any, tensors: Iterable[torch.Tensor]) -> None:
    """Make the training stream wait for ``event`` before it changes one of ``tensors``."""
    global _optimizer_hook, _forward_hook
    with _lock:
        _in_flight.append(_InFlight(event, frozenset(t.data_ptr() for t in tensors)))
        if _optimizer_hook is None:
            _optimizer_hook = register_optimizer_step_pre_hook(_before_step)
        if _forward_hook is None:
            _forward_hook = register_module_forward_pre_hook(_before_forward)


def release(event: Any) -> None:
    """The host saw ``event`` complete (the copy is done): nothing has to wait for it any more."""
    with _lock:
        _in_flight[:] = [f for f in _in_flight if f.event is not event]


def _wait(matching: Any) -> None:
    """Order the current stream after every copy in flight that ``matching(pointers)`` selects, and forget them."""
    with _lock:
        waited = [f for f in _in_flight if matching(f.pointers)]
        if not waited:
            return
        stream = torch.cuda.current_stream()
        for flight in waited:
            stream.wait_event(flight.event)
        _in_flight[:] = [f for f in _in_flight if f not in waited]


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _in_flight:
        _wait(lambda pointers: True)


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    global _forward_hook
    if not _in_flight:
        with _lock:
            if not _in_flight and _forward_hook is not None:
                # safe here: a module takes a copy of the global hooks before it calls them
                _forward_hook.remove()
                _forward_hook = None
        return
    if module.training and module._buffers:
        buffers = {b.data_ptr() for b in module._buffers.values() if b is not None}
        if buffers:
            _wait(lambda pointers: not buffers.isdisjoint(pointers))
