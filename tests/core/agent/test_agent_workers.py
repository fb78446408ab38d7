"""WorkerGroup: start, exit reports, stderr tail, stop, process groups; with a zygote and with spawn."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest
from _agent_helpers import alive, parent_of, py, read_json, spec, wait_dead, wait_for_file, write

from stead.core.agent.workers import WorkerExit, WorkerGroup
from stead.core.agent.zygote import Zygote
from stead.core.config import Settings
from stead.core.errors import InvalidRequest
from stead.core.rpc.backend import MAX_ERROR_TAIL_CHARS

pytestmark = pytest.mark.anyio


async def collect(group: WorkerGroup) -> list[WorkerExit]:
    return [e async for e in group.exits()]


async def test_exit_code_and_stderr_tail_are_reported(tmp_path: Path, zygote: Zygote | None) -> None:
    script = write(tmp_path, "fail.py", """
        import sys
        for i in range(20):
            print(f"line {i}", file=sys.stderr)
        sys.stderr.write("no newline at the end")
        sys.exit(3)
    """)
    async with WorkerGroup(Settings(error_tail_lines=3), zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path)])
        (result,) = await collect(group)
    assert (result.local_rank, result.exit_code, result.signal) == (0, 3, None)
    assert result.error_tail == "line 18\nline 19\nno newline at the end"
    assert not result.ok


async def test_a_huge_stderr_tail_is_cut_to_its_end_so_the_failure_report_still_fits(
        tmp_path: Path, zygote: Zygote | None) -> None:
    script = write(tmp_path, "shout.py", """
        import sys
        for i in range(40):
            sys.stderr.write("x" * 50_000 + "\\n")
        sys.stderr.write("the real error")
        sys.exit(1)
    """)
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path)])
        (result,) = await collect(group)
    assert len(result.error_tail) == MAX_ERROR_TAIL_CHARS
    assert result.error_tail.endswith("x\nthe real error")


async def test_death_by_signal_is_reported_as_signal(tmp_path: Path, zygote: Zygote | None) -> None:
    script = write(tmp_path, "sig.py", "import os, signal\nos.kill(os.getpid(), signal.SIGUSR2)\n")
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path)])
        (result,) = await collect(group)
    assert (result.exit_code, result.signal) == (None, signal.SIGUSR2)


async def test_a_zygote_s_worker_ignores_slurms_time_limit_warning_unless_it_handles_it(tmp_path: Path) -> None:
    script = write(tmp_path, "warned.py", "import os, signal, sys\n"
                                          "os.kill(os.getpid(), signal.SIGUSR1)\n"  # ignored: it goes on
                                          "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(3))\n"
                                          "os.kill(os.getpid(), signal.SIGUSR1)\n")  # its own handler runs
    async with Zygote(preload=()) as warm, WorkerGroup(zygote=warm) as group:
        await group.start([spec(py(script), tmp_path)])
        (result,) = await collect(group)
    assert (result.exit_code, result.signal) == (3, None)


async def test_an_exit_is_reported_while_the_other_workers_still_run(tmp_path: Path, zygote: Zygote | None) -> None:
    crash = write(tmp_path, "crash.py", "raise SystemExit(7)\n")
    sleeper = write(tmp_path, "sleep.py", "import time\ntime.sleep(60)\n")
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(crash), tmp_path, rank=0), spec(py(sleeper), tmp_path, rank=1)])
        exits = group.exits()
        first = await exits.__anext__()
        assert (first.local_rank, first.exit_code) == (0, 7)
        assert group.alive == 1
        sleeper_pid = group.pids[1]
        assert alive(sleeper_pid)
        stopped = await group.stop()
        second = await exits.__anext__()
        with pytest.raises(StopAsyncIteration):
            await exits.__anext__()
    assert (second.local_rank, second.signal) == (1, signal.SIGTERM)
    assert {e.local_rank for e in stopped} == {0, 1}
    assert group.results[1] == second


async def test_stop_kills_a_worker_that_ignores_sigterm(tmp_path: Path, zygote: Zygote | None) -> None:
    ready = tmp_path / "ready"
    script = write(tmp_path, "stubborn.py", f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").write("ready\\n")
        time.sleep(60)
    """)
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path)])
        await wait_for_file(ready)
        (result,) = await group.stop(grace_s=0.2)
    assert result.signal == signal.SIGKILL


