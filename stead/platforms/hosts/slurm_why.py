"""Why Slurm is ending the job a SIGTERM came from, and how long a warned job has left, asked of Slurm's controller.

A time limit, a preemption, an ``scancel`` and a node failure all reach a job's processes as the same SIGTERM
(after ``--signal=USR1@SECONDS``'s warning, when asked for). Only the controller knows which: ``scontrol show job
J -o``, asked at once, answers with the job's state and reason at that moment. What Slurm 22.05 says there, seen
on the test cluster (tests/support/slurm.py) from a batch script's SIGTERM handler:

- ``scancel``: ``JobState=COMPLETING Reason=None ... PreemptTime=None`` (the job ends CANCELLED; which user
  cancelled it is accounting's to say, ``sacct``, and a cluster without slurmdbd has none);
- the time limit: ``JobState=COMPLETING Reason=TimeLimit`` (it ends TIMEOUT);
- a preemption (``PreemptMode=CANCEL``): ``JobState=COMPLETING Reason=None ... PreemptTime=2026-11-27T18:37:14``
  (it ends PREEMPTED);
- a node of the job lost (without ``--no-kill``), on the job's other nodes: ``JobState=COMPLETING Reason=NodeDown``
  (it ends NODE_FAIL).

A controller asked a little later, or another Slurm version, may answer with the end state itself (``TIMEOUT``,
``PREEMPTED``, ``CANCELLED``, ``NODE_FAIL``, ``DEADLINE``): both are read. The question is bounded by
:data:`SCONTROL_TIMEOUT_S` and never fails: a controller that does not answer, an answer that does not parse, no
``scontrol`` at all, each is "cause unknown", saying what went wrong, so that a stop is never held up by Slurm.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import shutil
from collections.abc import Awaitable, Callable, Mapping

__all__ = ["SCONTROL_TIMEOUT_S", "SlurmJob", "ask_job", "parse_duration_s", "parse_job", "stop_cause",
           "warning_text"]

#: how long ``scontrol show job`` may take before the cause counts as unknown: Slurm gives a job's processes
#: KillWait (30 s by default) between its SIGTERM and its SIGKILL, and the stop must be recorded within it
SCONTROL_TIMEOUT_S = 2.0
#: the output kept of an answer that does not parse (in the "cause unknown" text)
_KEPT_CHARS = 120

Spawn = Callable[..., Awaitable[asyncio.subprocess.Process]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """What ``scontrol show job -o`` says of a job: its state and reason (``None`` for none), its preemption time
    (``None`` while not preempted), its time limit and run time in seconds (``None``: unlimited or not said)."""

    state: str
    reason: str = "None"
    preempt_time: str = "None"
    time_limit_s: int | None = None
    run_time_s: int | None = None

    @property
    def time_left_s(self) -> int | None:
        if self.time_limit_s is None or self.run_time_s is None:
            return None
        return max(0, self.time_limit_s - self.run_time_s)


_FIELD = re.compile(r"(?:^|\s)(JobState|Reason|PreemptTime|TimeLimit|RunTime)=(\S*)")
_DURATION = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_duration_s(text: str) -> int | None:
    """Slurm's ``[days-][hours:]minutes:seconds`` (``TimeLimit``, ``RunTime``) in seconds; None for ``UNLIMITED``,
    ``INVALID``, ``N/A`` or anything else."""
    found = _DURATION.match(text.strip())
    if found is None:
        return None
    days, hours, minutes, seconds = (int(part or 0) for part in found.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def parse_job(output: str) -> SlurmJob | None:
    """``scontrol show job J -o``'s answer, or None when it has no ``JobState=``."""
    fields: dict[str, str] = {}
    for key, value in _FIELD.findall(output):
        fields.setdefault(key, value)
    state = fields.get("JobState", "")
    if not re.fullmatch(r"[A-Z_]+", state):
        return None
    return SlurmJob(state=state, reason=fields.get("Reason") or "None",
                    preempt_time=fields.get("PreemptTime") or "None",
                    time_limit_s=parse_duration_s(fields.get("TimeLimit", "")),
                    run_time_s=parse_duration_s(fields.get("RunTime", "")))


