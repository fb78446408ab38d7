"""What makes two failures the same, and the failures decided so far: the history behind ``[repeats]``. Pure."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

from stead.plugin import WorkerFailed, last_exception, last_traceback

__all__ = ["Seen", "signature", "traceback_signature"]


def signature(failure: WorkerFailed) -> str | None:
    """What makes two failures the same: the exception and its message, and the step or, when no step is known,
    the traceback (its frames, addresses left out); None without an exception to compare."""
    exc = last_exception(failure.error_tail)
    if exc is None:
        return None
    if failure.step is not None:
        return f"{exc[0]}: {exc[1]} @ step {failure.step}"
    return traceback_signature(failure)


def traceback_signature(failure: WorkerFailed) -> str | None:
    """The exception, its message and its traceback's frames (addresses left out), whatever the step."""
    exc = last_exception(failure.error_tail)
    if exc is None:
        return None
    frames = re.sub(r"0x[0-9a-fA-F]+", "0x", last_traceback(failure.error_tail))
    return f"{exc[0]}: {exc[1]} @ traceback {hashlib.sha256(frames.encode()).hexdigest()[:16]}"


@dataclasses.dataclass
class Seen:
    """The failures decided so far, by signature: each occurrence's (round, rank, step)."""

    occurrences: dict[str, list[tuple[int, int, int | None]]] = dataclasses.field(default_factory=dict)
    last: str = ""
    #: the last recorded failure's traceback signature (a failure with no step known that has it is that one again)
    last_traceback: str = ""
    #: the steps at which each host's workers produced a non-finite gradient
    nan_hosts: dict[str, list[int | None]] = dataclasses.field(default_factory=dict)
    #: numerical faults (NaN/Inf gradients, loss spikes) the job rolled back from or failed on, for numerics.nan_budget
    numerical_faults: int = 0

    def nan_on(self, host: str, step: int | None) -> list[int | None]:
        """Record a non-finite gradient on ``host`` at ``step``; the steps of the earlier ones there at other steps
        (the same NaN again at the same step comes from the data, not the host)."""
        seen = self.nan_hosts.setdefault(host, [])
        earlier = [s for s in seen if s != step]
        if step not in seen:
            seen.append(step)
        return earlier

    def same_as_last(self, failure: WorkerFailed) -> str | None:
        """The last failure's signature when ``failure``, with no step known (it failed before its round finished
        a step: right after a restore), has its exception, message and traceback: the same failure again."""
        if failure.step is not None or not self.last or not self.last_traceback:
            return None
        return self.last if traceback_signature(failure) == self.last_traceback else None

    def record(self, signature: str, failure: WorkerFailed, *, in_a_row: bool) -> list[tuple[int, int, int | None]]:
        """Add ``failure``'s occurrence; with ``in_a_row``, earlier ones count only if the previous decision's
        failure had this signature too."""
        if in_a_row and self.last != signature:
            self.occurrences.pop(signature, None)
        seen = self.occurrences.setdefault(signature, [])
        if not any(r == failure.round for r, _, _ in seen):  # a round's failure is decided once
            seen.append((failure.round, failure.rank, failure.step))
        self.last = signature
        self.last_traceback = traceback_signature(failure) or ""
        return seen

    def to_json(self) -> bytes:
        return json.dumps({"occurrences": self.occurrences, "last": self.last,
                           "last_traceback": self.last_traceback, "nan_hosts": self.nan_hosts,
                           "numerical_faults": self.numerical_faults}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Seen:
        data = json.loads(raw)
        if isinstance(data, list):  # an earlier master's: the signatures seen once each, nothing more known
            return cls({str(sig): [(0, -1, None)] for sig in data})
        return cls({str(sig): [(int(r), int(k), None if s is None else int(s)) for r, k, s in seen]
                    for sig, seen in data.get("occurrences", {}).items()}, str(data.get("last", "")),
                   str(data.get("last_traceback", "")),
                   {str(h): [None if s is None else int(s) for s in steps]
                    for h, steps in data.get("nan_hosts", {}).items()}, int(data.get("numerical_faults", 0)))
