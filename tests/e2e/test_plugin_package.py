"""A third-party plugin as a newcomer writes it from the README: built, pip-installed, type-checked, run.

The package's files are taken from the README's "Writing a plugin" section, so the
tutorial cannot drift from what works. The package is installed with pip into a
directory of the test's own (``--target``), never into the test environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.readme import readme_files

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TRAIN = """
import time, stead
for step in range(12):
    stead.report_step(step)
    time.sleep(0.15)
"""


def _pip_install(source: Path, target: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _env(*paths: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}


@pytest.mark.long(30)
def test_the_readme_plugin_installs_type_checks_runs_with_its_settings_and_records_its_events(
        tmp_path: Path) -> None:
    files = readme_files()
    assert {"stead-notes/pyproject.toml", "stead-notes/stead_notes/__init__.py", "stead-notes/test_notes.py"} <= set(
        files), sorted(files)
    for path, body in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    package = tmp_path / "stead-notes"
    plugins = tmp_path / "plugin-site"
    _pip_install(package, plugins)
    assert (plugins / "stead_notes" / "__init__.py").exists()

    # typed against the installed stead, as a plugin author's CI would check it (py.typed, stead.plugin)
    stead_site = tmp_path / "stead-site"
    _pip_install(ROOT, stead_site)
    assert (stead_site / "stead" / "py.typed").exists()
    mypy = subprocess.run([str(BIN / "mypy"), "--strict", "--no-incremental", "--python-executable", sys.executable,
                           str(package / "stead_notes")], cwd=tmp_path, env=_env(stead_site),
                          capture_output=True, text=True, timeout=600)
    assert mypy.returncode == 0, mypy.stdout[-3000:] + mypy.stderr[-2000:]

    # the README's own test of the plugin, with stead.testing
    test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_notes.py"],
                          cwd=package, env=_env(plugins), capture_output=True, text=True, timeout=300)
    assert test.returncode == 0, test.stdout[-3000:]

    # a real job: discovered, configured with its own --set, its own event kind in `stead events`
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    run = [sys.executable, "-m", "stead", "run", "--job-name", "notes", "--set", "progress_interval_s=0.05",
           "--set", "notes.every=2", "--set", "notes.label=hello", "train.py"]
    job = subprocess.run(run, cwd=tmp_path, env=_env(plugins), capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    events = subprocess.run([sys.executable, "-m", "stead", "events", "--job", "notes"], cwd=tmp_path,
                            env=_env(plugins), capture_output=True, text=True, timeout=60)
    assert events.returncode == 0, events.stderr
    notes = [line for line in events.stdout.splitlines() if "notes.seen" in line]
    assert notes and all("label=hello" in line for line in notes), events.stdout
    steps = [int(re.search(r"step=(\d+)", line).group(1)) for line in notes]  # type: ignore[union-attr]
    assert steps and all(step % 2 == 0 for step in steps)
    assert "plugins.started" in events.stdout and "notes" in events.stdout

    # its settings are checked like stead's own
    bad = subprocess.run([*run[:-1], "--set", "notes.often=1", "train.py"], cwd=tmp_path, env=_env(plugins),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "unknown setting 'notes.often'; settings of the notes plugin: notes.every=100, notes.label='notes'" \
        in bad.stderr
    assert "Traceback" not in bad.stderr
