"""The flash checkpoint's errors: each says what was wrong and what to do."""

from __future__ import annotations

from stead.plugin import PermanentError

__all__ = ["CheckpointError", "SharedMemoryTooSmall", "StateMismatch", "UnsupportedState"]


class CheckpointError(PermanentError):
    """A flash checkpoint could not be saved, restored or persisted."""


class UnsupportedState(CheckpointError):
    """A state dict holds a value that a flash checkpoint cannot store safely (no pickle)."""


class StateMismatch(CheckpointError):
    """The state dict passed to load() does not fit the checkpoint (another model, shape or sharding)."""


class SharedMemoryTooSmall(CheckpointError):
    """/dev/shm cannot hold the checkpoint's two slots."""
