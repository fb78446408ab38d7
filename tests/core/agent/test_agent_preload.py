"""Workers tell their agent which installed packages they imported; the zygote imports them too."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stead.core.agent.progress import ProgressFiles
from stead.core.agent.zygote import Zygote

SCRIPT = "import numpy, stead\nstead.report_step(0)\nstead.report_step(1)\n"


def test_the_first_report_records_the_installed_packages_a_worker_imported() -> None:
    with ProgressFiles([0]) as files:
        assert files.imported(0) == []
        subprocess.run([sys.executable, "-c", SCRIPT], env={**files.env(0)}, check=True, timeout=60)
        imported = files.imported(0)
    assert "numpy" in imported
    assert all("." not in name for name in imported)


@pytest.mark.anyio
async def test_the_zygote_preloads_reported_packages_without_starting_threads() -> None:
    async with Zygote(preload=()) as zygote:
        assert await zygote.wait_ready()
        failed = await zygote.preload(["json", "no_such_package_xyz"])
    assert set(failed) == {"no_such_package_xyz"}
