"""What `stead run` makes of Slurm's signals inside a Slurm job: why a SIGTERM came, what a warning announced.

Slurm's time limit, a preemption, an ``scancel`` and a node failure all arrive as SIGTERM; the job's master asks
Slurm's controller which one it is (:mod:`stead.platforms.hosts.slurm_why`, bounded, never failing) and records it
with the stop. The warning a job asks for with ``--signal=USR1@SECONDS`` reaches every host step's `stead run`,
which logs how long Slurm says the job has left (``slurm_warned``) while its agent persists the newest checkpoint
and reports the warning to the job's master (:func:`slurm_warning_source`: the agent asks Slurm the same), which
records it as a ``job.warned`` event per node (`stead status` shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Mapping

import structlog

from stead.core.agent.warned import WarningSaid, WarningSource

__all__ = ["SLURM_JOB_ENV", "slurm_stop_cause", "slurm_warning_source", "slurm_warnings"]

log = structlog.get_logger("stead.slurm")

#: set in every process of a Slurm job (batch script, salloc shell, srun step): the job Slurm is asked about
SLURM_JOB_ENV = "SLURM_JOB_ID"


async def slurm_stop_cause(env: Mapping[str, str], signum: int) -> str | None:
    """Why Slurm sent ``signum`` (SIGTERM) to this job, in words; None outside a Slurm job or for another signal."""
    job_id = env.get(SLURM_JOB_ENV, "").strip()
    if signum != signal.SIGTERM or not job_id:
        return None
    from stead.platforms.hosts.slurm_why import ask_job, stop_cause  # only a Slurm job's stop needs it

    job, trouble = await ask_job(job_id)
    cause = stop_cause(job, trouble=trouble)
    log.info("slurm_stop_cause", job_id=job_id, cause=cause, slurm_state=job.state if job else None,
             slurm_reason=job.reason if job else None)
    return cause


def slurm_warning_source(env: Mapping[str, str]) -> WarningSource | None:
    """Inside a Slurm job: Slurm, as the agent's source of the SIGUSR1 warning, asked how long the job has left
    (``scontrol show job``, bounded, never failing); None outside one (the agent reports no warning)."""
    job_id = env.get(SLURM_JOB_ENV, "").strip()
    if not job_id:
        return None

    async def ask() -> WarningSaid:
        from stead.platforms.hosts.slurm_why import ask_job, warning_text

        job, trouble = await ask_job(job_id)
        said = warning_text(job) + (f" ({trouble})" if trouble else "")
        return WarningSaid(time_left_s=job.time_left_s if job else None, said=said)

    return WarningSource(name="slurm", ask=ask)


@contextlib.asynccontextmanager
async def slurm_warnings(env: Mapping[str, str]) -> AsyncIterator[None]:
    """Inside a Slurm job: each SIGUSR1 (Slurm's warning) is answered with a ``slurm_warned`` log line saying how
    long Slurm gives the job; elsewhere SIGUSR1 stays ignored, as `stead` sets it."""
    job_id = env.get(SLURM_JOB_ENV, "").strip()
    if not job_id:
        yield
        return
    from stead.platforms.hosts.slurm_why import ask_job, warning_text

    loop = asyncio.get_running_loop()
    warned = asyncio.Event()

    async def answer() -> None:
        while True:
            await warned.wait()
            warned.clear()
            job, trouble = await ask_job(job_id)
            log.warning("slurm_warned", job_id=job_id, said=warning_text(job),
                        time_left_s=job.time_left_s if job else None, trouble=trouble or None)

    loop.add_signal_handler(signal.SIGUSR1, warned.set)
    try:
        async with asyncio.TaskGroup() as tasks:
            answering = tasks.create_task(answer())
            try:
                yield
            finally:
                answering.cancel()
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as before: the warning must not end this process
