"""Fixtures: a job's ckpt plugin and node agents in this process (stead.plugins.ckpt.testing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stead.core.config import Settings
from stead.plugins.ckpt.testing import LocalCluster as Cluster

__all__ = ["Cluster"]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(ckpt_dir=str(tmp_path / "ckpt"), ckpt_commit_wait_s=5.0, ckpt_commit_poll_s=2.0,
                    ckpt_agent_timeout_s=30.0, ckpt_verify_wait_s=10.0, ckpt_persist_grace_s=30.0,
                    retry_deadline_s=5.0)


@pytest.fixture
def cluster(tmp_path: Path, settings: Settings) -> Iterator[Cluster]:
    with Cluster(tmp_path, settings, job="ckpt-test") as running:
        yield running
