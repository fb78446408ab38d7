"""Run real `stead run` jobs (local platform, sqlite store, gloo workers) in a temporary directory."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: a whole job on the 2-core CI machine takes 10-40 s; this only stops a hung job
JOB_TIMEOUT_S = 240


@dataclasses.dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    cwd: Path

    def events(self, job: str) -> str:
        out = subprocess.run([sys.executable, "-m", "stead", "events", "--job", job], cwd=self.cwd,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def records(self, job: str, kind: str) -> list[dict[str, Any]]:
        """The data of every ``kind`` event in the job's log (``stead events --json``)."""
        out = subprocess.run([sys.executable, "-m", "stead", "events", "--job", job, "--json"], cwd=self.cwd,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        return [r["data"] for r in records if r["type"] == kind]


RunJob = Callable[..., Job]


@pytest.fixture
def run_job(tmp_path: Path) -> RunJob:
    def run(script: str, *args: str, job: str = "e2e", flags: tuple[str, ...] = ()) -> Job:
        (tmp_path / "train.py").write_text(textwrap.dedent(script))
        command = [sys.executable, "-m", "stead", "run", "--job-name", job, "--log-format", "json", *flags,
                   "train.py", *args]
        try:
            proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:  # say where the job was stuck, not just that it was
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            raise AssertionError(f"job {job} did not end within {JOB_TIMEOUT_S} s; its last log lines:\n"
                                 f"{err[-6000:]}") from None
        return Job(proc.returncode, proc.stdout, proc.stderr, tmp_path)

    return run