async def test_stop_reaches_the_workers_children(tmp_path: Path, zygote: Zygote | None) -> None:
    child_pid_file = tmp_path / "child"
    script = write(tmp_path, "parent.py", f"""
        import signal, subprocess, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "60"])
        open({str(child_pid_file)!r}, "w").write(f"{{child.pid}}\\n")
        time.sleep(60)
    """)
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path)])
        grandchild = int(await wait_for_file(child_pid_file))
        assert alive(grandchild)
        await group.stop(grace_s=0.2)
    wait_dead([grandchild], "the child of a stopped worker")


async def test_children_left_by_an_exited_worker_are_killed(tmp_path: Path, zygote: Zygote | None) -> None:
    child_pid_file = tmp_path / "child"
    script = write(tmp_path, "leaver.py", f"""
        import subprocess
        child = subprocess.Popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open({str(child_pid_file)!r}, "w").write(f"{{child.pid}}\\n")
    """)
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path)])
        (result,) = await collect(group)
        assert result.exit_code == 0
        grandchild = int(await wait_for_file(child_pid_file))
        wait_dead([grandchild], "the child left by an exited worker")


async def test_output_goes_to_files_and_tee_prefixes_the_console(
    tmp_path: Path, zygote: Zygote | None, capfd: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path, "talk.py", """
        import os, sys
        print("to stdout")
        print("to stderr", file=sys.stderr)
    """)
    out, err = tmp_path / "logs" / "out.log", tmp_path / "logs" / "err.log"
    out.parent.mkdir()
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path, rank=3, env={"RANK": "5"}, stdout_path=out, stderr_path=err,
                                tee=True)])
        (result,) = await collect(group)
        await group.stop()
    assert result.exit_code == 0
    assert out.read_text() == "to stdout\n"
    assert err.read_text() == "to stderr\n"
    captured = capfd.readouterr()
    assert "[rank5]:to stdout\n" in captured.out
    assert "[rank5]:to stderr\n" in captured.err


async def test_stdout_redirect_without_tee_writes_only_the_file(
    tmp_path: Path, zygote: Zygote | None, capfd: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path, "quiet.py", "print('only in the file')\n")
    out = tmp_path / "out.log"
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path, stdout_path=out, stderr_path=tmp_path / "err.log")])
        await collect(group)
    assert out.read_text() == "only in the file\n"
    assert "only in the file" not in capfd.readouterr().out


async def test_module_target_runs_as_main(tmp_path: Path, zygote: Zygote | None) -> None:
    report = tmp_path / "report.json"
    write(tmp_path, "pkg/__init__.py", "")
    write(tmp_path, "pkg/mod.py", f"""
        import json, sys
        if __name__ == "__main__":
            open({str(report)!r}, "w").write(json.dumps({{"argv": sys.argv, "path0": sys.path[0]}}) + "\\n")
    """)
    async with WorkerGroup(zygote=zygote) as group:
        import sys

        await group.start([spec([sys.executable, "-u", "-m", "pkg.mod", "--flag", "x"], tmp_path)])
        (result,) = await collect(group)
    assert result.exit_code == 0, result.error_tail
    data = await read_json(report)
    assert data["argv"] == [str(tmp_path / "pkg" / "mod.py"), "--flag", "x"]
    assert data["path0"] == str(tmp_path)


async def test_non_python_program_runs(tmp_path: Path, zygote: Zygote | None) -> None:
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(["sh", "-c", "echo from-sh >&2; exit 4"], tmp_path)])
        (result,) = await collect(group)
    assert (result.exit_code, result.error_tail) == (4, "from-sh")


async def test_a_group_runs_a_new_round_after_stop(tmp_path: Path, zygote: Zygote | None) -> None:
    sleeper = write(tmp_path, "sleep.py", "import time\ntime.sleep(60)\n")
    quick = write(tmp_path, "quick.py", "print('done')\n")
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(sleeper), tmp_path, rank=r) for r in range(2)])
        with pytest.raises(InvalidRequest, match="still running"):
            await group.start([spec(py(quick), tmp_path)])
        old_round = group.exits()
        await group.stop()
        await group.start([spec(py(quick), tmp_path, rank=r) for r in range(2)])
        assert [e async for e in old_round] == []  # a new round ends the previous round's iterator
        results = await collect(group)
    assert sorted((e.local_rank, e.exit_code) for e in results) == [(0, 0), (1, 0)]


