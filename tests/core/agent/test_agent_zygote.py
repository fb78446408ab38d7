"""A worker forked by the zygote behaves like a fresh ``python script.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from _agent_helpers import py, read_json, spec, wait_for_file, write

from stead.core.agent.workers import WorkerExit, WorkerGroup, WorkerSpec
from stead.core.agent.zygote import Zygote, ZygoteUnavailable
from stead.core.agent.zygote_main import parse_python_argv
from stead.core.config import Settings

pytestmark = pytest.mark.anyio

PORTRAIT = """
    import json, os, pickle, sys

    class Point:
        def __init__(self, x):
            self.x = x

    main = sys.modules["__main__"]
    portrait = {
        "name": __name__,
        "file": __file__,
        "argv": sys.argv,
        "orig_argv": sys.orig_argv[1:],
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "foo": os.environ.get("FOO"),
        "main_is_this_module": main.__dict__ is globals(),
        "main_spec": repr(main.__spec__),
        "pickle": pickle.loads(pickle.dumps(Point(3))).x,
        "stdout_write_through": sys.stdout.write_through,
        "stderr_line_buffering": sys.stderr.line_buffering,
        "stdin": sys.stdin.read(),
    }
    with open(os.environ["OUT"], "w") as f:
        f.write(json.dumps(portrait) + "\\n")
