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

Silent corruption: under DDP, every ``fingerprint_every`` optimizer steps (``STEAD_NUMERICS_FINGERPRINT_EVERY``,
default 100; 0: off) the replicas compare a fingerprint of their parameters (and optimizer state with
``fingerprint_optimizer``) in one all-gather of one int64 per tensor, after the step is applied and before the
script saves it (:mod:`stead.core.worker.fingerprint`). A rank that differs from the majority raises
:class:`ReplicaMismatchError` naming itself, its host, the step and the tensors that differ: the diagnosis
relaunches its node and keeps its host out (rule ``replica-mismatch``). The error also says the last step whose
fingerprints agreed (where this run started when none was compared yet): every step after it may hold the
corruption (the all-reduce spreads one rank's wrong gradients to every replica), so the round restores the newest
checkpoint at or before it (the master's restore bound). With two replicas each runs a known-answer probe: the one
that gets it wrong is odd; when both get it right rank 0 raises, no host is blamed, the round restores all the same.

Fault injection for tests and demos: ``STEAD_NUMERICS_INJECT="KIND:rank=R:step=S"`` (``:host=H`` to ask for a
host as well) makes rank R's gradient non-finite at step S (KIND ``nan`` or ``inf``), or, after the step is
applied, flips a bit of its first parameter (``bitflip``) or adds noise to it (``noise``); in the first run of
the workers only (``TORCHELASTIC_RESTART_COUNT`` 0), so the restored run goes on as a fault-free one would; a
warning says it is on.
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
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from stead.core.config import load_settings
from stead.core.worker import progress
from stead.core.worker.fingerprint import fingerprint, flip_bit, odd_ranks, probe
from stead.core.worker.numerics_settings import NumericsSettings
from stead.core.worker.skipping import drop_gradients, skip_steps, skipped

__all__ = ["INJECT_ENV", "Guard", "NonFiniteGradientError", "NumericsSettings", "ReplicaMismatchError", "guard",
           "parse_injection"]

#: the environment variable that asks for an injected fault (tests and demos)
INJECT_ENV = "STEAD_NUMERICS_INJECT"
_INJECTION = re.compile(r"(?P<kind>nan|inf|bitflip|noise):rank=(?P<rank>\d+):step=(?P<step>\d+)"
                        r"(:host=(?P<host>[^:]+))?")
#: the size of the noise ``noise`` adds to a parameter (relative to 1)
_NOISE = 1e-3
#: the bytes a fingerprint may read every step before guard() warns of its cost
_EVERY_STEP_WARN_BYTES = 1 << 30


class NonFiniteGradientError(RuntimeError):
    """This rank's own gradients hold a NaN or an infinity: the step is not applied."""


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas' parameters differ after a step: silent corruption (module doc)."""


@dataclasses.dataclass(frozen=True)
class Injection:
    kind: str
    rank: int
    step: int
    host: str = ""


def parse_injection(text: str) -> Injection:
    """``kind:rank=R:step=S[:host=H]`` as :data:`INJECT_ENV` gives it; ValueError saying what is wrong."""
    match = _INJECTION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{INJECT_ENV}={text!r} is not KIND:rank=R:step=S[:host=H] with KIND nan, inf, bitflip or "
                         "noise, e.g. nan:rank=1:step=5")
    return Injection(match["kind"], int(match["rank"]), int(match["step"]), match["host"] or "")


class Guard:
    """What :func:`guard` installed: ``remove()`` takes the optimizer hooks off (DDP keeps its hook)."""

    def __init__(self, model: torch.nn.Module, *, injection: Injection | None, settings: NumericsSettings) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.round = int(os.environ.get("STEAD_ROUND", "0"))
        self.host = socket.gethostname()
        self.model = model
        self.injection = injection
        self.settings = settings
        #: the step's bucket sums (this rank's gradients before the all-reduce), in bucket order
        self.sums: list[torch.Tensor] = []
        #: optimizer steps since guard(): the step where stead does not track them (plain torchrun)
        self.taken = 0
        #: the last step whose fingerprints every replica agreed on (None: none compared yet in this run)
        self.agreed: int | None = None
        #: the first step this run of the workers applied (None: none yet); the step before it is where the run
        #: started: the restored step (every rank restores the same one), or -1, the script's initial state (DDP
        #: broadcast rank 0's parameters to every replica when it wrapped the model)
        self.first: int | None = None
        self.ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        #: the steps this round skips on every rank (the master's decisions, see :mod:`.skipping`)
        self.skip = skip_steps()
        self._stepping: int | None = None  # the step the pre-step hook passed, until the post-step hook
        self._handles = (register_optimizer_step_pre_hook(self._before_step),
                         register_optimizer_step_post_hook(self._after_step))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @property
    def step(self) -> int:
        tracked = progress.training_step()
        return self.taken if tracked is None else tracked

    @property
    def fingerprinting(self) -> bool:
        """Whether replicas compare fingerprints: DDP over two ranks or more, ``fingerprint_every`` above 0."""
        return self.ddp and self.settings.fingerprint_every > 0 and _world(self.model) > 1

    # -- DDP: each bucket, before its all-reduce --------------------------------------------------------------

    def bucket(self, buffer: torch.Tensor) -> None:
        if not self.sums and self._injecting("nan", "inf"):
            buffer.view(-1)[0] = math.nan if self.injection and self.injection.kind == "nan" else math.inf
        self.sums.append(buffer.sum(dtype=torch.float32))

    # -- every optimizer step ---------------------------------------------------------------------------------

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step = self.step
        if step in self.skip:  # the master's decision, the same on every rank: nothing of the step is applied
            self.sums = []
            self.taken += 1
            self._stepping = step
            drop_gradients(optimizer)
            skipped(step, rank=self.rank, cause="its batch caused a numerical fault before the rollback")
            return
        if self.ddp:
            sums, self.sums = self.sums, []
            if not sums or math.isfinite(float(torch.stack(sums).sum())):
                self.taken += bool(sums)
                self._stepping = step if sums else None
                return  # (no sums: no backward since the last step, as with a second optimizer)
            bad = [i for i, s in enumerate(sums) if not math.isfinite(float(s))]
            where = f"gradient bucket(s) {bad} of this rank, before the all-reduce"
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            if grads and self._injecting("nan", "inf"):
                grads[0].view(-1)[0] = math.nan if self.injection and self.injection.kind == "nan" else math.inf
            if not grads or math.isfinite(float(torch.nn.utils.get_total_norm(grads))):
                self.taken += bool(grads)
                return
            names = [n for n, p in self.model.named_parameters() if p.grad is not None
                     and not bool(torch.isfinite(p.grad).all())]
            where = f"the gradients of {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or Inf) on rank {self.rank} (host {self.host}) at step {step}: {where}; "
            "the step was not applied. stead restores the last committed checkpoint and then, as numerics.on_nan "
            "says, skips this step's batch on every rank (skip, the default), trains it again (restore) or fails "
            "the job (fail); if it keeps coming, look for a division by zero, a log of 0, a learning rate or loss "
            "scale too high, or bad data")

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step, self._stepping = self._stepping, None
        if step is None:
            return  # not a step the pre-step hook passed (a second optimizer's, or no backward)
        if self.first is None:
            self.first = step
        first = next(iter(self.model.parameters()), None)
        if first is not None and self._injecting("bitflip", "noise", at=step):
            with torch.no_grad():
                if self.injection and self.injection.kind == "bitflip":
                    flip_bit(first)
                else:
                    gen = torch.Generator(first.device).manual_seed(step)  # not the script's generator
                    first.add_(torch.randn(first.shape, generator=gen, device=first.device).to(first.dtype) * _NOISE)
        if self.fingerprinting and self.taken % self.settings.fingerprint_every == 0:
            self._compare(step, optimizer)

    # -- replicas' fingerprints -------------------------------------------------------------------------------

    def _compare(self, step: int, optimizer: Any) -> None:
        named = list(self.model.named_parameters())
        tensors: list[torch.Tensor] = [p for _, p in named]
        names = [n.removeprefix("module.") for n, _ in named]
        if self.settings.fingerprint_optimizer:
            for name, p in named:
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        tensors.append(value)
                        names.append(f"{name.removeprefix('module.')} (optimizer {key})")
        device = tensors[0].device
        mine = torch.cat([torch.tensor([self.round, step], dtype=torch.int64, device=device),
                          fingerprint(tensors).to(device)])
        group = getattr(self.model, "process_group", None)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        rows = torch.stack(gathered).cpu().tolist()
        if any(row[:2] != rows[0][:2] for row in rows):
            raise RuntimeError(
                f"stead.numerics: replicas compared fingerprints of different steps or rounds (round, step of each "
                f"rank: {[tuple(row[:2]) for row in rows]}): the ranks' optimizers do not step together. Every rank "
                "must call guard() once and step the same optimizers; or turn fingerprints off "
                "(STEAD_NUMERICS_FINGERPRINT_EVERY=0)")
        prints = [row[2:] for row in rows]
        odd = odd_ranks(prints)
        if odd == []:
            self.agreed = step
            return
        blame = "differ from the majority's"
        if odd is None:  # two replicas, or a tie: a known answer decides
            answers = [torch.empty(1, dtype=torch.int64, device=device) for _ in rows]
            dist.all_gather(answers, torch.tensor([int(probe(device))], device=device), group=group)
            odd = [rank for rank, ok in enumerate(answers) if not int(ok.item())]
            blame = "differ, and this rank got a known matrix product wrong (the probe)"
            if not odd:
                if dist.get_rank(group) == 0:
                    raise ReplicaMismatchError(
                        f"replicas' parameters differ at step {step} and no replica can be blamed: {len(rows)} "
                        f"replicas, no majority, every one passed the known-answer probe (host {self.host}, rank "
                        f"{self.rank}); {self.last_agreed()}. stead restores the newest checkpoint at or before "
                        "that step. If this model's replicas differ by design (per-rank parameters), turn the check "
                        "off: STEAD_NUMERICS_FINGERPRINT_EVERY=0")
                return
        me = dist.get_rank(group)
        if me not in odd:
            return  # the odd rank raises; this one's next collective fails with it and the round restarts
        majority = next(p for rank, p in enumerate(prints) if rank not in odd)
        differ = [names[i] for i, (a, b) in enumerate(zip(prints[me], majority, strict=True)) if a != b]
        raise ReplicaMismatchError(
            f"replica mismatch: rank {self.rank} (host {self.host}) at step {step}: its parameters {blame} "
            f"({len(rows) - len(odd)} of {len(rows)} replicas agree) in {', '.join(differ[:5])}"
            f"{' ...' if len(differ) > 5 else ''}; {self.last_agreed()}. The step is not saved; stead relaunches "
            "this rank's node elsewhere, keeps its host out and restores the newest checkpoint at or before that "
            "step. If this model's replicas differ by design, turn the check off: STEAD_NUMERICS_FINGERPRINT_EVERY=0")

    def last_agreed(self) -> str:
        """``fingerprints last agreed at step A``, the bound of the restore the master decides (every step after A
        may hold the corruption: the all-reduce spread it); A is where this run started when it compared none yet."""
        if self.agreed is not None:
            return f"fingerprints last agreed at step {self.agreed}"
        start = (self.first if self.first is not None else self.step) - 1
        where = "the script's initial state" if start < 0 else "the step this run of the workers restored"
        return f"fingerprints last agreed at step {start} ({where}; none compared since)"

    def _injecting(self, *kinds: str, at: int | None = None) -> bool:
        injection = self.injection
        return (injection is not None and injection.kind in kinds and injection.rank == self.rank
                and (self.step if at is None else at) == injection.step
                and (not injection.host or injection.host == self.host)
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def _world(model: torch.nn.Module) -> int:
    return dist.get_world_size(getattr(model, "process_group", None)) if dist.is_initialized() else 1


def guard(model: torch.nn.Module, *, fingerprint_every: int | None = None,
          fingerprint_optimizer: bool | None = None) -> Guard:
    """Catch a non-finite gradient on the rank that made it, before the optimizer applies it, and (DDP) a
    replica whose parameters differ from the others' (module doc).

    Call it once, after wrapping the model in DDP (a DDP model keeps one communication hook: one registered
    before is refused with what to do). ``fingerprint_every`` and ``fingerprint_optimizer`` override
    ``STEAD_NUMERICS_FINGERPRINT_EVERY`` (default 100; 0: no fingerprints) and
    ``STEAD_NUMERICS_FINGERPRINT_OPTIMIZER``."""
    settings = load_settings(NumericsSettings, "numerics")
    if fingerprint_every is not None:
        if fingerprint_every < 0:
            raise ValueError(f"fingerprint_every={fingerprint_every} must be 0 (no fingerprints) or more")
        settings = dataclasses.replace(settings, fingerprint_every=fingerprint_every)
    if fingerprint_optimizer is not None:
        settings = dataclasses.replace(settings, fingerprint_optimizer=fingerprint_optimizer)
    raw = os.environ.get(INJECT_ENV, "")
    injection = parse_injection(raw) if raw else None
    if injection is not None:
        what = ("a non-finite ({}) gradient" if injection.kind in ("nan", "inf") else "a {} in its first parameter"
                ).format(injection.kind)
        warnings.warn(f"{INJECT_ENV} is set: rank {injection.rank}{' on ' + injection.host if injection.host else ''}"
                      f" will produce {what} at step {injection.step}; fault injection is for tests and demos",
                      stacklevel=2)
    checker = Guard(model, injection=injection, settings=settings)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        try:
            model.register_comm_hook(checker, _checked_allreduce)
        except RuntimeError as exc:
            checker.remove()
            raise RuntimeError(
                f"stead.numerics.guard cannot check this DDP model's gradients: {exc}. It needs the model's one "
                "communication hook (it all-reduces as DDP's default does); call guard before registering "
                "another, or drop that one") from exc
    elif fingerprint_every:
        warnings.warn("stead.numerics.guard: fingerprint_every is for DDP models (replicas to compare); this model "
                      "is not wrapped in DDP, so its parameters are not compared", stacklevel=2)
    if checker.fingerprinting:
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        if size // settings.fingerprint_every > _EVERY_STEP_WARN_BYTES:
            warnings.warn(f"stead.numerics.guard: a fingerprint every {settings.fingerprint_every} step(s) reads "
                          f"{size / 2**30:.1f} GiB of parameters each time (one pass, about a memcpy of them); "
                          "raise STEAD_NUMERICS_FINGERPRINT_EVERY if that shows in the step time", stacklevel=2)
    return checker


def _checked_allreduce(checker: Guard, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    checker.bucket(bucket.buffer())
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group


# DDP checks a hook's annotations as objects (this module's are strings: postponed)
_checked_allreduce.__annotations__ = {"checker": Guard, "bucket": torch.distributed.GradBucket,  # type: ignore[attr-defined]
                                      "return": torch.futures.Future[torch.Tensor]}