async def test_leaving_the_group_stops_its_workers(tmp_path: Path, zygote: Zygote | None) -> None:
    sleeper = write(tmp_path, "sleep.py", "import time\ntime.sleep(60)\n")
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(sleeper), tmp_path)])
        pid = group.pids[0]
    assert group.results[0].signal == signal.SIGTERM
    assert not alive(pid)


async def test_workers_lead_their_own_process_group(tmp_path: Path, zygote: Zygote | None) -> None:
    report = tmp_path / "ids"
    script = write(tmp_path, "ids.py", f"""
        import os
        open({str(report)!r}, "w").write(f"{{os.getpgid(0)}} {{os.getsid(0)}} {{os.getppid()}}\\n")
    """)
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(script), tmp_path)])
        pid = group.pids[0]
        await collect(group)
    pgid, sid, ppid = map(int, (await wait_for_file(report)).split())
    assert pgid == sid == pid
    assert ppid == (zygote.pid if zygote is not None else os.getpid())


async def test_bad_specs_are_rejected_with_what_to_do(tmp_path: Path) -> None:
    async with WorkerGroup() as group:
        with pytest.raises(InvalidRequest, match="does not exist"):
            await group.start([spec(["true"], tmp_path / "missing")])
        with pytest.raises(InvalidRequest, match="repeat a local rank"):
            await group.start([spec(["true"], tmp_path), spec(["true"], tmp_path)])
        with pytest.raises(InvalidRequest, match="not found on the worker's PATH"):
            await group.start([spec(["no-such-program-xyz"], tmp_path)])
        with pytest.raises(InvalidRequest, match="before start"):
            group.exits()


async def test_start_uses_the_zygote_only_once_ready(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    write(tmp_path / "lib", "slowimport.py", f"""
        import os, time
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.01)
    """)
    report = tmp_path / "ppid"
    script = write(tmp_path, "ppid.py", f"import os\nopen({str(report)!r}, 'w').write(f'{{os.getppid()}}\\n')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "lib"))
    # no wait for a zygote that is not ready (zygote_wait_s): the first start must go around it
    async with Zygote(preload=("slowimport",), env=env) as zygote, \
            WorkerGroup(Settings(zygote_wait_s=0), zygote=zygote) as group:
        assert not zygote.ready
        await group.start([spec(py(script), tmp_path, env=env)])
        await collect(group)
        assert int(await wait_for_file(report)) == os.getpid()
        gate.write_text("open")
        assert await zygote.wait_ready()
        report.unlink()
        await group.start([spec(py(script), tmp_path, env=env)])
        await collect(group)
        assert int(await wait_for_file(report)) == zygote.pid
        assert parent_of(zygote.pid or 0) == os.getpid()


async def test_workers_fall_back_to_spawn_when_the_zygote_dies(tmp_path: Path) -> None:
    sleeper = write(tmp_path, "sleep.py", "import time\ntime.sleep(60)\n")
    async with Zygote(preload=()) as zygote, WorkerGroup(zygote=zygote) as group:
        assert await zygote.wait_ready()
        await group.start([spec(py(sleeper), tmp_path)])
        forked = group.pids[0]
        assert zygote.pid is not None
        os.kill(zygote.pid, signal.SIGKILL)
        (result,) = await collect(group)
        assert result.signal == signal.SIGKILL
        wait_dead([forked], "the worker of a SIGKILLed zygote")
        assert not zygote.ready
        await group.start([spec(py(sleeper), tmp_path)])
        assert parent_of(group.pids[0]) == os.getpid()


async def test_exits_arrive_without_waiting_for_a_poll(tmp_path: Path, zygote: Zygote | None) -> None:
    """Many short workers: every exit is delivered, each exactly once."""
    quick = write(tmp_path, "quick.py", "import sys\nsys.exit(int(sys.argv[1]))\n")
    async with WorkerGroup(zygote=zygote) as group:
        await group.start([spec(py(quick, str(r)), tmp_path, rank=r) for r in range(6)])
        with anyio.fail_after(30):
            results = await collect(group)
    assert sorted((e.local_rank, e.exit_code) for e in results) == [(r, r) for r in range(6)]
