"""Flash checkpoints: save a state dict to the node's shared memory in the time of a memory copy.

- worker: :class:`~stead.plugins.ckpt.worker.FlashCheckpointer` (``from stead.ckpt import FlashCheckpointer``);
- agent: :class:`~stead.plugins.ckpt.agent.CheckpointAgentExtension` owns the shared memory, checksums
  and persists in the background;
- master: :class:`~stead.plugins.ckpt.plugin.CheckpointPlugin` commits a step once every rank holds it.

Imports are lazy: a worker importing :mod:`stead.ckpt` does not pay for grpclib or the master.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CheckpointAgentExtension", "CheckpointPlugin", "FlashCheckpointer"]

if TYPE_CHECKING:
    from stead.plugins.ckpt.agent import CheckpointAgentExtension
    from stead.plugins.ckpt.plugin import CheckpointPlugin
    from stead.plugins.ckpt.worker import FlashCheckpointer


def __getattr__(name: str) -> Any:
    if name == "CheckpointPlugin":
        from stead.plugins.ckpt.plugin import CheckpointPlugin

        return CheckpointPlugin
    if name == "CheckpointAgentExtension":
        from stead.plugins.ckpt.agent import CheckpointAgentExtension

        return CheckpointAgentExtension
    if name == "FlashCheckpointer":
        from stead.plugins.ckpt.worker import FlashCheckpointer

        return FlashCheckpointer
    raise AttributeError(f"module 'stead.plugins.ckpt' has no attribute {name!r}")