#: Slurm's end states and reasons, and what each means to the user: (states, reasons, meaning, the end state)
_CAUSES: tuple[tuple[frozenset[str], frozenset[str], str, str], ...] = (
    (frozenset({"TIMEOUT"}), frozenset({"TimeLimit"}), "Slurm's time limit", "TIMEOUT"),
    (frozenset({"PREEMPTED"}), frozenset({"Preempted"}), "preempted", "PREEMPTED"),
    (frozenset({"NODE_FAIL"}), frozenset({"NodeDown", "NodeFail"}), "node failure", "NODE_FAIL"),
    (frozenset({"DEADLINE"}), frozenset({"DeadLine"}), "the job's deadline", "DEADLINE"),
)
#: states in which the job is ending (or ended) for a reason Slurm's state and reason above do not name
_ENDING = frozenset({"COMPLETING", "CANCELLED"})


def stop_cause(job: SlurmJob | None, *, trouble: str = "") -> str:
    """What ended the job, in words, from Slurm's answer (``job``); without one, "cause unknown" and ``trouble``
    (what went wrong asking)."""
    if job is None:
        return f"cause unknown: Slurm's controller did not say ({trouble or 'no answer'})"
    for states, reasons, meaning, end in _CAUSES:
        if job.state in states or job.reason in reasons:
            return f"{meaning} ({end})"
    if job.preempt_time != "None":  # 22.05 sets PreemptTime and keeps Reason=None while a preempted job completes
        return "preempted (PREEMPTED)"
    if job.state in _ENDING and job.reason == "None":  # no time limit, preemption or node failure: a cancel
        return "cancelled by scancel (CANCELLED)"
    if job.state in _ENDING:
        return f"Slurm ends the job: {job.state}, reason {job.reason}"
    return (f"cause unknown: Slurm says the job is {job.state} (reason {job.reason}), not ending: the signal came "
            "from `scancel --signal` or another program")


def warning_text(job: SlurmJob | None) -> str:
    """What a warning (``--signal=USR1@SECONDS``) announces: "Slurm warned: time limit in ~S s" when the time left
    is known, else what Slurm said."""
    if job is not None and job.time_left_s is not None:
        return f"Slurm warned: time limit in ~{job.time_left_s} s"
    if job is not None:
        return f"Slurm warned: no time limit known ({job.state}, reason {job.reason}): a preemption, or a signal sent"
    return "Slurm warned: time left unknown (Slurm's controller did not say)"


async def ask_job(job_id: str, *, scontrol: str | None = None, timeout_s: float = SCONTROL_TIMEOUT_S,
                  env: Mapping[str, str] | None = None,
                  spawn: Spawn = asyncio.create_subprocess_exec) -> tuple[SlurmJob | None, str]:
    """``scontrol show job JOB_ID -o``, at most ``timeout_s``: (the job, "") or (None, what went wrong)."""
    program = scontrol or shutil.which("scontrol")
    if program is None:
        return None, "no scontrol on PATH"
    try:
        process = await spawn(program, "show", "job", job_id, "-o", stdin=asyncio.subprocess.DEVNULL,
                              stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                              env=None if env is None else dict(env))
    except OSError as exc:
        return None, f"{program} did not start: {exc}"
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await process.communicate()
    except TimeoutError:
        return None, f"scontrol gave no answer in {timeout_s:g} s"
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(ProcessLookupError):
                await process.wait()
    said = (err or out).decode(errors="replace").strip()
    if process.returncode != 0:
        return None, f"scontrol exited {process.returncode}: {said[:_KEPT_CHARS] or 'nothing said'}"
    job = parse_job(out.decode(errors="replace"))
    if job is None:
        return None, f"scontrol's answer has no JobState: {said[:_KEPT_CHARS]!r}"
    return job, ""

