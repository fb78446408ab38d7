"""Fixtures for the platform tests: a scratch directory and a safety net for stray agents."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _platform_helpers import alive


@pytest.fixture
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder the nodes' agents see at the same path wherever they run (pytest's, which the test hosts share)."""
    with tempfile.TemporaryDirectory(prefix="stead-platform-", dir=tmp_path_factory.getbasetemp()) as path:
        yield Path(path)


@pytest.fixture
def strays() -> Iterator[list[int]]:
    """Pids a test appends; any still running at the end (the test failed) are SIGKILLed."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
