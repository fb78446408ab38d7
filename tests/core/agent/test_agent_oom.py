"""The record of an OOM kill: kernel log lines and memory cgroup counters on fake trees, then the real kernel."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stead.core.agent.oom import (
    KERNEL_RECORDS_KEPT,
    OOM_EXIT_CODE,
    OomRecords,
    killed_like_oom,
    parse_kernel_line,
)

PID = 4242
OTHER_PID = 4343
V1_PROC = "9:name=systemd:/\n4:memory:/jobs/worker\n1:cpu:/\n"
V2_PROC = "0::/jobs/worker\n"
HYBRID_PROC = "4:memory:/jobs/worker\n1:cpu:/\n0::/jobs/worker\n"
OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {}\n"
OOM_CONTROL_BEFORE_4_13 = "oom_kill_disable 0\nunder_oom 0\n"
MEMORY_EVENTS = "low 0\nhigh 0\nmax 12\noom 1\noom_kill {}\noom_group_kill 0\n"
KILLED_KMSG = ("3,423,34120755471,-;Memory cgroup out of memory: Killed process {} (python) total-vm:221448kB,"
               " anon-rss:211200kB, file-rss:6804kB, shmem-rss:0kB, UID:0 pgtables:472kB oom_score_adj:0\n")
OOM_KILL_KMSG = ("6,422,34120755447,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
                 "oom_memcg=/jobs/worker,task_memcg=/jobs/worker,task=python,pid={},uid=0\n")
KMSG_CONTINUATION = " SUBSYSTEM=memory\n DEVICE=+memcg:jobs\n"

#: the real-kernel test's memory limit: small enough to hit in well under a second
REAL_LIMIT_BYTES = 200 << 20
#: how long the real OOM may take before the test gives up (it takes well under a second)
REAL_OOM_DEADLINE_S = 30.0
#: an emptied cgroup may report busy for a moment after its last process is reaped
RMDIR_ATTEMPTS = 50
RMDIR_PAUSE_S = 0.02
ALLOCATE_UNTIL_KILLED = """
import os, sys
with open(sys.argv[1], "w") as procs:
    procs.write(str(os.getpid()))
chunks = []
while True:
    chunks.append(bytearray(10 << 20))
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _append(path: Path, text: str) -> None:
    with path.open("a") as log:
        log.write(text)


def _records(tmp_path: Path, proc_cgroup: str = "", kmsg: Path | None = None) -> OomRecords:
    """Records over tmp_path/cgroup and tmp_path/proc, with ``proc_cgroup`` as PID's /proc/<pid>/cgroup."""
    if proc_cgroup:
        _write(tmp_path / "proc" / str(PID) / "cgroup", proc_cgroup)
    records = OomRecords(cgroup_root=tmp_path / "cgroup", proc_root=tmp_path / "proc", kmsg=kmsg)
    records.open()
    return records


@pytest.fixture
def kmsg(tmp_path: Path) -> Path:
    """A plain file standing in for /dev/kmsg, with an old OOM record for PID already in it."""
    return _write(tmp_path / "kmsg", OOM_KILL_KMSG.format(PID) + KILLED_KMSG.format(PID))


def test_killed_like_oom_is_sigkill_or_exit_137_only() -> None:
    assert killed_like_oom(None, signal.SIGKILL)
    assert killed_like_oom(OOM_EXIT_CODE, None)
    assert OOM_EXIT_CODE == 137
    assert not killed_like_oom(None, signal.SIGTERM)
    assert not killed_like_oom(1, None)
    assert not killed_like_oom(None, None)


def test_kernel_lines_are_parsed_from_kmsg_dmesg_and_bare_text() -> None:
    from_kmsg = parse_kernel_line(KILLED_KMSG.format(PID))
    assert from_kmsg is not None and from_kmsg.killed and from_kmsg.pid == PID
    assert from_kmsg.message.startswith("Memory cgroup out of memory: Killed process 4242 (python)")
    from_dmesg = parse_kernel_line("[34120.755471] Out of memory: Killed process 77 (java) total-vm:1kB")
    assert from_dmesg is not None and from_dmesg.pid == 77
    assert from_dmesg.message == "Out of memory: Killed process 77 (java) total-vm:1kB"
    oom_kill = parse_kernel_line(OOM_KILL_KMSG.format(PID))
    assert oom_kill is not None and not oom_kill.killed
    assert (oom_kill.pid, oom_kill.task_memcg) == (PID, "/jobs/worker")
    assert parse_kernel_line("6,1,0,-;oom_reaper: reaped process 77 (java), now anon-rss:0kB") is None
    assert parse_kernel_line("4,2,0,-;python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL)") is None


