"""The local platform: each node's agent is an OS process on this machine.

Registered as ``local`` in the ``stead.platforms`` entry-point group through
:data:`platform_factory`.
"""

from __future__ import annotations

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.platforms.local._platform import LocalPlatform

__all__ = ["LocalPlatform", "create", "platform_factory"]


async def create(settings: Settings, **options: object) -> LocalPlatform:
    """A LocalPlatform, not yet entered; it takes no options."""
    if options:
        raise ConfigError(f"the local platform takes no options, got {', '.join(sorted(options))}; remove them")
    return LocalPlatform(settings)


platform_factory = create
