"""``copy_mode="overlap"``'s ordering: which training work waits for a save's copy in flight.

The copies themselves need a GPU (test_cuda.py); the ordering is the hooks' decision, tested here with a
stream that records what it was made to wait for.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.nn.modules import module as nn_module

from stead.plugins.ckpt import _overlap


class Stream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


@pytest.fixture
def stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stream]:
    recorder = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: recorder)
    yield recorder
    for event in list(_overlap._in_flight):
        _overlap.release(event.event)


def test_the_optimizer_step_waits_for_every_copy_in_flight_and_only_once(stream: Stream) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copy = object()
    _overlap.guard(copy, list(model.state_dict().values()))
    model(torch.ones(1, 4)).sum().backward()
    assert stream.waited == []  # forward and backward overlap the copy
    opt.step()
    assert stream.waited == [copy]
    opt.step()
    assert stream.waited == [copy]


def test_a_forward_that_updates_a_saved_buffer_waits_and_others_do_not(stream: Stream) -> None:
    norm, linear = torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4)
    saved_norm, saved_other = object(), object()
    _overlap.guard(saved_norm, list(norm.state_dict().values()))
    _overlap.guard(saved_other, [torch.zeros(3)])
    linear(torch.ones(2, 4))
    assert stream.waited == []
    norm.eval()
    norm(torch.ones(2, 4))  # eval mode reads the running statistics, it does not change them
    assert stream.waited == []
    norm.train()
    norm(torch.ones(2, 4))
    assert stream.waited == [saved_norm]


def test_the_forward_hook_goes_once_no_copy_is_in_flight(stream: Stream) -> None:
    copy = object()
    _overlap.guard(copy, [torch.zeros(2)])
    hook = _overlap._forward_hook
    assert hook is not None and hook.id in nn_module._global_forward_pre_hooks
    linear = torch.nn.Linear(2, 2)
    linear(torch.ones(1, 2))
    assert hook.id in nn_module._global_forward_pre_hooks  # still in flight
    _overlap.release(copy)  # the host saw the copy complete
    linear(torch.ones(1, 2))
    assert hook.id not in nn_module._global_forward_pre_hooks and _overlap._forward_hook is None
    assert stream.waited == []
