"""Flash checkpoints: save a state dict to the node's shared memory in the time of a memory copy.

- worker: :class:`~stead.plugins.ckpt.worker.FlashCheckpointer` (``from stead.ckpt import FlashCheckpointer``);
- agent: :class:`~stead.plugins.ckpt.agent.CheckpointAgentExtension` owns the shared memory, checksums
  and persists in the background;
- master: :class:`~stead.plugins.ckpt.plugin.CheckpointPlugin` commits a step once every rank holds it.

For tools, benchmarks and tests that look at a node from outside:

- shared memory: an agent's segments are named by :func:`segment_names` (``.prefix``, ``.all_mine()``) in
  :data:`SHM_DIR`; each rank holds :data:`SLOTS` steps, each slot's checksums verified or not
  (:class:`VerifyState`);
- checksums: :func:`checksum` (XXH3-64, what the agent computes of every tensor's bytes), :func:`sum64` (the
  checksum of manifest format 1, read only), :func:`tensor_bytes` (a CPU tensor's bytes, uncopied).

Imports are lazy: a worker importing :mod:`stead.ckpt` does not pay for grpclib or the master.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["SHM_DIR", "SLOTS", "CheckpointAgentExtension", "CheckpointPlugin", "FlashCheckpointer", "VerifyState",
           "checksum", "proto", "segment_names", "sum64", "tensor_bytes"]

if TYPE_CHECKING:
    from stead.plugins.ckpt._checksum import checksum, sum64
    from stead.plugins.ckpt._disk import tensor_bytes
    from stead.plugins.ckpt._proto.stead import v1 as proto
    from stead.plugins.ckpt._shm import SHM_DIR, SLOTS, VerifyState, segment_names
    from stead.plugins.ckpt.agent import CheckpointAgentExtension
    from stead.plugins.ckpt.plugin import CheckpointPlugin
    from stead.plugins.ckpt.worker import FlashCheckpointer

_WHERE = {
    "CheckpointAgentExtension": "stead.plugins.ckpt.agent",
    "CheckpointPlugin": "stead.plugins.ckpt.plugin",
    "FlashCheckpointer": "stead.plugins.ckpt.worker",
    "SHM_DIR": "stead.plugins.ckpt._shm",
    "SLOTS": "stead.plugins.ckpt._shm",
    "VerifyState": "stead.plugins.ckpt._shm",
    "segment_names": "stead.plugins.ckpt._shm",
    "checksum": "stead.plugins.ckpt._checksum",
    "sum64": "stead.plugins.ckpt._checksum",
    "tensor_bytes": "stead.plugins.ckpt._disk",
}


def __getattr__(name: str) -> Any:
    if name == "proto":  # the plugin's wire messages (generated from proto/stead/plugins/ckpt/v1)
        return importlib.import_module("stead.plugins.ckpt._proto.stead.v1")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stead.plugins.ckpt' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
