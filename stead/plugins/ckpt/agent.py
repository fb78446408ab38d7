"""The agent extension of flash checkpoints (entry point ``stead.agent_extensions: ckpt``).

The checkpoint work of a node runs on an event loop thread the extension owns
(an anyio blocking portal), so that copying, checksumming and writing gigabytes
never delays the agent's heartbeats; the hooks only hand work to it. The
extension frees every shared-memory segment when the agent stops, at interpreter
exit and on SIGTERM; a relaunched agent of the same job and node removes what a
SIGKILLed predecessor left.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.from_thread import BlockingPortal, start_blocking_portal

from stead.plugin import AgentContext, AgentExtension, RoundInfo, read_token_file
from stead.plugins.ckpt._node import NodeCheckpoints
from stead.plugins.ckpt._shm import SegmentNames, segment_names, unlink_quietly
from stead.plugins.ckpt.settings import CheckpointSettings

__all__ = ["CheckpointAgentExtension"]

log = structlog.get_logger("stead.plugins.ckpt")


def job_root(settings: CheckpointSettings, job: str) -> Path:
    """``<dir>/<job>``, absolute (``ckpt.dir`` is relative to the working directory)."""
    return Path(os.path.abspath(settings.dir)) / job


class CheckpointAgentExtension(AgentExtension[CheckpointSettings]):
    name = "ckpt"
    settings_class = CheckpointSettings

    def __init__(self, *, settings: CheckpointSettings) -> None:
        super().__init__(settings=settings)
        self._node: NodeCheckpoints | None = None
        self._names: SegmentNames | None = None
        self._portal_cm: Any = None
        self._portal: BlockingPortal | None = None
        self._main: Future[None] | None = None
        self._previous_sigterm: Any = None
        self._sigterm_installed = False

    async def start(self, *, ctx: AgentContext) -> None:
        names = segment_names(ctx.job, ctx.node_id, ctx.incarnation, self.settings.shm_namespace)
        for stale in names.stale():
            unlink_quietly(stale)
            log.info("ckpt_stale_segment_removed", segment=stale)
        self._names = names
        root = job_root(self.settings, ctx.job)
        self._node = NodeCheckpoints(
            settings=ctx.settings, ckpt=self.settings, names=names, node_id=ctx.node_id, incarnation=ctx.incarnation,
            master_address=ctx.master_address, token=read_token_file(ctx.token_file), root=root,
            socket_path=ctx.workdir / "ckpt.sock", job=ctx.job)
        self._portal_cm = start_blocking_portal(name="stead-ckpt")
        portal: BlockingPortal = await anyio.to_thread.run_sync(self._portal_cm.__enter__)
        self._portal = portal
        self._main, _ = await anyio.to_thread.run_sync(portal.start_task, self._node_run)
        atexit.register(self._unlink_all)
        self._install_sigterm()

    async def _node_run(self, *, task_status: Any) -> None:
        assert self._node is not None
        await self._node.run(task_status=task_status)

    def worker_env(self, *, round: int, local_rank: int) -> dict[str, str]:
        return self._node.env(local_rank) if self._node is not None else {}

    async def before_round(self, *, round: RoundInfo) -> None:
        if self._node is not None and self._portal is not None:
            await self._portal.call_async(self._node.before_round, round)

    async def after_failure(self, *, round: int, local_rank: int, exit_code: int | None, signal: int | None) -> None:
        if self._node is not None and self._portal is not None:
            await self._portal.call_async(self._node.after_failure)

    async def warned(self, *, reason: str) -> int | None:
        """Persist on a warning of the job's stop; the step persisted (None: none)."""
        if self._node is not None and self._portal is not None:
            return await self._portal.call_async(self._node.warned, reason)
        return None

    async def stop(self, *, job_ended: bool) -> None:
        """Finish the persists in flight (up to ckpt_persist_grace_s), then free every segment."""
        try:
            if self._portal is not None and self._node is not None:
                await self._portal.call_async(self._node.shutdown)
                if self._main is not None:
                    main = self._main
                    await anyio.to_thread.run_sync(main.result)
            if self._portal_cm is not None:
                cm = self._portal_cm
                await anyio.to_thread.run_sync(lambda: cm.__exit__(None, None, None))
        finally:
            self._portal = self._portal_cm = self._main = None
            self._unlink_all()
            atexit.unregister(self._unlink_all)
            self._restore_sigterm()

    async def cleanup(self, *, job: str, node_id: str, incarnation: int) -> None:
        """Free the segments an agent of this node incarnation left when it was killed (no successor did)."""
        for name in segment_names(job, node_id, incarnation, self.settings.shm_namespace).all_mine():
            unlink_quietly(name)

    # -- freeing memory on the way out ------------------------------------------------------------------

    def _unlink_all(self) -> None:
        if self._names is not None:
            for name in self._names.all_mine():
                unlink_quietly(name)

    def _install_sigterm(self) -> None:
        """Free the segments when SIGTERM ends the agent with the default action (no handler of its own)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous not in (signal.SIG_DFL, None):
            return  # the agent handles SIGTERM itself and exits through stop()
        self._previous_sigterm = previous
        unlink: Callable[[], None] = self._unlink_all

        def on_sigterm(signum: int, frame: object) -> None:
            unlink()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGTERM, self._previous_sigterm or signal.SIG_DFL)
            self._sigterm_installed = False
