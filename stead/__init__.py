"""stead: distributed PyTorch training jobs that keep going when things break.

Worker-side API (cheap to import inside a training script)::

    import stead
    stead.report_step(step)          # microseconds: no RPC, read by the node's agent
    stead.report_loss(loss)          # the loss-spike detector (off unless numerics.loss_spike says otherwise)
    with stead.phase("eval"):        # a long stretch without steps: the hang detector allows it
        evaluate(model)

Embedding the control plane: :mod:`stead.embed` (``async with stead.embed.run(spec) as job``).
Writing a plugin: :mod:`stead.plugin`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["JobPhase", "JobState", "Master", "MasterConfig", "Settings", "phase", "report_loss", "report_step"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from stead.core.config import Settings
    from stead.core.master import Master, MasterConfig
    from stead.core.statemachine import JobPhase, JobState
    from stead.core.worker.loss_spike import report_loss
    from stead.core.worker.progress import phase, report_step


def __getattr__(name: str) -> Any:
    # lazy: a training script importing stead must not pay for grpc, etcd or the master
    if name in ("report_step", "phase"):
        from stead.core.worker import progress

        return getattr(progress, name)
    if name == "report_loss":
        from stead.core.worker.loss_spike import report_loss

        return report_loss
    if name in ("Master", "MasterConfig"):
        from stead.core import master

        return getattr(master, name)
    if name in ("JobPhase", "JobState"):
        from stead.core import statemachine

        return getattr(statemachine, name)
    if name == "Settings":
        from stead.core.config import Settings

        return Settings
    raise AttributeError(f"module 'stead' has no attribute {name!r}")
