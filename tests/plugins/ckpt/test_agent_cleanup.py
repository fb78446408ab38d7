"""`stead agent --cleanup`: the checkpoint extension frees the segments a killed agent left, and only those."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stead.cli.run_args import parse_run_args
from stead.core.runspec import RUN_SPEC_ENV, spec_text
from stead.plugins.ckpt._shm import SHM_DIR, create_segment, segment_names, unlink_quietly
from stead.testing.leaks import SHM_NAMESPACE_ENV


def test_the_cleanup_of_a_killed_agent_frees_its_segments_and_no_other_incarnation_s(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    namespace = os.environ[SHM_NAMESPACE_ENV]
    killed = segment_names("cj", "node-0", 4, namespace)
    other = segment_names("cj", "node-0", 5, namespace)
    names = [killed.control(0), killed.data(0, 1, 2), other.control(0)]
    for name in names:
        create_segment(name, 4096)
    try:
        argv = ["--job-name", "cj", "--set", f"ckpt.shm_namespace={namespace}", "train.py"]
        done = subprocess.run([sys.executable, "-m", "stead", "agent", "--cleanup", "--master", "127.0.0.1:1",
                               "--token-file", "unused", "--node-id", "node-0", "--incarnation", "4"],
                              env={**os.environ, RUN_SPEC_ENV: spec_text(parse_run_args(argv, cwd=str(tmp_path)))},
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert killed.all_mine() == [], "the killed agent's segments are still there"
        assert other.all_mine() == [other.control(0)], "another incarnation's segment was freed"
    finally:
        for name in names:
            unlink_quietly(name)
    assert not [n for n in names if (SHM_DIR / n).exists()]
