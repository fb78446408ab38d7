"""`stead run`'s supervisor, with real processes: a small Python script stands in for the master, so each test is
about what the supervisor does with a master process (restart it, pass signals on, stop what it left), not a job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stead.cli.supervisor import EXIT_MASTER_CRASHED, LISTEN_FD_ENV, STOP_ENV, TAKEOVER_ENV
from stead.core.jobtoken import JOB_TOKEN_ENV
from stead.core.procs import is_alive

#: the longest a test waits for a process to do what it should (a bound for a broken test, not a measured time)
WAIT_S = 60.0
TOKEN = "the-job-token-supervised-3f9a1c"

#: A stand-in master: ``master.py OUT PLAN``. Start n (counted by the records in OUT) does PLAN's n-th step
#: (comma separated): ``exit:N``, ``kill`` (SIGKILL itself), ``signal:N`` (wait for SIGTERM or SIGINT, then exit
#: N), ``orphan`` (leave a sleeping child of its own, then exit 70). Each start first records OUT/<n>.json: its
#: pid, the port of the listening socket it was handed, the token, and whether it takes over or must stop.
MASTER = f"""
import json, os, signal, socket, subprocess, sys, time
from pathlib import Path

out, plan = Path(sys.argv[1]), sys.argv[2].split(",")
n = len(list(out.glob("*.json")))
step = plan[n]
listener = socket.socket(fileno=int(os.environ[{LISTEN_FD_ENV!r}]))
record = {{"pid": os.getpid(), "port": listener.getsockname()[1], "token": os.environ.get({JOB_TOKEN_ENV!r}),
          "takeover": os.environ.get({TAKEOVER_ENV!r}), "stop": os.environ.get({STOP_ENV!r})}}
if step.startswith("signal:"):
    def on_signal(signum, frame):
        (out / f"{{n}}.signal").write_text(str(signum))
        os._exit(int(step.split(":")[1]))
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
if step == "orphan":
    record["orphan"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                        start_new_session=True, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid
(out / "record.tmp").write_text(json.dumps(record))
(out / "record.tmp").rename(out / f"{{n}}.json")
if step.startswith("exit:"):
    sys.exit(int(step.split(":")[1]))
if step == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if step == "orphan":
    sys.exit({EXIT_MASTER_CRASHED})
while True:
    signal.pause()
"""


class Supervised:
    """``supervise`` in a process of its own (it reaps every child it has, and becomes a subreaper), its masters
    run by :data:`MASTER` with ``plan``."""

    def __init__(self, tmp_path: Path, plan: list[str], *, max_restarts: int = 2) -> None:
        self.out = tmp_path / "masters"
        self.out.mkdir()
        script = tmp_path / "master.py"
        script.write_text(MASTER)
        code = ("import sys\n"
                "from stead.cli.supervisor import supervise\n"
                "from stead.core.config import Settings\n"
                f"settings = Settings(master_max_restarts={max_restarts}, shutdown_grace_s={WAIT_S})\n"
                f"sys.exit(supervise([], settings, token={TOKEN!r}, "
                f"master_command=[sys.executable, {str(script)!r}, {str(self.out)!r}, {','.join(plan)!r}]))\n")
        self.process = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)

    def wait(self) -> tuple[int, str]:
        """The supervisor's exit code and what it wrote to stderr."""
        try:
            _, stderr = self.process.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the supervisor did not exit within {WAIT_S} s; its masters: {self.masters()}")
        return self.process.returncode, stderr

    def started(self, n: int) -> dict[str, Any]:
        """Master start ``n``'s record, once it is there."""
        path = self.out / f"{n}.json"
        deadline = time.monotonic() + WAIT_S
        while not path.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"master start {n} never came (supervisor exit code {self.process.returncode})")
            time.sleep(0.01)
        return dict(json.loads(path.read_text()))

    def masters(self) -> list[dict[str, Any]]:
        return [json.loads((self.out / f"{n}.json").read_text()) for n in range(len(list(self.out.glob("*.json"))))]

    def signalled(self, n: int) -> int | None:
        path = self.out / f"{n}.signal"
        return int(path.read_text()) if path.exists() else None

    def kill(self) -> None:
        """Leave nothing behind after a failed test: the masters and their orphans, then the supervisor."""
        for master in self.masters():
            for pid in (master["pid"], master.get("orphan")):
                if pid is not None and is_alive(pid):
                    os.kill(pid, signal.SIGKILL)
        self.process.kill()
        self.process.communicate()


