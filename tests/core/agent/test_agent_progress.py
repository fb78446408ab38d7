"""report_step writes into a shared page; ProgressReader sees it; without the variable it is a no-op."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _agent_helpers import py, spec, write

from stead.core.agent.progress import (
    ProgressFiles,
    ProgressReader,
    progress_prefix,
    remove_earlier,
    remove_left_behind,
)
from stead.core.agent.workers import WorkerGroup
from stead.core.agent.zygote import Zygote
from stead.core.worker import progress
from stead.core.worker.progress import PROGRESS_ENV, report_step


@pytest.fixture
def fresh_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """report_step as a new process would see it (nothing mapped yet)."""
    progress._forget_after_fork()
    yield
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    progress._forget_after_fork()


def test_report_step_round_trips_to_the_reader(fresh_writer: None, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    with ProgressFiles([0, 1], directory=tmp_path) as files, ProgressReader(files.paths) as reader:
        assert reader.read() == {}
        monkeypatch.setenv(PROGRESS_ENV, files.env(1)[PROGRESS_ENV])
        before = time.monotonic()
        report_step(41)
        report_step(42)
        seen = reader.read()
        assert list(seen) == [1]
        assert (seen[1].step, seen[1].pid) == (42, os.getpid())
        assert before <= seen[1].time <= time.monotonic()
        files.reset()
        assert reader.read() == {}
        report_step(43)
        assert reader.read()[1].step == 43


def test_time_inside_backward_reaches_the_reader_with_each_step(fresh_writer: None, monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    import torch

    original = torch.autograd.backward
    try:
        assert progress.install_backward_clock()
        assert progress.install_backward_clock()  # twice: wrapped once
        assert torch.autograd.backward.__wrapped__ is original  # type: ignore[attr-defined]
        with ProgressFiles([0], directory=tmp_path) as files, ProgressReader(files.paths) as reader:
            monkeypatch.setenv(PROGRESS_ENV, files.env(0)[PROGRESS_ENV])
            report_step(0)
            before = reader.read()[0].backward_s
            weight = torch.ones(64, 64, requires_grad=True)
            (weight @ weight).sum().backward()  # Tensor.backward goes through the wrapped function
            report_step(1)
            assert reader.read()[0].backward_s > before
    finally:
        torch.autograd.backward = original


def test_report_step_is_a_no_op_outside_an_agent(fresh_writer: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    report_step(1)
    monkeypatch.setenv(PROGRESS_ENV, "/nonexistent/stead-progress")
    report_step(2)
    report_step(3)


def test_a_torn_write_keeps_the_previous_value(fresh_writer: None, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    with ProgressFiles([0], directory=tmp_path) as files, ProgressReader(files.paths) as reader:
        monkeypatch.setenv(PROGRESS_ENV, str(files.paths[0]))
        report_step(7)
        assert reader.read()[0].step == 7
        with open(files.paths[0], "r+b") as handle:  # a writer stopped half way: odd sequence number
            seq = struct.unpack("<Q", handle.read(8))[0]
            handle.seek(0)
            handle.write(struct.pack("<Qq", seq + 1, 999))
        assert reader.read()[0].step == 7


def test_files_live_in_a_directory_removed_on_close(tmp_path: Path) -> None:
    files = ProgressFiles([0, 3], directory=tmp_path)
    assert set(files.paths) == {0, 3}
    assert all(p.parent == files.dir for p in files.paths.values())
    files.close()
    assert not files.dir.exists()


def test_a_killed_agent_s_directory_is_found_by_its_node_and_removed_by_the_clean_up(tmp_path: Path) -> None:
    mine = ProgressFiles([0, 1], directory=tmp_path, prefix=progress_prefix("job", "node-1", 2))  # never closed
    other = ProgressFiles([0], directory=tmp_path, prefix=progress_prefix("job", "node-1", 3))
    foreign = tmp_path / f"{progress_prefix('job', 'node-1', 2)}theirs"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)  # another user's, of the same name: left alone
    assert remove_left_behind(progress_prefix("job", "node-1", 2), directory=tmp_path) == [mine.dir]
    assert not mine.dir.exists() and other.dir.exists() and foreign.exists()
    other.close()


def test_a_new_incarnation_removes_what_its_killed_predecessors_left_and_nothing_else(tmp_path: Path) -> None:
    made = {(node, incarnation): ProgressFiles([0], directory=tmp_path,
                                               prefix=progress_prefix("job", node, incarnation))
            for node, incarnation in (("node-1", 1), ("node-1", 2), ("node-1", 3), ("node-10", 1), ("node-1", 11))}
    removed = remove_earlier("job", "node-1", 3, directory=tmp_path)
    assert sorted(removed) == sorted([made["node-1", 1].dir, made["node-1", 2].dir])
    assert all(made[key].dir.exists() for key in (("node-1", 3), ("node-10", 1), ("node-1", 11)))
    for key in (("node-1", 3), ("node-10", 1), ("node-1", 11)):
        made[key].close()


@pytest.mark.anyio
async def test_workers_report_steps_to_the_agent(tmp_path: Path, zygote: Zygote | None) -> None:
    script = write(tmp_path, "steps.py", """
        import sys
        from stead.core.worker.progress import report_step
        for step in range(1, int(sys.argv[1]) + 1):
            report_step(step)
    """)
    with ProgressFiles([0, 1], directory=tmp_path) as files, ProgressReader(files.paths) as reader:
        async with WorkerGroup(zygote=zygote) as group:
            await group.start([spec(py(script, str(100 + r)), tmp_path, rank=r, env=files.env(r)) for r in (0, 1)])
            results = [e async for e in group.exits()]
            assert all(e.exit_code == 0 for e in results), [e.error_tail for e in results]
        seen = reader.read()
        assert {rank: p.step for rank, p in seen.items()} == {0: 100, 1: 101}
        assert {rank: p.pid for rank, p in seen.items()} == group.pids


def test_the_modules_reported_for_the_zygote_include_a_lazy_packages_submodules(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``import transformers`` alone imports almost nothing: the submodules the worker used are named too, so the
    zygote imports them before the next restart; an ordinary package is named by its top level only."""
    import types

    site = tmp_path / "site-packages"
    lazy_type = type("LazyModule", (types.ModuleType,), {})
    modules = {"lazypkg": lazy_type("lazypkg"), "lazypkg.trainer": types.ModuleType("lazypkg.trainer"),
               "plain": types.ModuleType("plain"), "plain.sub": types.ModuleType("plain.sub"),
               "_private": types.ModuleType("_private")}
    for name, module in modules.items():
        module.__file__ = str(site / name.replace(".", "/") / "__init__.py")
        monkeypatch.setitem(__import__("sys").modules, name, module)
    reported = set(progress.imported_packages())
    assert {"lazypkg", "lazypkg.trainer", "plain"} <= reported
    assert not {"plain.sub", "_private"} & reported
