"""The agent's side of step progress: the files its workers write their steps to, and the reader of them.

The record layout and the worker's writer are :mod:`stead.core.worker.progress`.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType

from stead.core.worker.progress import FILE_BYTES, PROGRESS_ENV, RECORD_BODY, RECORD_SEQ, StepProgress

__all__ = ["ProgressFiles", "ProgressReader", "progress_prefix", "remove_earlier", "remove_left_behind"]

#: attempts at a consistent read before keeping the previous value (a writer mid-update)
_READ_ATTEMPTS = 8



def progress_prefix(job: str, node_id: str, incarnation: int) -> str:
    """The start of the name of one agent's progress directory: what :func:`remove_left_behind` finds once that
    agent was killed (a killed agent removes nothing itself)."""
    return f"stead-progress-{job}.{node_id}.{incarnation}-"


def remove_left_behind(prefix: str, *, directory: str | Path | None = None) -> list[Path]:
    """Remove the progress directories named ``prefix...`` that this user owns (in the temporary directory, or
    ``directory``); the ones removed."""
    return [path for path in Path(directory or tempfile.gettempdir()).glob(f"{prefix}*") if _remove_mine(path)]


def remove_earlier(job: str, node_id: str, incarnation: int, *, directory: str | Path | None = None) -> list[Path]:
    """Remove what the earlier incarnations of this node left on this machine (killed ones remove nothing, and
    only the last one's clean-up runs when the job ends); the ones removed."""
    head = progress_prefix(job, node_id, 0).removesuffix("0-")
    removed = []
    for path in Path(directory or tempfile.gettempdir()).glob(f"{head}*"):
        number = path.name[len(head):].partition("-")[0]
        if number.isdigit() and int(number) < incarnation and _remove_mine(path):
            removed.append(path)
    return removed


def _remove_mine(path: Path) -> bool:
    """Remove ``path``, a directory of this user's (not a link); whether it was."""
    try:
        if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
            return False
    except OSError:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


class ProgressFiles:
    """The agent's progress files, one per local rank, in a temporary directory removed on close (named
    ``prefix...``: :func:`progress_prefix` for an agent's, so that a killed agent's is found and removed)."""

    def __init__(self, local_ranks: Iterable[int], *, directory: str | Path | None = None,
                 prefix: str = "stead-progress-") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
        self.paths: dict[int, Path] = {}
        for rank in local_ranks:
            path = self.dir / f"rank{rank}"
            path.write_bytes(bytes(FILE_BYTES))
            self.paths[rank] = path

    def imported(self, local_rank: int) -> list[str]:
        """The packages that local rank's worker reported importing (empty before its first step)."""
        try:
            return Path(f"{self.paths[local_rank]}.modules").read_text().split()
        except OSError:
            return []

    def env(self, local_rank: int) -> dict[str, str]:
        """The variable to add to the worker's environment."""
        return {PROGRESS_ENV: str(self.paths[local_rank])}

    def reset(self) -> None:
        """Forget every reported step (before a new round's workers start)."""
        for path in self.paths.values():
            with open(path, "r+b") as handle:
                handle.write(bytes(FILE_BYTES))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ProgressFiles:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class ProgressReader:
    """Reads the latest step of each local rank from the shared files."""

    def __init__(self, paths: Mapping[int, str | Path]) -> None:
        self._views: dict[int, mmap.mmap] = {}
        self._last: dict[int, StepProgress] = {}
        for rank, path in paths.items():
            with open(path, "rb") as handle:
                self._views[rank] = mmap.mmap(handle.fileno(), FILE_BYTES, access=mmap.ACCESS_READ)

    def read(self) -> dict[int, StepProgress]:
        """local rank -> last reported step; ranks that have not reported yet are left out."""
        for rank, view in self._views.items():
            for _ in range(_READ_ATTEMPTS):
                before = RECORD_SEQ.unpack_from(view, 0)[0]
                step, when, pid, label, backward = RECORD_BODY.unpack_from(view, 8)
                if before & 1 == 0 and RECORD_SEQ.unpack_from(view, 0)[0] == before:
                    if before == 0:
                        self._last.pop(rank, None)
                    else:
                        self._last[rank] = StepProgress(step, when, pid,
                                                        label.rstrip(b"\0").decode(errors="replace"), backward)
                    break
        return {rank: p for rank, p in self._last.items() if p.step >= 0}

    def phase(self) -> str:
        """The long phase some local worker declared (the last read's), or ""."""
        return next((p.phase for p in self._last.values() if p.phase), "")

    def close(self) -> None:
        for view in self._views.values():
            view.close()
        self._views.clear()

    def __enter__(self) -> ProgressReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
