"""A non-finite gradient caught on the rank that produced it, before the all-reduce spreads it and before any
optimizer applies it (the worker side of ``stead.numerics``).

Under DDP, :func:`guard` replaces the model's communication hook with one that sums each gradient bucket of
this rank (one pass over the bucket, no synchronisation) before handing it to the all-reduce; a global
optimizer pre-step hook then looks at the step's sums once (one device-to-host copy a step). A NaN or an
infinity in this rank's own gradients makes the sum non-finite: the hook raises :class:`NonFiniteGradientError`
naming the rank, its host, the step and the bucket, and the step is not applied. Why a sum and not
``isfinite().all()``: the same single pass, one scalar to look at, no boolean tensor the size of the bucket.
A sum past float32's range (gradients near 1e38, garbage already) counts as non-finite too.

The other ranks' all-reduce carried the NaN to them (their averaged gradients are non-finite) but the step
they apply is never committed: the rank that raised saves nothing more, and a restarted round restores the
last step every rank committed. The diagnosis plugin classifies the error as numerical (a restart from the
flash checkpoint); the same NaN at the same step again after the restore is a repeated failure, decided as
the user's on its second occurrence.

For a model that is not wrapped in DDP (one process), the pre-step hook checks the total norm of the model's
gradients instead: a non-finite gradient is caught before the step. Under FSDP that check would come after the
reduce-scatter, naming the rank that saw it, not necessarily the one that made it (not tested with FSDP yet).

Fault injection for tests and demos: ``STEAD_NUMERICS_INJECT="nan:rank=1:step=5"`` (or ``inf``) makes rank 1's
gradient non-finite at step 5, in the first run of the workers only (``TORCHELASTIC_RESTART_COUNT`` 0), so the
restored run goes on as a fault-free one would; a warning says it is on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import warnings
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from stead.core.worker import progress

__all__ = ["INJECT_ENV", "Guard", "NonFiniteGradientError", "guard", "parse_injection"]

#: the environment variable that asks for an injected fault (tests and demos)
INJECT_ENV = "STEAD_NUMERICS_INJECT"
_INJECTION = re.compile(r"(?P<kind>nan|inf):rank=(?P<rank>\d+):step=(?P<step>\d+)")


class NonFiniteGradientError(RuntimeError):
    """This rank's own gradients hold a NaN or an infinity: the step is not applied."""


@dataclasses.dataclass(frozen=True)
class Injection:
    kind: str
    rank: int
    step: int


def parse_injection(text: str) -> Injection:
    """``kind:rank=R:step=S`` as :data:`INJECT_ENV` gives it; ValueError saying what is wrong."""
    match = _INJECTION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{INJECT_ENV}={text!r} is not KIND:rank=R:step=S with KIND nan or inf, e.g. "
                         "nan:rank=1:step=5")
    return Injection(match["kind"], int(match["rank"]), int(match["step"]))


class Guard:
    """What :func:`guard` installed: ``remove()`` takes the optimizer hook off (DDP keeps its hook)."""

    def __init__(self, model: torch.nn.Module, *, injection: Injection | None) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.host = socket.gethostname()
        self.model = model
        self.injection = injection
        #: the step's bucket sums (this rank's gradients before the all-reduce), in bucket order
        self.sums: list[torch.Tensor] = []
        #: optimizer steps since guard(): the step where stead does not track them (plain torchrun)
        self.taken = 0
        self.ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        self._handle = register_optimizer_step_pre_hook(self._before_step)

    def remove(self) -> None:
        self._handle.remove()

    @property
    def step(self) -> int:
        tracked = progress.training_step()
        return self.taken if tracked is None else tracked

    # -- DDP: each bucket, before its all-reduce --------------------------------------------------------------

    def bucket(self, buffer: torch.Tensor) -> None:
        if not self.sums and self._injecting():
            buffer.view(-1)[0] = math.nan if self.injection and self.injection.kind == "nan" else math.inf
        self.sums.append(buffer.sum(dtype=torch.float32))

    # -- every optimizer step ---------------------------------------------------------------------------------

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step = self.step
        if self.ddp:
            sums, self.sums = self.sums, []
            if not sums or math.isfinite(float(torch.stack(sums).sum())):
                self.taken += bool(sums)
                return  # (no sums: no backward since the last step, as with a second optimizer)
            bad = [i for i, s in enumerate(sums) if not math.isfinite(float(s))]
            where = f"gradient bucket(s) {bad} of this rank, before the all-reduce"
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if grads and self._injecting():
                grads[0].view(-1)[0] = math.nan if self.injection and self.injection.kind == "nan" else math.inf
            if not grads or math.isfinite(float(torch.nn.utils.get_total_norm(grads))):
                self.taken += bool(grads)
                return
            names = [n for n, p in self.model.named_parameters() if p.grad is not None
                     and not bool(torch.isfinite(p.grad).all())]
            where = f"the gradients of {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or Inf) on rank {self.rank} (host {self.host}) at step {step}: {where}; "
            "the step was not applied. stead restores the last committed checkpoint; the same fault at the same "
            "step again fails the job (look for a division by zero, a log of 0, a learning rate or loss scale too "
            "high, or a bad batch)")

    def _injecting(self) -> bool:
        injection = self.injection
        return (injection is not None and injection.rank == self.rank and self.step == injection.step
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def guard(model: torch.nn.Module) -> Guard:
    """Catch a non-finite gradient on the rank that made it, before the optimizer applies it (module doc).

    Call it once, after wrapping the model in DDP (a DDP model keeps one communication hook: one registered
    before is refused with what to do)."""
    raw = os.environ.get(INJECT_ENV, "")
    injection = parse_injection(raw) if raw else None
    if injection is not None:
        warnings.warn(f"{INJECT_ENV} is set: rank {injection.rank} will produce a non-finite ({injection.kind}) "
                      f"gradient at step {injection.step}; fault injection is for tests and demos", stacklevel=2)
    checker = Guard(model, injection=injection)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        try:
            model.register_comm_hook(checker, _checked_allreduce)
        except RuntimeError as exc:
            checker.remove()
            raise RuntimeError(
                f"stead.numerics.guard cannot check this DDP model's gradients: {exc}. It needs the model's one "
                "communication hook (it all-reduces as DDP's default does); call guard before registering "
                "another, or drop that one") from exc
    return checker


def _checked_allreduce(checker: Guard, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    checker.bucket(bucket.buffer())
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group


# DDP checks a hook's annotations as objects (this module's are strings: postponed)
_checked_allreduce.__annotations__ = {"checker": Guard, "bucket": torch.distributed.GradBucket,  # type: ignore[attr-defined]
                                      "return": torch.futures.Future[torch.Tensor]}
