"""RecordingPlatform: a Platform test double that runs nothing and remembers everything.

It records every launch and kill call as ``(node_id, incarnation)``, reports a
NodeStarted for each new node (unless ``auto_start=False``) and a NodeExited with
SIGKILL when a running node is killed, like the real platforms. A test drives
the rest by pushing events: ``platform.exit("n1", 1, exit_code=3)``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator
from signal import SIGKILL, SIGTERM
from types import TracebackType
from typing import Self, assert_never

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from stead.core.errors import PlatformError
from stead.core.events import NodeExited, NodePending, NodeStarted, RoomFound
from stead.core.platform import NodeSpec, PlatformEvent

__all__ = ["RecordingPlatform"]

_Key = tuple[str, int]


class RecordingPlatform:
    """Satisfies the Platform protocol without processes; see the module docstring."""

    name = "recording"

    def __init__(self, *, auto_start: bool = True, exit_on_kill: bool = True) -> None:
        self.auto_start = auto_start
        self.exit_on_kill = exit_on_kill
        #: every launch call, repeated ones included, in order
        self.launches: list[_Key] = []
        #: every kill call, unknown and finished nodes included, in order
        self.kills: list[_Key] = []
        #: the spec of each distinct node launched (the first call's)
        self.specs: dict[_Key, NodeSpec] = {}
        #: every adopt call, in order; nodes in ``gone`` are reported exited when adopted
        self.adoptions: list[_Key] = []
        self.gone: set[_Key] = set()
        self._running: set[_Key] = set()
        self._send: MemoryObjectSendStream[PlatformEvent]
        self._receive: MemoryObjectReceiveStream[PlatformEvent]
        self._send, self._receive = anyio.create_memory_object_stream[PlatformEvent](math.inf)
        self._closed = False

    @property
    def running(self) -> frozenset[_Key]:
        """Nodes that started and have not exited."""
        return frozenset(self._running)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Report every running node terminated, as the local platform does, and end ``events()``."""
        if self._closed:
            return
        for node_id, incarnation in sorted(self._running):
            self.push(NodeExited(node_id=node_id, incarnation=incarnation, signal=int(SIGTERM)))
        self._closed = True
        self._send.close()
        self._receive.close()  # readers from events() hold clones and drain what is left

    def abandon(self) -> None:
        """End ``events()`` without reporting the running nodes exited: what a crashed master leaves behind."""
        self._running.clear()
        self.close()

    async def launch(self, spec: NodeSpec) -> None:
        if self._closed:
            raise PlatformError("the recording platform is closed; launch nodes inside `async with platform:`")
        key = (spec.node_id, spec.incarnation)
        self.launches.append(key)
        if key in self.specs:
            return
        self.specs[key] = spec
        if self.auto_start:
            self.push(NodeStarted(node_id=spec.node_id, incarnation=spec.incarnation, host="recording"))

    async def kill(self, node_id: str, incarnation: int) -> None:
        key = (node_id, incarnation)
        self.kills.append(key)
        if self.exit_on_kill and key in self._running:
            self.push(NodeExited(node_id=node_id, incarnation=incarnation, signal=int(SIGKILL)))

    async def adopt(self, spec: NodeSpec, *, pid: int | None) -> bool:
        """Adopt the node (it runs from now on), unless it is in ``gone``: then report it exited."""
        key = (spec.node_id, spec.incarnation)
        self.adoptions.append(key)
        if key in self.gone:
            self.push(NodeExited(node_id=spec.node_id, incarnation=spec.incarnation))
            return False
        self._running.add(key)
        return True

    def events(self) -> AsyncGenerator[PlatformEvent, None]:
        # the clone is taken now, not at the first iteration, so that it still reads after close()
        return _iterate(self._receive.clone())

    def push(self, event: PlatformEvent) -> None:
        """Report ``event`` as if the platform had seen it; it also updates ``running``."""
        if self._closed:
            raise PlatformError("the recording platform is closed; push events before leaving `async with`")
        match event:
            case NodeStarted():
                self._running.add((event.node_id, event.incarnation))
            case NodeExited():
                self._running.discard((event.node_id, event.incarnation))
            case NodePending() | RoomFound():
                pass  # still wanted, not running; room, not a node
            case _:
                assert_never(event)
        self._send.send_nowait(event)

    def start(self, node_id: str, incarnation: int, *, pid: int | None = None) -> None:
        """Report the node started (for ``auto_start=False``)."""
        self.push(NodeStarted(node_id=node_id, incarnation=incarnation, host="recording", pid=pid))

    def exit(self, node_id: str, incarnation: int, *, exit_code: int | None = None, signal: int | None = None) -> None:
        """Report the node exited with ``exit_code`` or killed by ``signal``."""
        self.push(NodeExited(node_id=node_id, incarnation=incarnation, exit_code=exit_code, signal=signal))


async def _iterate(receive: MemoryObjectReceiveStream[PlatformEvent]) -> AsyncGenerator[PlatformEvent, None]:
    with receive:
        async for event in receive:
            yield event
