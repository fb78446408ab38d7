"""What a NaN gradient or a loss spike leads to, as ``numerics.on_nan``, ``numerics.loss_spike`` and
``numerics.nan_budget`` say. Pure: the plugin gives it the failure's classification and the job's history.

* ``on_nan=fail``: a non-finite gradient fails the job at once.
* past ``nan_budget`` numerical faults (NaN/Inf gradients, loss spikes; this one included) the job fails, the
  decision naming the count and the setting to raise.
* ``on_nan=skip`` (a NaN) or a :class:`LossSpikeError` (raised only under ``loss_spike=skip``): restart from the
  last committed checkpoint with the fault's step skipped on every rank (the decision's ``skip_steps``). A skipped
  step is no repeated failure: it cannot fail again at that step. A step that was skipped already and faults
  again (the script's steps do not line up with stead's) takes the usual path, where a repeat fails the job.
* ``on_nan=restore``: the usual path (restart; the same fault at the same step again is a repeated failure).
"""

from __future__ import annotations

import dataclasses
import re

from stead.plugin import NumericsSettings
from stead.plugins.diagnosis.rules import Action, Classification, FailureClass

__all__ = ["NumericalVerdict", "SKIPPING_RULES", "decide_numerical", "fault_step"]

#: the rules of the numerical faults this module decides
SKIPPING_RULES = ("non-finite-gradient", "loss-spike")
#: the step a stead.numerics error names
_STEP = re.compile(r"\bat step (\d+)\b")


@dataclasses.dataclass(frozen=True)
class NumericalVerdict:
    #: the decision's classification; None: the usual path decides (restore)
    found: Classification | None = None
    #: the steps the restarted round skips
    skip_steps: tuple[int, ...] = ()


def fault_step(evidence: str) -> int | None:
    """The step a NonFiniteGradientError or LossSpikeError names ("... at step 4: ..."), None when it names none."""
    match = _STEP.search(evidence)
    return int(match[1]) if match else None


def decide_numerical(found: Classification, *, settings: NumericsSettings, faults: int,
                     skipped: frozenset[int]) -> NumericalVerdict:
    """The verdict on a numerical fault classified ``found``; ``faults``: the job's numerical faults so far, this one
    included; ``skipped``: the steps the job skips already."""
    if found.rule not in SKIPPING_RULES:
        return NumericalVerdict()
    nan = found.rule == "non-finite-gradient"
    if nan and settings.on_nan == "fail":
        return NumericalVerdict(Classification(
            FailureClass.NUMERICAL, Action.FAIL, found.rule,
            f"{found.evidence}; numerics.on_nan=fail: the job fails at once (numerics.on_nan=skip rolls back and "
            "skips the step's batch, restore rolls back and trains it again)"))
    if faults > settings.nan_budget:
        return NumericalVerdict(Classification(
            FailureClass.NUMERICAL, Action.FAIL, "nan-budget",
            f"numerical fault {faults} of the job (NaN/Inf gradients and loss spikes), over numerics.nan_budget="
            f"{settings.nan_budget}: the job fails. Raise it (--set numerics.nan_budget=N) if such faults are rare "
            f"for a job this long; faults this frequent usually come from the learning rate, the loss scale or the "
            f"data. The last one: {found.evidence}"))
    step = fault_step(found.evidence)
    if (nan and settings.on_nan != "skip") or step is None or step in skipped:
        return NumericalVerdict()
    setting = "numerics.on_nan=skip" if nan else "numerics.loss_spike=skip"
    return NumericalVerdict(Classification(
        FailureClass.NUMERICAL, Action.RESTART, found.rule,
        f"{found.evidence}; step {step}'s batch is skipped on every rank after the rollback ({setting}; fault "
        f"{faults} of numerics.nan_budget={settings.nan_budget})"), (step,))
