"""The settings of ``stead.numerics`` (``--set numerics.<name>=value`` or ``STEAD_NUMERICS_<NAME>``), without torch.

The workers read them (the guard, the loss-spike detector); the master reads ``on_nan`` and ``nan_budget`` (the
diagnosis decides what a numerical fault leads to), and ``stead run`` checks every ``--set numerics.*`` against
them before anything starts. Kept apart from :mod:`stead.core.worker.numerics` so that neither the master nor the
CLI imports torch for them.
"""

from __future__ import annotations

import dataclasses

from stead.core.config import setting
from stead.core.errors import ConfigError
from stead.core.events import RestoreBound

__all__ = ["LOSS_SPIKE_MODES", "NAMESPACE", "ON_NAN_MODES", "RESTORE_BOUNDS_ENV", "SKIP_STEPS_ENV", "NumericsSettings",
           "restore_bounds", "restore_bounds_env", "skip_steps_env"]

#: the settings' namespace: ``--set numerics.on_nan=fail``
NAMESPACE = "numerics"
#: what a NaN or Inf gradient leads to (see :class:`NumericsSettings`)
ON_NAN_MODES = ("skip", "restore", "fail")
#: what a loss spike leads to
LOSS_SPIKE_MODES = ("off", "record", "skip")
#: the steps every rank of a round skips (their batches dropped), comma-separated: set by the agent from the
#: master's decisions, never by hand (a test may, to make a reference run skip the same steps)
SKIP_STEPS_ENV = "STEAD_NUMERICS_SKIP_STEPS"
#: what a restore may take after replica mismatches, ``STEP@ROUND`` comma-separated (no copy of a step after STEP
#: saved in ROUND or before is restored): set by the agent from the master's decisions, never by hand
RESTORE_BOUNDS_ENV = "STEAD_CKPT_RESTORE_BOUNDS"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NumericsSettings:
    """``STEAD_NUMERICS_<NAME>`` in the workers' environment (``--set numerics.<name>`` puts it there), or guard()'s
    keyword arguments."""

    fingerprint_every: int = setting(100, min=0, help="every how many optimizer steps DDP replicas compare their "
                                                      "parameters' fingerprints (0: never)")
    fingerprint_optimizer: bool = setting(False, help="the fingerprint covers the optimizer's state too")
    on_nan: str = setting("skip", help="what a NaN or Inf gradient leads to: skip (roll back to the last committed "
                                       "checkpoint and skip the step's batch on every rank), restore (roll back "
                                       "and train the step again; the same fault at the same step again fails "
                                       "the job) or fail (the job fails at once)")
    nan_budget: int = setting(5, min=0, help="how many numerical faults (NaN/Inf gradients, loss spikes skipped) "
                                             "the job rolls back from; the next one fails it")
    loss_spike: str = setting("off", help="what a loss reported with stead.report_loss that spikes leads to: off "
                                          "(no detector), record (a numerics.loss_spike event) or skip (roll "
                                          "back and skip the step's batch, as on_nan=skip)")
    loss_spike_threshold: float = setting(6.0, min=1.0, help="a loss is a spike when it exceeds the median of "
                                                             "the recent losses by this many robust standard "
                                                             "deviations (1.4826 x their median absolute "
                                                             "deviation)")
    loss_spike_window: int = setting(100, min=4, help="how many recent losses (one per optimizer step) the "
                                                      "median and deviation are taken over")
    loss_spike_warmup: int = setting(20, min=4, help="losses seen before the detector judges one (the first "
                                                     "steps' losses fall fast and would all look like outliers)")

    def __post_init__(self) -> None:
        if self.on_nan not in ON_NAN_MODES:
            raise ConfigError(f"setting numerics.on_nan={self.on_nan!r} is not a mode: use one of "
                              f"{', '.join(ON_NAN_MODES)} (--set numerics.on_nan=restore)")
        if self.loss_spike not in LOSS_SPIKE_MODES:
            raise ConfigError(f"setting numerics.loss_spike={self.loss_spike!r} is not a mode: use one of "
                              f"{', '.join(LOSS_SPIKE_MODES)} (--set numerics.loss_spike=record)")
        if self.loss_spike_warmup > self.loss_spike_window:
            raise ConfigError(f"setting numerics.loss_spike_warmup={self.loss_spike_warmup} is larger than "
                              f"numerics.loss_spike_window={self.loss_spike_window}: the detector keeps only the "
                              "window's losses; lower the warm-up or widen the window")


def skip_steps_env(steps: frozenset[int] | tuple[int, ...]) -> dict[str, str]:
    """The variable that tells a round's workers the steps to skip; nothing when there are none."""
    return {SKIP_STEPS_ENV: ",".join(map(str, sorted(steps)))} if steps else {}


def restore_bounds_env(bounds: tuple[RestoreBound, ...]) -> dict[str, str]:
    """The variable that tells a round's workers the restore bounds; nothing when there are none."""
    return {RESTORE_BOUNDS_ENV: ",".join(f"{b.step}@{b.round}" for b in bounds)} if bounds else {}


def restore_bounds(text: str) -> tuple[RestoreBound, ...]:
    """The bounds :data:`RESTORE_BOUNDS_ENV` holds; ValueError saying what is wrong with a bad value."""
    bounds = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        step, at, round_ = part.partition("@")
        try:
            bound = RestoreBound(step=int(step), round=int(round_))
        except ValueError:
            bound = None
        if not at or bound is None or bound.step < -1 or bound.round < 0:
            raise ValueError(f"{RESTORE_BOUNDS_ENV}={text[:200]!r} holds {part[:40]!r}, not STEP@ROUND (a step of -1 "
                             "or more, a round of 0 or more); the agent sets it from the master's decisions: unset it")
        bounds.append(bound)
    return tuple(bounds)
