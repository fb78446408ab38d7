"""How long a node whose ranks cannot restore from memory waits for the step they will read from disk.

A node new to the round (a resize, a relaunched node without a peer's replica) reads the step to restore from disk,
so its workers must not start before the nodes that hold it in memory have written it; but a lost node never
writes its part, and a replicated state needs only some copies, so the wait ends as soon as waiting longer cannot
help (:func:`until_on_disk`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import structlog

from stead.plugins.ckpt import _disk

__all__ = ["until_on_disk"]

log = structlog.get_logger("stead.plugins.ckpt")

#: how often an agent looks whether a step it waits for is on disk yet
DISK_POLL_S = 0.02
#: once its own parts are written, how long (at least) an agent waits for more parts of a step that stays incomplete
DISK_SETTLE_S = 0.2
#: how often an agent waiting for a step on disk asks the master whether every part of it is written somewhere
ASK_PERSISTED_S = 0.5
#: how long a step the master says is written in full may stay unseen before it counts as on a disk not shared here
UNSEEN_GRACE_S = 5.0
#: how long nothing of the step (nor of a newer one) may appear on disk, this node's own persists done, before no
#: other node is taken to be writing it (every node that held it is gone, or stopped before it wrote its part)
UNWRITTEN_GRACE_S = 15.0


async def until_on_disk(root: Path, step: int, *, grace_s: float, mine_done: Callable[[], bool],
                        persisted_elsewhere: Callable[[int], Awaitable[bool]]) -> None:
    """Wait until every rank's part of ``step`` (or of a newer step some rank writes) is on disk in ``root`` or,
    once this node's own parts are (``mine_done()``), until no new part came for as long as the first one took
    (``DISK_SETTLE_S`` at least): a lost node never writes its part, and a replicated state needs only some copies.
    ``grace_s`` (``ckpt.persist_grace_s``) at most. A step the master says every rank wrote
    (``persisted_elsewhere(step)``) that this node does not see within ``UNSEEN_GRACE_S`` is on a disk it does not
    share (a volume of each node's own): nothing more is waited for. When no part of it at all appeared for
    ``UNWRITTEN_GRACE_S``, no node is writing it (every node that held it is gone: a job submitted again after its
    nodes were stopped before they wrote the newest commit): nothing more is waited for either."""
    waited, seen, quiet, first_after, asked = 0.0, 0, 0.0, None, 0.0
    persisted_at: float | None = None  # when (in ``waited``) the master first said every part is written
    while True:
        # a newer step being written is the one to wait for: this agent's hint may be a commit behind the
        # others' (their workers saved once more before they stopped), and the workers restore the newest
        newest = max([step, *await anyio.to_thread.run_sync(functools.partial(
            _disk.candidates, root, -1, any_rank=True))])
        if newest != step:
            step, seen, quiet = newest, 0, 0.0
        complete, ranks = await anyio.to_thread.run_sync(_disk.progress, root, step)
        if complete:
            return
        written = len(ranks)
        if written and first_after is None:
            first_after = waited
        done = mine_done()
        quiet = quiet + DISK_POLL_S if written == seen and done else 0.0
        seen = written
        settled = first_after is not None and quiet >= max(DISK_SETTLE_S, first_after)
        if waited >= grace_s or settled:
            log.info("ckpt_partly_on_disk", step=step, ranks_written=written, waited_s=round(waited, 2),
                     effect="the workers restore it if it is replicated, else an older step")
            return
        if waited == 0.0:
            log.info("ckpt_waiting_for_disk", step=step, reason="the round's ranks differ from the ones that "
                     "hold it in memory (a resize or a new node): the workers read it from disk")
        if persisted_at is None and waited >= asked:
            asked = waited + ASK_PERSISTED_S
            if await persisted_elsewhere(step):
                persisted_at = waited
        elif persisted_at is None and first_after is None and done and waited >= UNWRITTEN_GRACE_S:
            log.info("ckpt_step_not_being_written", step=step, waited_s=round(waited, 2),
                     effect="no node is writing it; the ranks restore the newest step every one of them can take")
            return
        elif persisted_at is not None and not written and waited - persisted_at >= UNSEEN_GRACE_S:
            log.warning("ckpt_disk_not_shared", step=step, root=str(root), waited_s=round(waited, 2),
                        effect="this node's workers cannot read the step the others wrote; the ranks restore "
                               "the newest step every one of them can take",
                        hint="give every node the same ckpt.dir (a shared volume) to restore across nodes")
            return
        await anyio.sleep(DISK_POLL_S)
        waited += DISK_POLL_S

