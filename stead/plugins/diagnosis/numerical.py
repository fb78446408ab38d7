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

A replica mismatch (rules ``replica-mismatch``, ``replica-mismatch-unattributed``) bounds the restore
(:func:`restore_bound`): with fingerprints every N steps, a corruption on one rank at step A+1 reaches every replica
through the all-reduce before the mismatch is seen at A+N, so the last committed step may hold it. The round
restores the newest checkpoint at or before A, the last step whose fingerprints agreed, from whichever tier holds
one, and the script's initial state when none does. Why not fail then: every step after A is suspect and the
initial state is the only state left that is known good; failing would hand a person the same choice later, with
nothing gained. The bound is read from the error's message, which stead's guard writes and which travels with the
failure, so it is there when the decision is made (a worker's note may come after it).
"""

from __future__ import annotations

import dataclasses
import re

from stead.plugin import NumericsSettings
from stead.plugins.diagnosis.rules import Action, Classification, FailureClass

__all__ = ["MISMATCH_RULES", "NumericalVerdict", "SKIPPING_RULES", "bound_reason", "decide_numerical", "fault_step",
           "restore_bound"]

#: the rules of the numerical faults this module decides
SKIPPING_RULES = ("non-finite-gradient", "loss-spike")
#: the step a stead.numerics error names
_STEP = re.compile(r"\bat step (\d+)\b")
#: the rules of a replica mismatch, whose decision bounds the restore
MISMATCH_RULES = ("replica-mismatch", "replica-mismatch-unattributed")
#: the last step a ReplicaMismatchError says the replicas agreed at (-1: the script's initial state)
_AGREED = re.compile(r"\bfingerprints last agreed at step (-?\d+)\b")


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


def restore_bound(found: Classification) -> int | None:
    """The newest step the round after a replica mismatch may restore: the last step whose fingerprints agreed, as
    the ReplicaMismatchError says (-1: the script's initial state); None for another fault, or an error naming no
    such step (then the usual restore, the last committed step)."""
    if found.rule not in MISMATCH_RULES:
        return None
    match = _AGREED.search(found.evidence)
    return int(match[1]) if match else None


def bound_reason(step: int) -> str:
    """What a decision bounded to ``step`` says about the restore."""
    if step < 0:
        return ("the replicas agreed on no step since the script's initial state, and every later step may hold the "
                "corruption: the round starts from the initial state, no checkpoint is restored")
    return (f"the restore is bounded to step {step}, the last whose replicas' fingerprints agreed (a later step may "
            f"hold the corruption, spread by the all-reduce): the newest checkpoint at or before step {step}, from "
            "memory, a peer's replica or disk; none left there: the round starts from the script's initial state "
            "(persist a step at least every numerics.fingerprint_every steps, and keep ckpt.keep_last of them, to "
            "keep one)")