"""


async def run_one(group: WorkerGroup, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> WorkerExit:
    await group.start([spec(argv, cwd, env=env)])
    results = [e async for e in group.exits()]
    return results[0]


async def test_forked_worker_looks_like_a_fresh_interpreter(tmp_path: Path) -> None:
    code = tmp_path / "code"
    write(code, "portrait.py", PORTRAIT)
    workdir = tmp_path / "work"
    workdir.mkdir()
    portraits = {}
    async with Zygote(preload=()) as zygote:
        assert await zygote.wait_ready()
        for mode in ("zygote", "spawn"):
            async with WorkerGroup(zygote=zygote if mode == "zygote" else None) as group:
                out = tmp_path / f"{mode}.json"
                argv = [sys.executable, "-u", "../code/portrait.py", "--lr", "0.1"]
                result = await run_one(group, argv, workdir, env={"FOO": "bar", "OUT": str(out)})
                assert result.exit_code == 0, result.error_tail
                portraits[mode] = await read_json(out)
    assert portraits["zygote"] == portraits["spawn"]
    forked = portraits["zygote"]
    assert forked["name"] == "__main__"
    assert forked["file"] == str(workdir / ".." / "code" / "portrait.py")
    assert forked["argv"] == ["../code/portrait.py", "--lr", "0.1"]
    assert forked["orig_argv"] == ["-u", "../code/portrait.py", "--lr", "0.1"]
    assert forked["path0"] == str(code)
    assert forked["cwd"] == str(workdir)
    assert forked["foo"] == "bar"
    assert forked["main_is_this_module"] is True
    assert forked["pickle"] == 3
    assert forked["stdout_write_through"] is True


async def test_buffering_follows_the_command_like_python(tmp_path: Path) -> None:
    script = write(tmp_path, "portrait.py", PORTRAIT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    async with Zygote(preload=()) as zygote, WorkerGroup(zygote=zygote) as group:
        assert await zygote.wait_ready()
        out = tmp_path / "buffered.json"
        await group.start([WorkerSpec(argv=(sys.executable, str(script)), env={**env, "OUT": str(out)},
                                      cwd=tmp_path, local_rank=0)])
        results = [e async for e in group.exits()]
    assert results[0].exit_code == 0, results[0].error_tail
    data = await read_json(out)
    assert data["stdout_write_through"] is False
    assert data["stderr_line_buffering"] is True


async def test_multiprocessing_spawn_inside_a_forked_worker(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = write(tmp_path, "pool.py", f"""
        import multiprocessing as mp

        def square(x):
            return x * x

        if __name__ == "__main__":
            with mp.get_context("spawn").Pool(1) as pool:
                result = pool.map(square, [1, 2, 3])
            open({str(out)!r}, "w").write(f"{{result}}\\n")
    """)
    async with Zygote(preload=()) as zygote, WorkerGroup(zygote=zygote) as group:
        assert await zygote.wait_ready()
        result = await run_one(group, py(script), tmp_path)
    assert result.exit_code == 0, result.error_tail
    assert await wait_for_file(out) == "[1, 4, 9]\n"


async def test_uncaught_exception_prints_the_users_traceback_and_exits_1(tmp_path: Path) -> None:
    script = write(tmp_path, "boom.py", """
        def explode():
            raise ValueError("boom")
        explode()
    """)
    async with Zygote(preload=()) as zygote, WorkerGroup(zygote=zygote) as group:
        assert await zygote.wait_ready()
        result = await run_one(group, py(script), tmp_path)
    assert result.exit_code == 1
    tail = result.error_tail
    assert tail.startswith("Traceback (most recent call last):")
    assert f'File "{script}", line 4, in <module>' in tail
    assert tail.endswith("ValueError: boom")
    assert "zygote_main" not in tail


async def test_exit_runs_atexit_and_joins_threads_and_honours_systemexit(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    script = write(tmp_path, "bye.py", f"""
        import atexit, sys, threading, time

        def late():
            time.sleep(0.2)
            open({str(marks)!r}, "a").write("thread\\n")

        threading.Thread(target=late).start()
        atexit.register(lambda: open({str(marks)!r}, "a").write("atexit\\n"))
        sys.exit("bad input: stop")
    """)
    async with Zygote(preload=()) as zygote, WorkerGroup(zygote=zygote) as group:
        assert await zygote.wait_ready()
        result = await run_one(group, py(script), tmp_path)
    assert (result.exit_code, result.error_tail) == (1, "bad input: stop")
    assert marks.read_text() == "thread\natexit\n"


async def test_missing_script_and_module_fail_like_python(tmp_path: Path) -> None:
    async with Zygote(preload=()) as zygote, WorkerGroup(zygote=zygote) as group:
        assert await zygote.wait_ready()
        module = await run_one(group, [sys.executable, "-m", "no_such_module_xyz"], tmp_path)
        script = await run_one(group, [sys.executable, "missing.py"], tmp_path)
    assert module.exit_code == 1 and "No module named no_such_module_xyz" in module.error_tail
    assert script.exit_code == 2 and "can't open file" in script.error_tail


async def test_a_worker_that_would_shadow_a_preloaded_module_is_execed(tmp_path: Path) -> None:
    write(tmp_path, "json.py", "MARK = 'the user json'\n")
    out = tmp_path / "out"
    script = write(tmp_path, "use_json.py", f"import json\nopen({str(out)!r}, 'w').write(json.MARK + '\\n')\n")
    async with Zygote(preload=()) as zygote, WorkerGroup(zygote=zygote) as group:
        assert await zygote.wait_ready()
        result = await run_one(group, py(script), tmp_path)
    assert result.exit_code == 0, result.error_tail
    assert await wait_for_file(out) == "the user json\n"


async def test_preload_imports_in_the_zygote_and_workers_inherit_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = write(tmp_path, "seen.py", f"""
        import sys
        open({str(out)!r}, "w").write(f"{{'xml.dom.minidom' in sys.modules}}\\n")
    """)
    async with Zygote(preload=()) as zygote, WorkerGroup(zygote=zygote) as group:
        assert await zygote.wait_ready()
        failed = await zygote.preload(["xml.dom.minidom", "no_such_module_xyz"])
        assert list(failed) == ["no_such_module_xyz"]
        assert "ModuleNotFoundError" in failed["no_such_module_xyz"]
        await run_one(group, py(script), tmp_path)
        assert await wait_for_file(out) == "True\n"
        out.unlink()
        # a start-up variable that differs from the zygote's cannot be honoured after fork: exec instead
        await run_one(group, py(script), tmp_path, env={"OMP_NUM_THREADS": "3"})
        assert await wait_for_file(out) == "False\n"


async def test_a_zygote_closed_while_it_imports_is_killed_not_waited_for(tmp_path: Path) -> None:
    """A preload in flight (its caller cancelled) keeps the zygote from reading EOF: it is killed at once.

    With a stop grace longer than the test's timeout, waiting for EOF to be read would hang the test.
    """
    started = tmp_path / "started"
    write(tmp_path, "slow_import_xyz.py", f"""
        import time
        open({str(started)!r}, "w").write("importing\\n")
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    async with Zygote(Settings(worker_stop_grace_s=3600.0), preload=(), env=env) as zygote:
        assert await zygote.wait_ready()
        with anyio.move_on_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(zygote.preload, ["slow_import_xyz"])
                await wait_for_file(started)
                tg.cancel_scope.cancel()
        pid = zygote.pid
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone and reaped


