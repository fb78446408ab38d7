"""Background tasks with an owner: one asyncio task group a component enters and exits.

A component (the reactor, the master's supervisor) starts its tasks here; leaving
the block cancels them and waits for them; a task that fails makes the owner's
``async with`` raise (the task group cancels the task that entered it). asyncio's
task group, not anyio's, because an embedding program may leave the component
from inside a cancel scope of its own (anyio requires scopes to close in order).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["TaskOwner"]


class TaskOwner:
    def __init__(self) -> None:
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def running(self) -> bool:
        return self._group is not None

    async def __aenter__(self) -> TaskOwner:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        group, self._group = self._group, None
        assert group is not None
        for task in self._tasks:
            task.cancel()
        await group.__aexit__(*exc)

    def start(self, run: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str) -> None:
        assert self._group is not None, "start tasks inside `async with`"
        task: asyncio.Task[Any] = self._group.create_task(run(*args), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
