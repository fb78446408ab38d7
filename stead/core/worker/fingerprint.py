"""Replicas' fingerprints: silent corruption between data-parallel replicas found, and the odd rank named.

Under DDP every replica holds the same parameters after every step, bit for bit: the same initial weights
(DDP broadcasts them), the same averaged gradients, the same optimizer arithmetic. A replica that differs
computed something wrong without saying so (a flipped bit in memory, a GPU with silent data corruption).

:func:`fingerprint` is, for each tensor, the wrapping sum of its elements' bit patterns read as integers
(a float32 as an int32 summed into an int64): one read-only pass, exact and independent of the order of
the reduction, so that equal replicas give equal fingerprints on any device. A single flipped bit changes
its element by +-2**k and so the sum: it is never missed; several flips cancelling exactly is the one
blind spot (a hash would close it at several times the cost). One int64 per tensor also says which tensor
differs.

:func:`odd_ranks` decides from every rank's fingerprint: the ranks that differ from a strict majority.
With two replicas (or a tie) there is no majority: :func:`probe` (a matrix product with a known exact
answer, on the replica's own device) is run on each, and a replica that gets it wrong is the odd one; when
both get it right nobody can be blamed (the job rolls back all the same).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import torch

__all__ = ["fingerprint", "flip_bit", "odd_ranks", "probe"]

#: the integer type of each element size, to read a tensor's bit patterns
_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: the highest mantissa bit of each floating-point element size (the bit an injected flip changes)
_MANTISSA_TOP = {2: 6, 4: 22, 8: 51}
#: the probe's size: integer entries in [-8, 8], so every sum of products is exact in float32 (< 2**24)
_PROBE_N = 256


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as integers of the same size (the same memory, flat)."""
    flat = tensor.detach().reshape(-1)
    size = flat.element_size()
    return flat.view(_INTEGER[size]) if size in _INTEGER else flat.contiguous().view(torch.uint8)


def fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor: the wrapping sum of its elements' bit patterns (module doc), on their device."""
    return torch.stack([bits(t).sum(dtype=torch.int64) for t in tensors])


def flip_bit(tensor: torch.Tensor) -> None:
    """Flip the highest mantissa bit of ``tensor``'s first element, in place (fault injection)."""
    flat = bits(tensor)
    flat[0] ^= 1 << _MANTISSA_TOP.get(tensor.element_size(), 0)


def odd_ranks(prints: Sequence[Sequence[int]]) -> list[int] | None:
    """The ranks whose fingerprint differs from a strict majority's ([] when all agree), or None when there is
    no strict majority (two replicas that differ, a tie)."""
    counts = collections.Counter(tuple(p) for p in prints)
    common, seen = counts.most_common(1)[0]
    if seen == len(prints):
        return []
    if 2 * seen <= len(prints):
        return None
    return [rank for rank, p in enumerate(prints) if tuple(p) != common]


def probe(device: torch.device) -> bool:
    """Whether this device computes a matrix product with a known answer right (exact: integer entries)."""
    gen = torch.Generator().manual_seed(43)
    a = torch.randint(-8, 9, (_PROBE_N, _PROBE_N), generator=gen)
    b = torch.randint(-8, 9, (_PROBE_N, _PROBE_N), generator=gen)
    want = a @ b  # int64 on the CPU: the known answer
    got = (a.to(device, torch.float32) @ b.to(device, torch.float32)).cpu()
    return bool(torch.equal(got.to(torch.int64), want))
