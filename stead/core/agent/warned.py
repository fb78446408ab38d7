"""What a warned agent tells its master: the warning that the job will be stopped soon, as its source said it.

Slurm's warning before a time limit (``--signal=USR1@SECONDS``) reaches every process of the job's steps as
SIGUSR1: the agent persists the newest committed step (its extensions' ``warned`` hook) and, where the CLI that
started it knows who sends the warning (inside a Slurm job, :func:`stead.cli.slurm_signals.slurm_warning_source`),
asks that source how long the job has left and reports it (``job.warned``). The agent itself knows no scheduler:
the source is handed to it. Without one (outside Slurm) the agent persists and reports nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import anyio
import structlog

from stead.core.events import MAX_WARNING_SAID_CHARS, JobWarned

__all__ = ["WarningSaid", "WarningSource", "ask_source", "warned_event"]

log = structlog.get_logger("stead.agent")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarningSaid:
    """What a warning announced: the time the job has left (None: not said), in its source's words."""

    time_left_s: int | None = None
    said: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarningSource:
    """Who sends the warning (``name``: "slurm") and how to ask it what the warning announced (``ask``: bounded by
    itself, never failing: a source that does not answer is "time left unknown", saying why)."""

    name: str
    ask: Callable[[], Awaitable[WarningSaid]]


async def ask_source(source: WarningSource, *, timeout_s: float) -> WarningSaid:
    """``source.ask()``, at most ``timeout_s`` (a backstop: it bounds itself); one that fails or does not answer
    leaves the time left unknown, saying why."""
    try:
        with anyio.fail_after(timeout_s):
            return await source.ask()
    except TimeoutError:
        why = f"no answer in {timeout_s:g} s"
    except Exception as exc:  # a faulty source must not keep the warning from the master
        why = f"asking failed: {exc!r}"
    log.warning("warning_source_failed", source=source.name, error=why)
    return WarningSaid(said=f"time left unknown: {why}")


def warned_event(source: WarningSource, said: WarningSaid, *, node_id: str, incarnation: int, round: int,
                 signal: str, warned_at: float, persisted_step: int | None = None) -> JobWarned:
    """The node's report of the warning it got at ``warned_at`` (its wall clock), as the master records it
    (``persisted_step``: the step its agent persists on it, None: none)."""
    return JobWarned(node_id=node_id, incarnation=incarnation, round=round, signal=signal, source=source.name,
                     warned_at=warned_at, time_left_s=said.time_left_s, said=said.said[:MAX_WARNING_SAID_CHARS],
                     persisted_step=persisted_step)