def test_a_v1_oom_kill_counter_that_rose_is_evidence(tmp_path: Path) -> None:
    control = _write(tmp_path / "cgroup/memory/jobs/worker/memory.oom_control", OOM_CONTROL.format(0))
    records = _records(tmp_path, V1_PROC)
    records.watch(PID)
    control.write_text(OOM_CONTROL.format(1))
    assert records.evidence(PID) == "memory cgroup /jobs/worker: oom_kill 0 -> 1 (memory.oom_control)"


def test_a_v1_oom_kill_counter_that_did_not_rise_is_no_evidence(tmp_path: Path) -> None:
    _write(tmp_path / "cgroup/memory/jobs/worker/memory.oom_control", OOM_CONTROL.format(3))
    records = _records(tmp_path, V1_PROC)
    records.watch(PID)
    assert records.evidence(PID) == ""


def test_a_v1_cgroup_without_an_oom_kill_line_falls_back_to_failcnt_as_weaker_evidence(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup/memory/jobs/worker"
    _write(cgroup / "memory.oom_control", OOM_CONTROL_BEFORE_4_13)
    failcnt = _write(cgroup / "memory.failcnt", "5\n")
    records = _records(tmp_path, V1_PROC)
    records.watch(PID)
    failcnt.write_text("12\n")
    evidence = records.evidence(PID)
    assert evidence.startswith("memory cgroup /jobs/worker: memory.failcnt 5 -> 12")
    assert "weaker evidence" in evidence


def test_a_v2_memory_events_oom_kill_rise_is_evidence(tmp_path: Path) -> None:
    _write(tmp_path / "cgroup/cgroup.controllers", "cpu io memory pids\n")
    events = _write(tmp_path / "cgroup/jobs/worker/memory.events", MEMORY_EVENTS.format(2))
    records = _records(tmp_path, V2_PROC)
    records.watch(PID)
    events.write_text(MEMORY_EVENTS.format(3))
    assert records.evidence(PID) == "memory cgroup /jobs/worker: oom_kill 2 -> 3 (memory.events)"


def test_on_a_hybrid_system_the_v1_memory_controller_is_read(tmp_path: Path) -> None:
    control = _write(tmp_path / "cgroup/memory/jobs/worker/memory.oom_control", OOM_CONTROL.format(0))
    unified = _write(tmp_path / "cgroup/unified/jobs/worker/memory.events", MEMORY_EVENTS.format(0))
    records = _records(tmp_path, HYBRID_PROC)
    records.watch(PID)
    unified.write_text(MEMORY_EVENTS.format(9))  # not where the memory controller is
    assert records.evidence(PID) == ""
    records.watch(PID)
    control.write_text(OOM_CONTROL.format(1))
    assert records.evidence(PID) == "memory cgroup /jobs/worker: oom_kill 0 -> 1 (memory.oom_control)"


def test_a_v2_line_without_a_v1_memory_line_is_read_under_unified_on_a_hybrid_system(tmp_path: Path) -> None:
    events = _write(tmp_path / "cgroup/unified/jobs/worker/memory.events", MEMORY_EVENTS.format(0))
    records = _records(tmp_path, "1:cpu:/\n0::/jobs/worker\n")
    records.watch(PID)
    events.write_text(MEMORY_EVENTS.format(1))
    assert records.evidence(PID) == "memory cgroup /jobs/worker: oom_kill 0 -> 1 (memory.events)"


def test_a_cgroup_not_visible_here_is_read_at_the_mount_root(tmp_path: Path) -> None:
    control = _write(tmp_path / "cgroup/memory/memory.oom_control", OOM_CONTROL.format(0))  # no jobs/worker below
    records = _records(tmp_path, V1_PROC)
    records.watch(PID)
    control.write_text(OOM_CONTROL.format(1))
    evidence = records.evidence(PID)
    assert evidence.startswith("memory cgroup /jobs/worker (read at the mount root")
    assert evidence.endswith("oom_kill 0 -> 1 (memory.oom_control)")


def test_a_kmsg_record_appended_after_open_is_evidence_with_its_task_memcg(tmp_path: Path, kmsg: Path) -> None:
    records = _records(tmp_path, kmsg=kmsg)
    records.watch(PID)
    _append(kmsg, OOM_KILL_KMSG.format(PID) + KMSG_CONTINUATION + KILLED_KMSG.format(PID) + KMSG_CONTINUATION)
    evidence = records.evidence(PID)
    assert evidence.startswith("kernel: Memory cgroup out of memory: Killed process 4242 (python) total-vm:221448kB")
    assert evidence.endswith(" (task_memcg=/jobs/worker)")
    assert "\n" not in evidence


def test_plain_kernel_log_lines_are_evidence_too(tmp_path: Path) -> None:
    log = _write(tmp_path / "kern.log", "")
    records = _records(tmp_path, kmsg=log)
    records.watch(PID)
    _append(log, f"[ 3412.075] Out of memory: Killed process {PID} (python) total-vm:1024kB, anon-rss:512kB\n")
    expected = f"kernel: Out of memory: Killed process {PID} (python) total-vm:1024kB, anon-rss:512kB"
    assert records.evidence(PID) == expected


def test_an_oom_kill_line_alone_is_evidence_when_the_killed_line_was_lost(tmp_path: Path, kmsg: Path) -> None:
    records = _records(tmp_path, kmsg=kmsg)
    records.watch(PID)
    _append(kmsg, OOM_KILL_KMSG.format(PID))
    assert records.evidence(PID).startswith("kernel: oom-kill:constraint=CONSTRAINT_MEMCG,")


def test_a_line_split_across_two_writes_is_read_whole(tmp_path: Path, kmsg: Path) -> None:
    records = _records(tmp_path, kmsg=kmsg)
    records.watch(PID)
    line = KILLED_KMSG.format(PID)
    _append(kmsg, line[:40])
    assert records.evidence(OTHER_PID) == ""  # a drain in the middle of the line
    _append(kmsg, line[40:])
    assert "Killed process 4242 (python)" in records.evidence(PID)


def test_a_kernel_record_for_another_pid_is_no_evidence(tmp_path: Path, kmsg: Path) -> None:
    records = _records(tmp_path, kmsg=kmsg)
    records.watch(PID)
    _append(kmsg, OOM_KILL_KMSG.format(OTHER_PID) + KILLED_KMSG.format(OTHER_PID))
    assert records.evidence(PID) == ""


def test_open_starts_at_the_end_of_the_kernel_log(tmp_path: Path, kmsg: Path) -> None:
    records = _records(tmp_path, kmsg=kmsg)  # the fixture's log already records PID's kill
    assert records.reads_kernel_log
    assert records.evidence(PID) == ""


def test_watch_drops_kernel_records_of_an_earlier_process_with_the_same_pid(tmp_path: Path, kmsg: Path) -> None:
    records = _records(tmp_path, kmsg=kmsg)
    _append(kmsg, KILLED_KMSG.format(PID))
    records.watch(PID)  # the pid was reused by a new worker
    assert records.evidence(PID) == ""


def test_evidence_and_forget_drop_the_pid(tmp_path: Path, kmsg: Path) -> None:
    records = _records(tmp_path, kmsg=kmsg)
    records.watch(PID)
    records.watch(OTHER_PID)
    _append(kmsg, KILLED_KMSG.format(PID) + KILLED_KMSG.format(OTHER_PID))
    assert records.evidence(PID) != ""
    assert records.evidence(PID) == ""
    records.forget(OTHER_PID)
    assert records.evidence(OTHER_PID) == ""


def test_kernel_records_are_bounded_and_the_oldest_go_first(tmp_path: Path, kmsg: Path) -> None:
    records = _records(tmp_path, kmsg=kmsg)
    first_pid = 10_000
    _append(kmsg, "".join(KILLED_KMSG.format(first_pid + n) for n in range(KERNEL_RECORDS_KEPT + 1)))
    assert records.evidence(first_pid) == ""
    assert records.evidence(first_pid + 1) != ""
    assert records.evidence(first_pid + KERNEL_RECORDS_KEPT) != ""


def test_a_kernel_record_and_a_counter_rise_make_one_line(tmp_path: Path, kmsg: Path) -> None:
    control = _write(tmp_path / "cgroup/memory/jobs/worker/memory.oom_control", OOM_CONTROL.format(0))
    records = _records(tmp_path, V1_PROC, kmsg=kmsg)
    records.watch(PID)
    control.write_text(OOM_CONTROL.format(1))
    _append(kmsg, KILLED_KMSG.format(PID))
    evidence = records.evidence(PID)
    assert evidence.startswith("kernel: Memory cgroup out of memory: Killed process 4242 (python)")
    assert evidence.endswith(" (memory cgroup /jobs/worker: oom_kill 0 -> 1 (memory.oom_control))")


def test_a_counter_rise_the_readable_kernel_log_does_not_confirm_says_so(tmp_path: Path, kmsg: Path) -> None:
    control = _write(tmp_path / "cgroup/memory/jobs/worker/memory.oom_control", OOM_CONTROL.format(0))
    records = _records(tmp_path, V1_PROC, kmsg=kmsg)
    records.watch(PID)
    control.write_text(OOM_CONTROL.format(1))
    _append(kmsg, KILLED_KMSG.format(OTHER_PID))  # a sibling in the same cgroup was the one killed
    evidence = records.evidence(PID)
    assert evidence.startswith("memory cgroup /jobs/worker: oom_kill 0 -> 1 (memory.oom_control); ")
    assert "another process in the cgroup may be the one killed" in evidence


def test_an_unreadable_kernel_log_leaves_the_cgroup_counters_working(tmp_path: Path) -> None:
    control = _write(tmp_path / "cgroup/memory/jobs/worker/memory.oom_control", OOM_CONTROL.format(0))
    records = _records(tmp_path, V1_PROC, kmsg=tmp_path / "no-such-kmsg")
    assert not records.reads_kernel_log
    records.watch(PID)
    control.write_text(OOM_CONTROL.format(1))
    assert records.evidence(PID) == "memory cgroup /jobs/worker: oom_kill 0 -> 1 (memory.oom_control)"


def test_with_no_source_at_all_evidence_is_empty_and_nothing_raises(tmp_path: Path) -> None:
    records = OomRecords(cgroup_root=tmp_path / "none", proc_root=tmp_path / "none", kmsg=None)
    records.open()
    records.watch(PID)
    assert records.evidence(PID) == ""
    assert records.evidence(OTHER_PID) == ""  # never watched
    records.forget(PID)
    records.close()
    records.close()


def test_garbage_in_the_sources_is_no_evidence_and_raises_nothing(tmp_path: Path, kmsg: Path) -> None:
    _write(tmp_path / "cgroup/memory/jobs/worker/memory.oom_control", "oom_kill many\n")
    records = _records(tmp_path, "not a cgroup file\n" + V1_PROC, kmsg=kmsg)
    records.watch(PID)
    with kmsg.open("ab") as log:
        log.write(b"\xff\xfe;Killed process x (y)\n\x00\n")
    assert records.evidence(PID) == ""


def _memory_limited_cgroup(name: str) -> tuple[Path, Path] | None:
    """A new memory cgroup limited to REAL_LIMIT_BYTES: (its directory, its oom_kill counter file), or None."""
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    if (v1 / "memory.limit_in_bytes").exists():
        settings = {"memory.limit_in_bytes": REAL_LIMIT_BYTES, "memory.memsw.limit_in_bytes": REAL_LIMIT_BYTES}
        directory, counter = v1 / name, "memory.oom_control"
    elif "memory" in _read_or_empty(v2 / "cgroup.subtree_control").split():
        settings = {"memory.max": REAL_LIMIT_BYTES, "memory.swap.max": 0}
        directory, counter = v2 / name, "memory.events"
    else:
        return None
    try:
        directory.mkdir()
    except OSError:
        return None
    try:
        limit_file, *optional = settings
        (directory / limit_file).write_text(str(settings[limit_file]))
        for setting in optional:  # no swap accounting here: the limit alone still forces the OOM
            with contextlib.suppress(OSError):
                (directory / setting).write_text(str(settings[setting]))
    except OSError:
        _remove_cgroup(directory)
        return None
    return directory, directory / counter


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _remove_cgroup(directory: Path) -> None:
    for _ in range(RMDIR_ATTEMPTS):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(RMDIR_PAUSE_S)
    directory.rmdir()


def _oom_kills(counter_file: Path) -> int:
    for line in counter_file.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise AssertionError(f"no oom_kill line in {counter_file}")


@pytest.fixture
def memory_limited_cgroup() -> Iterator[tuple[Path, Path]]:
    made = _memory_limited_cgroup(f"stead-oom-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    if made is None:
        pytest.skip("cannot create a memory-limited cgroup here (needs root and a writable memory controller)")
    try:
        yield made
    finally:
        _remove_cgroup(made[0])


def test_a_real_oom_kill_is_recorded_by_the_kernel(memory_limited_cgroup: tuple[Path, Path]) -> None:
    directory, counter_file = memory_limited_cgroup
    records = OomRecords()
    records.open()
    child = subprocess.Popen([sys.executable, "-c", ALLOCATE_UNTIL_KILLED, str(directory / "cgroup.procs")])
    try:
        records.watch(child.pid)  # its baseline is the cgroup it starts in; it moves itself into the limited one
        child.wait(timeout=REAL_OOM_DEADLINE_S)
        assert child.returncode == -signal.SIGKILL
        evidence = records.evidence(child.pid)
        if records.reads_kernel_log:
            assert f"Killed process {child.pid} " in evidence
            assert f"task_memcg=/{directory.name}" in evidence
        else:
            assert _oom_kills(counter_file) >= 1
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        records.close()
