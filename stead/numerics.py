"""Numerical faults for training scripts: ``import stead.numerics``.

::

    model = DistributedDataParallel(model)
    stead.numerics.guard(model)        # a NaN/Inf gradient is caught on the rank that made it, before the step

See :mod:`stead.core.worker.numerics` for how (a sum of each gradient bucket before its all-reduce), what it
costs, and the fault injection tests and demos use (``STEAD_NUMERICS_INJECT=nan:rank=1:step=5``). Under plain
torchrun the guard works the same; the restore from the last committed checkpoint is stead's.
"""

from __future__ import annotations

from stead.core.worker.numerics import INJECT_ENV, Guard, NonFiniteGradientError, guard

__all__ = ["INJECT_ENV", "Guard", "NonFiniteGradientError", "guard"]
