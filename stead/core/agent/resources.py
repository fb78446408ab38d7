"""What a node's workers use: resident memory and CPU, sampled with psutil for the heartbeat.

The figures cover each worker process and its children (DataLoader workers). A
figure that cannot be read is absent (None), never a made-up zero: a heartbeat
without it says "unknown".
"""

from __future__ import annotations

from collections.abc import Iterable

import psutil

__all__ = ["WorkerResources"]


class WorkerResources:
    """Samples the worker processes; CPU is measured between two consecutive samples."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pids: Iterable[int]) -> tuple[int | None, float | None]:
        """(RSS bytes, CPU percent of one core) of ``pids`` and their children; (None, None) when none answered."""
        seen: dict[int, psutil.Process] = {}
        for pid in pids:
            root = self._proc(pid)
            if root is None:
                continue
            seen[pid] = root
            try:
                for child in root.children(recursive=True):
                    seen[child.pid] = self._procs.get(child.pid, child)
            except psutil.Error:
                continue
        rss, cpu, measured, timed = 0, 0.0, 0, 0
        for pid, proc in list(seen.items()):
            try:
                with proc.oneshot():
                    rss += proc.memory_info().rss
                    cpu += proc.cpu_percent(interval=None)  # since this object's previous call (0.0 the first time)
                measured += 1
                timed += pid in self._procs  # measured before: its figure covers a real interval
            except psutil.Error:
                seen.pop(pid, None)
                continue
        self._procs = seen
        if not measured:
            return None, None
        # processes all seen for the first time (workers just started) have no CPU figure yet: unknown, not 0 %
        return rss, (cpu if timed else None)

    def _proc(self, pid: int) -> psutil.Process | None:
        known = self._procs.get(pid)
        if known is not None:
            return known
        try:
            return psutil.Process(pid)
        except psutil.Error:
            return None