async def test_a_closed_zygote_refuses_requests(tmp_path: Path) -> None:
    async with Zygote(preload=()) as zygote:
        assert await zygote.wait_ready()
    assert not zygote.ready
    with pytest.raises(ZygoteUnavailable, match="spawned instead"):
        await zygote.fork([sys.executable, "-c", "pass"], dict(os.environ), str(tmp_path), 1, 2)
    assert await zygote.wait_ready() is False


async def test_a_zygote_that_cannot_start_is_unavailable(tmp_path: Path) -> None:
    async with Zygote(preload=(), python=str(tmp_path / "no-python")) as zygote:
        assert await zygote.wait_ready() is False
        assert zygote.pid is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["{py}", "train.py", "--lr", "1"], ("script", "train.py", ("--lr", "1"), False)),
        (["{py}", "-u", "train.py"], ("script", "train.py", (), True)),
        (["{py}", "-uB", "-m", "pkg.mod", "-x"], ("module", "pkg.mod", ("-x",), True)),
        (["{py}", "-mpkg"], ("module", "pkg", (), False)),
        (["{py}", "-X", "dev", "train.py"], None),
        (["{py}", "-c", "print(1)"], None),
        (["{py}"], None),
        (["/usr/bin/env", "python", "train.py"], None),
        (["{py}", "-"], None),
    ],
)
def test_which_commands_the_zygote_runs_in_process(argv: list[str], expected: tuple[object, ...] | None) -> None:
    target = parse_python_argv([a.format(py=sys.executable) for a in argv], {}, sys.executable)
    if expected is None:
        assert target is None
    else:
        assert target is not None
        assert (target.kind, target.name, target.args, target.unbuffered) == expected


def test_messages_are_json_not_pickle() -> None:
    from stead.core.agent.zygote_main import decode, encode

    data = encode({"op": "exit", "pid": 3, "exit_code": 0, "signal": None})
    assert json.loads(data)["op"] == "exit"
    assert decode(data)["pid"] == 3
    with pytest.raises(ValueError, match="without an op"):
        decode(b"[1, 2]")


_ORPHANED_WORKER = """
import ctypes, os, time
from stead.core.agent.zygote_main import die_with
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the orphan is reaped here
zygote = os.fork()
if zygote == 0:
    parent = os.getpid()
    if os.fork() == 0:  # the worker
        while os.getppid() == parent:  # its zygote dies between the fork and the worker's prctl
            time.sleep(0.01)
        die_with(parent)
        os._exit(3)
    os._exit(0)
os.waitpid(zygote, 0)
_, status = os.waitpid(-1, 0)
print(f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
"""


def test_a_worker_whose_zygote_died_before_it_asked_for_the_death_signal_dies_of_sigkill_all_the_same() -> None:
    """The race behind a flaky test: the zygote killed right after a fork; its worker must end as the others do."""
    done = subprocess.run([sys.executable, "-c", _ORPHANED_WORKER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"signal {int(signal.SIGKILL)}"
