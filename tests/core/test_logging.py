"""stead's JSON log lines stay whole when several processes share one stderr (a job's agents, its master)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import structlog
from stead.core.logging import configure_logging

configure_logging("json", level="info")
log = structlog.get_logger("t")
for i in range(2000):
    log.info("line", i=i, pad="x" * 100)
"""


def test_json_lines_of_processes_writing_to_one_unbuffered_stderr_never_interleave() -> None:
    # agents run with PYTHONUNBUFFERED=1 (for their workers' output): a line and its newline written apart would
    # let another process's line in between
    read, write = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    children = [subprocess.Popen([sys.executable, "-c", CHILD], stderr=write, env=env) for _ in range(4)]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    for child in children:
        assert child.wait(timeout=60) == 0
    assert len(lines) == 4 * 2000
    for line in lines:
        json.loads(line)