def test_a_master_that_crashes_or_is_killed_is_restarted_to_take_over_on_the_same_socket_and_token(
        tmp_path: Path) -> None:
    supervised = Supervised(tmp_path, [f"exit:{EXIT_MASTER_CRASHED}", "kill", "exit:0"])
    code, stderr = supervised.wait()
    assert code == 0
    masters = supervised.masters()
    assert [m["takeover"] for m in masters] == [None, "1", "1"]  # the first starts the job, the others take over
    assert len({m["pid"] for m in masters}) == 3
    assert {m["port"] for m in masters} == {masters[0]["port"]}, "a restarted master listens where the first did"
    assert {m["token"] for m in masters} == {TOKEN}
    assert {m["stop"] for m in masters} == {None}
    assert "failed after" in stderr and "starting a new one (1 of 2)" in stderr
    assert "was killed by SIGKILL" in stderr and "starting a new one (2 of 2)" in stderr


@pytest.mark.parametrize(("exit_code", "meaning"), [(0, "succeeded"), (1, "failed"), (2, "bad input"),
                                                    (130, "stopped")])
def test_a_master_that_ran_the_job_to_its_end_is_not_restarted_and_its_code_is_the_job_s(
        tmp_path: Path, exit_code: int, meaning: str) -> None:
    supervised = Supervised(tmp_path, [f"exit:{exit_code}", "exit:0"])
    code, stderr = supervised.wait()
    assert code == exit_code, meaning
    assert len(supervised.masters()) == 1
    assert "starting a new one" not in stderr


def test_restarts_stop_at_master_max_restarts_and_the_supervisor_gives_up(tmp_path: Path) -> None:
    supervised = Supervised(tmp_path, [f"exit:{EXIT_MASTER_CRASHED}"] * 3 + ["exit:0"], max_restarts=2)
    code, stderr = supervised.wait()
    assert code == 1
    assert len(supervised.masters()) == 3
    assert "it was restarted 2 time(s) already (master_max_restarts); giving up" in stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_supervisor_is_passed_on_to_the_master_which_stops_the_job(
        tmp_path: Path, sig: signal.Signals) -> None:
    supervised = Supervised(tmp_path, ["signal:130", "exit:0"])
    supervised.started(0)  # the supervisor's handlers are in place before it starts a master
    supervised.process.send_signal(sig)
    code, _ = supervised.wait()
    assert code == 130
    assert supervised.signalled(0) == sig
    assert len(supervised.masters()) == 1


def test_a_stop_the_dying_master_did_not_finish_is_passed_to_the_master_that_takes_over(tmp_path: Path) -> None:
    supervised = Supervised(tmp_path, [f"signal:{EXIT_MASTER_CRASHED}", "exit:130"])
    supervised.started(0)
    supervised.process.send_signal(signal.SIGTERM)
    code, _ = supervised.wait()
    assert code == 130
    first, second = supervised.masters()
    assert supervised.signalled(0) == signal.SIGTERM
    assert first["stop"] is None
    assert (second["takeover"], second["stop"]) == ("1", "stopped by SIGTERM")


def test_what_a_dead_master_left_running_is_kept_while_the_job_runs_and_stopped_at_its_end(tmp_path: Path) -> None:
    supervised = Supervised(tmp_path, ["orphan", "signal:0"])
    orphan = supervised.started(0)["orphan"]
    supervised.started(1)
    try:
        assert is_alive(orphan), "an agent a dead master left was stopped while the job still runs"
        with open(f"/proc/{orphan}/stat") as stat:
            parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        assert parent == supervised.process.pid, "the orphan is not the supervisor's to reap"
    except BaseException:
        supervised.kill()
        raise
    supervised.process.send_signal(signal.SIGTERM)
    code, _ = supervised.wait()
    assert code == 0
    assert not is_alive(orphan)
