"""torchrun's error file: where a worker decorated with torch's ``@record`` writes the exception that ended it.

torchrun gives each worker a path in ``TORCHELASTIC_ERROR_FILE``; ``torch.distributed.elastic.
multiprocessing.errors.record`` writes there, when the decorated function raises, one JSON
object: ``{"message": {"message": "ValueError: ...", "extraInfo": {"py_callstack": TRACEBACK,
"timestamp": SECONDS}}}`` (a string ``message`` in older versions). The agent gives each worker
of each round its own path and, when the worker fails, reports the file's traceback as the
failure's error text, as torchrun's "Root Cause" summary does: it is the exception that ended
the worker even when the stderr tail holds something else (a redirected stderr, log lines
written after it, a tail cut short).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from pathlib import Path

from stead.core.rpc.backend import MAX_ERROR_TAIL_CHARS

__all__ = ["ERROR_FILE_ENV", "error_file_path", "read_error_file"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: a bigger file is not read (a traceback is kilobytes; the failure report keeps MAX_ERROR_TAIL_CHARS of it)
_MAX_BYTES = 1 << 20


def error_file_path(folder: Path, round_: int, local_rank: int) -> Path:
    """A worker's error file: a fresh path for every round (an earlier round's file never speaks for this one)."""
    path = folder / f"error-round{round_}-rank{local_rank}.json"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return path


def read_error_file(path: Path) -> str:
    """The error a worker recorded in ``path``, as text for its failure report; "" when there is none or it cannot
    be read as torch writes it (the stderr tail speaks then)."""
    try:
        if os.path.getsize(path) > _MAX_BYTES:
            return ""
        data = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return ""
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return message[-MAX_ERROR_TAIL_CHARS:]
    if not isinstance(message, dict):
        return ""
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    callstack = extra.get("py_callstack")
    summary = message.get("message")
    text = callstack if isinstance(callstack, str) and callstack.strip() else summary
    if not isinstance(text, str) or not text.strip():
        return ""
    header = f"[error file {path.name}, written by torch's @record"
    with contextlib.suppress(KeyError, TypeError, ValueError, OverflowError, OSError):
        header += " at " + datetime.datetime.fromtimestamp(int(extra["timestamp"]), datetime.UTC).isoformat()
    text = f"{header}]\n{text.rstrip()}\n"
    return text[-MAX_ERROR_TAIL_CHARS:]
