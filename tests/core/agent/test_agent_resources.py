"""The heartbeat's resource figures: real RSS and CPU of the workers and their children, or unknown."""

from __future__ import annotations

import subprocess
import sys

import psutil
from _polling import wait_until

from stead.core.agent.resources import WorkerResources

BUSY = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
end = time.time() + 30
while time.time() < end:
    pass
"""


def test_a_busy_worker_and_its_child_are_measured_and_a_gone_one_is_unknown() -> None:
    worker = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        resources = WorkerResources()
        first_rss, first_cpu = resources.sample([worker.pid])  # CPU is measured between two samples
        assert first_rss is not None and first_cpu is None  # a first look has no CPU figure: unknown, not 0 %

        def measured() -> bool:  # the child's 64 MiB counts, and the busy loop
            rss, cpu = resources.sample([worker.pid])
            return rss is not None and rss > 64 << 20 and cpu is not None and cpu > 10

        wait_until(measured, "the busy worker and its child measured at over 64 MiB and 10 % CPU")
    finally:
        children = psutil.Process(worker.pid).children(recursive=True)
        for child in children:
            child.kill()
        worker.kill()  # its killed child stays a zombie until it is reaped: the worker goes first
        worker.wait()
        psutil.wait_procs(children, timeout=30)
    assert resources.sample([worker.pid]) == (None, None)
