"""Numerical notes from a worker to the master: one JSON line each, appended to a file beside the progress page.

A worker reaches its agent through its progress page (:mod:`.progress`) and, when it fails, its error file; a
loss spike recorded or a step skipped is neither. :func:`write` appends ``{"kind": ..., "step": ..., ...}`` and a
newline to ``<STEAD_PROGRESS_FILE>.events`` in one ``write`` (the agent never sees half a line); the agent reads
the new lines on its heartbeat tick, checks them and forwards them to the master
(:mod:`stead.core.agent.notes`), which records them as ``numerics.reported`` events. Without the variable (plain
python or torchrun) nothing is written.

Bounded at the source: a line is at most :data:`MAX_LINE_BYTES`, and a process writes at most
:data:`MAX_NOTES` of them (the rest are dropped, said once in a warning); the agent and the master bound them
again.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

from stead.core.worker.progress import PROGRESS_ENV

__all__ = ["KINDS", "MAX_LINE_BYTES", "MAX_NOTES", "NOTES_SUFFIX", "line_bytes", "notes_path", "write"]

#: the file beside a progress page that its worker's notes go to
NOTES_SUFFIX = ".events"
#: the longest line a worker writes (and the agent accepts)
MAX_LINE_BYTES = 1024
#: notes one worker process writes at most (a flood of spikes stops here first)
MAX_NOTES = 1000
#: the kinds of note there are
KINDS = ("loss_spike", "step_skipped")


class _Count:
    written = 0
    warned = False


def notes_path(progress_path: str) -> str:
    return progress_path + NOTES_SUFFIX


def line_bytes(kind: str, **fields: Any) -> int:
    """The bytes :func:`write` would write for this note (to fit one under :data:`MAX_LINE_BYTES`)."""
    return len(_line(kind, fields))


def _line(kind: str, fields: dict[str, Any]) -> bytes:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}
    round_ = os.environ.get("STEAD_ROUND", "")
    if round_.isdigit():  # the agent reports the note later, maybe once the next round began
        clean["round"] = int(round_)
    return (json.dumps({"kind": kind, **clean}, separators=(",", ":")) + "\n").encode()


def write(kind: str, **fields: float | int | str | list[Any] | None) -> bool:
    """Append one note for the agent to forward; False when not under a stead agent or past :data:`MAX_NOTES`.

    A non-finite number is written as null (JSON has none)."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return False
    if _Count.written >= MAX_NOTES:
        if not _Count.warned:
            _Count.warned = True
            warnings.warn(f"stead: this worker wrote {MAX_NOTES} numerical notes; later ones are not sent to the "
                          "master (raise numerics.loss_spike_threshold if spikes are that common)", stacklevel=2)
        return False
    line = _line(kind, fields)
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"a {kind} note of {len(line)} bytes is over {MAX_LINE_BYTES}: write shorter fields")
    try:
        fd = os.open(notes_path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        return False  # best effort, like progress: the agent removed its folder (it is stopping)
    _Count.written += 1
    return True
