"""The built-in recovery policy: what a worker failure leads to when no plugin decides.

A job never waits on a missing, slow or disabled diagnosis plugin: the job
machine applies :func:`default_decision` when no decider is running or none
answered within the job's ``decision_timeout_s``. The rule is deliberately
simple (the diagnosis plugin refines it with history and more evidence):

* the last exception in the worker's stderr is one a restart reproduces (the
  program does not compile or import, a name is undefined, stead's own APIs
  refused the call as misused or misconfigured): fail fast;
* anything else (a signal, a collective's connection reset, an unknown exit):
  restart the workers; the job machine turns a restart beyond the budget into
  a failure.

Pure functions only: no IO, no clock.
"""

from __future__ import annotations

import re
import signal

from stead.core.events import RecoveryAction, RecoveryDecided, WorkerFailed

__all__ = ["DEFAULT_DECIDER", "DETERMINISTIC", "classify", "default_decision", "last_exception", "last_traceback",
           "signal_name"]

#: the ``decided_by`` of a decision taken by this policy
DEFAULT_DECIDER = "default"
#: errors that a restart reproduces: the program is wrong, not the world (the last four are stead's own APIs
#: refusing a call: bad arguments, bad configuration, a checkpoint that does not fit the model)
DETERMINISTIC = frozenset({"SyntaxError", "IndentationError", "TabError", "NameError", "ImportError",
                           "ModuleNotFoundError", "UnboundLocalError", "InvalidRequest", "ConfigError",
                           "StateMismatch", "UnsupportedState"})
#: torch prefixes a worker's stderr lines with its rank ("[rank3]: NameError: ..."); only the prefix and its one
#: space go: a traceback's frames keep their indentation (its end, the exception's line, is the first without)
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d*\]: ?")
_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::\s*(?P<msg>.*))?$")
#: the line that ends a Python traceback: the exception's (dotted) class name, then its message
_TRACEBACK_END = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?::\s*(?P<msg>.*))?$")
_TRACEBACK_START = "Traceback (most recent call last):"


def _lines(error_tail: str) -> tuple[list[str], int | None]:
    """A stderr tail's lines without torch's rank prefix, and where its last traceback starts (None: none)."""
    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in error_tail.strip().splitlines()]
    starts = [i for i, line in enumerate(lines) if line.strip() == _TRACEBACK_START]
    return lines, (starts[-1] if starts else None)


def last_traceback(error_tail: str) -> str:
    """The last traceback of a stderr tail, without torch's rank prefixes ("" when there is none)."""
    lines, start = _lines(error_tail)
    return "\n".join(lines[start:]) if start is not None else ""


def last_exception(error_tail: str) -> tuple[str, str] | None:
    """(exception type, message) of the last traceback in a stderr tail, if any."""
    lines, start = _lines(error_tail)
    if start is not None:  # the first unindented line after the last traceback's frames names the exception
        for line in lines[start + 1:]:
            if not line or line[0].isspace():
                continue
            match = _TRACEBACK_END.match(line)
            if match:
                return match["type"].rsplit(".", 1)[-1], (match["msg"] or "").strip()
            break
    for line in reversed(lines):  # no traceback (a cut tail, a custom handler): the last error-looking line
        match = _EXC_LINE.match(line.strip())
        if match:
            return match["type"].rsplit(".", 1)[-1], (match["msg"] or "").strip()
    return None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def classify(failure: WorkerFailed) -> tuple[RecoveryAction, str]:
    """A decision from one failure alone (without history), and why."""
    exc = last_exception(failure.error_tail)
    if exc is not None and exc[0] in DETERMINISTIC:
        return RecoveryAction.FAIL, f"{exc[0]} in rank {failure.rank}: a restart would hit it again"
    if failure.signal is not None:
        return RecoveryAction.RESTART, f"rank {failure.rank} killed by {signal_name(failure.signal)}"
    if exc is not None:
        return RecoveryAction.RESTART, f"rank {failure.rank} raised {exc[0]}"
    return RecoveryAction.RESTART, f"rank {failure.rank} exited with code {failure.exit_code}"


def default_decision(failure: WorkerFailed, *, why: str) -> RecoveryDecided:
    """The default policy's decision on ``failure``; ``why`` says why no plugin decided."""
    action, reason = classify(failure)
    return RecoveryDecided(round=failure.round, action=action, reason=f"{reason} (default policy: {why})",
                           message=failure.error_tail, node_id=failure.node_id, rank=failure.rank,
                           decided_by=DEFAULT_DECIDER)
