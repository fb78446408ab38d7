"""stead.core.procs: a tied child gets its signal when its parent dies; children and descendants from /proc."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _polling import wait_until

from stead.core.procs import (
    DEATH_SIGNAL_SUPPORTED,
    children,
    cmdline,
    descendants,
    is_alive,
    tied_argv,
    zombie_failure,
)

CHILD = """\
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def on_signal(signum, frame):
    out.write_text(str(signum))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_signal)
out.with_suffix(".ready").write_text("")
time.sleep(300)
"""

PARENT = """\
import signal, subprocess, sys, time
from stead.core.procs import tied_argv
subprocess.Popen(tied_argv([sys.executable, "-c", sys.argv[2], sys.argv[1]], signal.SIGTERM))
time.sleep(300)
"""


@pytest.mark.skipif(not DEATH_SIGNAL_SUPPORTED, reason="PR_SET_PDEATHSIG is Linux only")
def test_a_tied_child_gets_its_signal_when_its_parent_is_killed(tmp_path: Path) -> None:
    out = tmp_path / "signal"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(out), CHILD])
    try:
        wait_until(lambda: out.with_suffix(".ready").exists(), "the child started")
        (child,) = children(parent.pid)
        assert cmdline(child)[-1] == str(out), "the shim did not exec the command"
        assert descendants() >= {parent.pid, child}
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: out.exists() and out.read_text() == str(int(signal.SIGTERM)), "the child got SIGTERM")
    wait_until(lambda: not is_alive(child), "the child exited")


def test_off_linux_or_on_it_the_command_is_kept_whole() -> None:
    argv = tied_argv(["prog", "a b", "--x"], signal.SIGTERM)
    assert argv[-3:] == ["prog", "a b", "--x"]
    if DEATH_SIGNAL_SUPPORTED:
        assert argv[:2] == [sys.executable, "-I"] and str(os.getpid()) in argv and str(int(signal.SIGTERM)) in argv


@pytest.mark.parametrize(("script", "expected"), [
    ("raise SystemExit(17)", (17, None)),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", (None, signal.SIGKILL)),
    ("pass", None),  # a clean exit waits for the zygote's report: a status that reads 0 may be hidden
])
def test_a_failed_process_s_status_is_read_before_it_is_reaped_and_never_after(
        script: str, expected: tuple[int | None, int | None] | None) -> None:
    proc = subprocess.Popen([sys.executable, "-c", script])
    pidfd = os.pidfd_open(proc.pid)
    try:
        select.select([pidfd], [], [], 30)  # ended, not reaped: a zombie, as a busy zygote leaves its worker
        assert zombie_failure(proc.pid, pidfd) == expected
        proc.wait()
        assert zombie_failure(proc.pid, pidfd) is None  # reaped: the pid may belong to anyone now
    finally:
        os.close(pidfd)
