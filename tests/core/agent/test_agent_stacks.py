"""Stack dumps of running workers (faulthandler on a signal) and declared phases in the progress record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stead.core.agent.progress import ProgressFiles, ProgressReader
from stead.core.agent.stacks import dump_stacks
from stead.core.worker.progress import stacks_path

pytestmark = pytest.mark.anyio

WORKER = """
import sys, time
from stead.core.worker.progress import install_stack_dumps, phase, report_step
handler = sys.argv[1] == "handler"
if handler:
    install_stack_dumps()
report_step(4)
with phase("eval"):
    print("ready", flush=True)
    time.sleep(60)
"""


def start(files: ProgressFiles, rank: int, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, mode], env={**os.environ, **files.env(rank)},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


async def test_a_blocked_worker_answers_with_its_stack_and_one_without_the_handler_is_left_alone(
        tmp_path: Path) -> None:
    with ProgressFiles([0, 1], directory=tmp_path) as files:
        procs = [start(files, 0, "handler"), start(files, 1, "none")]
        try:
            stacks, error = await dump_stacks({0: procs[0].pid, 1: procs[1].pid}, files.paths, timeout_s=10)
            assert "line 10 in <module>" in stacks[0] and "thread 0x" in stacks[0].lower()
            assert stacks[1] == "" and "local rank 1 has no stack-dump handler" in error
            assert all(p.poll() is None for p in procs)  # neither was killed by the signal
            # a second dump reads only the new text
            again, _ = await dump_stacks({0: procs[0].pid}, files.paths, timeout_s=10)
            assert again[0].count("line 10 in <module>") == 1
            with ProgressReader(files.paths) as reader:
                steps = reader.read()
                assert steps[0].step == 4 and steps[0].phase == "eval" and reader.phase() == "eval"
        finally:
            for p in procs:
                p.kill()
                p.wait()
        assert stacks_path(files.paths[0], procs[0].pid).exists()
    assert not tmp_path.joinpath(files.dir.name).exists()  # the stacks files go with the progress directory


async def test_a_stopped_worker_is_reported_with_no_stack_within_the_timeout(tmp_path: Path) -> None:
    with ProgressFiles([0], directory=tmp_path) as files:
        proc = start(files, 0, "handler")
        try:
            os.kill(proc.pid, 19)  # SIGSTOP
            stacks, error = await dump_stacks({0: proc.pid}, files.paths, timeout_s=0.5)
            assert stacks[0] == "" and "wrote no stack within 0.5 s (stopped?)" in error
        finally:
            proc.kill()
            proc.wait()


def test_the_readmes_phase_snippet_runs_as_a_no_op_without_an_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    import stead

    monkeypatch.delenv("STEAD_PROGRESS_FILE", raising=False)
    section = (Path(__file__).parents[3] / "README.md").read_text().split("## When a job hangs", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    evaluated: list[object] = []
    exec(snippet, {"stead": stead, "evaluate": evaluated.append, "model": "the model"})
    assert evaluated == ["the model"]
