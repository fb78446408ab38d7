"""Numerical faults for training scripts: ``import stead.numerics``.

::

    model = DistributedDataParallel(model)
    stead.numerics.guard(model)        # a NaN/Inf gradient caught on its rank before the step; replicas compared
    stead.numerics.report_loss(loss)   # a loss spike caught (numerics.loss_spike=record or skip; off by default)

See :mod:`stead.core.worker.numerics` for how (a sum of each gradient bucket before its all-reduce; every
``STEAD_NUMERICS_FINGERPRINT_EVERY`` steps, one all-gather of the replicas' parameter fingerprints), what it
costs, and the fault injection tests and demos use (``STEAD_NUMERICS_INJECT=nan:rank=1:step=5``, ``bitflip``,
``noise``). Under plain torchrun the guard works the same; the restore from the last committed checkpoint is
stead's.
"""

from __future__ import annotations

from stead.core.worker.loss_spike import LossSpikeError, report_loss
from stead.core.worker.numerics import (
    INJECT_ENV,
    Guard,
    NonFiniteGradientError,
    NumericsSettings,
    ReplicaMismatchError,
    guard,
)

__all__ = ["INJECT_ENV", "Guard", "LossSpikeError", "NonFiniteGradientError", "NumericsSettings",
           "ReplicaMismatchError", "guard", "report_loss"]
