"""Fixtures for the Kubernetes tests: a fake API server, a fake kubelet, and real clients of them.

``kube_api`` is a :class:`~tests.support.kube.FakeKubeApi` (bookmarks every 0.2 s so
that watch tests stay short); ``kubelet`` a :class:`~tests.support.kube.FakeKubelet` with
three nodes (``host-a``, ``host-b``, ``host-c``), the image ``stead:test`` (this
interpreter) and retries every 0.1 s (a missing Secret or image is looked for again
soon); ``kube_client`` a kubernetes_asyncio ``ApiClient`` for ``kube_api``, and
``core_v1`` its ``CoreV1Api``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from tests.support.kube import FakeKubeApi, FakeKubelet, local_image_env

#: the image every fake node knows: this interpreter, its venv first on PATH
TEST_IMAGE = "stead:test"


@pytest.fixture
async def kube_api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi(bookmark_interval_s=0.2) as api:
        yield api


@pytest.fixture
def kube_images() -> dict[str, Mapping[str, str]]:
    return {TEST_IMAGE: local_image_env()}


@pytest.fixture
async def kubelet(kube_api: FakeKubeApi, tmp_path: Path,
                  kube_images: dict[str, Mapping[str, str]]) -> AsyncIterator[FakeKubelet]:
    async with FakeKubelet(kube_api.url, root=tmp_path / "nodes", images=kube_images, retry_s=0.1) as fake:
        yield fake


@pytest.fixture
async def kube_client(kube_api: FakeKubeApi) -> AsyncIterator[Any]:
    async with client.ApiClient(kube_api.configuration()) as api_client:
        yield api_client


@pytest.fixture
def core_v1(kube_client: Any) -> Any:
    return client.CoreV1Api(kube_client)
