"""Fixtures: a job's ckpt plugin and node agents in this process (stead.plugins.ckpt.testing)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from stead.core.config import Settings
from stead.plugins.ckpt.settings import CheckpointSettings
from stead.plugins.ckpt.testing import LocalCluster as Cluster
from stead.testing import leaks

__all__ = ["Cluster"]


@pytest.fixture
def settings(tmp_path: Path) -> CheckpointSettings:
    return CheckpointSettings(dir=str(tmp_path / "ckpt"), commit_wait_s=5.0, commit_poll_s=2.0, agent_timeout_s=30.0,
                              verify_wait_s=10.0, persist_grace_s=30.0,
                              shm_namespace=os.environ[leaks.SHM_NAMESPACE_ENV])


@pytest.fixture
def cluster(tmp_path: Path, settings: CheckpointSettings) -> Iterator[Cluster]:
    with Cluster(tmp_path, settings, job="ckpt-test", stead_settings=Settings(retry_deadline_s=5.0)) as running:
        yield running


@pytest.fixture
def disk_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CheckpointSettings:
    """Settings for a checkpointer without an agent (it reads and writes the disk alone), whatever the environment
    of the test run says."""
    for name in ("STEAD_CKPT_PATH", "STEAD_CKPT_SOCKET", "STEAD_CKPT_STEP"):
        monkeypatch.delenv(name, raising=False)
    return CheckpointSettings(dir=str(tmp_path / "ckpt"))
