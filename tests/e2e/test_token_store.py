"""A real `stead run` job keeps its token out of its store (sqlite, and a secured etcd: TLS, client certificate,
login given with --set), while it runs and after it ended."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from stead.core.config import Settings
from stead.core.jobtoken import verifier_key
from stead.core.store import open_store
from stead.testing.etcd import EtcdServer

pytestmark = pytest.mark.e2e

#: the worker scans the whole store while the job runs: every key, and whether any key or value holds the token
SCAN = """
import asyncio, json, os, sys
from stead.core.store import open_store

token = open(os.environ["STEAD_TOKEN_FILE"]).read().strip()

async def scan():
    store = await open_store(sys.argv[1])  # the etcd settings reach the worker as STEAD_ETCD_* variables
    try:
        return await store.range("/")
    finally:
        await store.close()

kvs = asyncio.run(scan())
json.dump({"token": token, "keys": [kv.key for kv in kvs],
           "holding": [kv.key for kv in kvs if token in kv.key or token.encode() in kv.value]}, open("scan.json", "w"))
"""


async def _holding(url: str, settings: Settings, token: str) -> tuple[list[str], list[str]]:
    store = await open_store(url, settings=settings)
    try:
        kvs = await store.range("/")
    finally:
        await store.close()
    return [kv.key for kv in kvs], [kv.key for kv in kvs if token in kv.key or token.encode() in kv.value]


@pytest.mark.parametrize("backend", ["sqlite", "etcd-secured"])
def test_no_key_or_value_of_the_store_holds_the_job_token_while_the_job_runs_or_after(
        run_job: Any, tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    job = f"tok-{uuid.uuid4().hex[:8]}"
    if backend == "sqlite":
        url, values = f"sqlite:///{tmp_path / 'state.db'}", {}
    else:
        server: EtcdServer = request.getfixturevalue("secure_etcd")
        url, values = server.url, server.client_settings()
    flags = ("--store", url, "--nproc-per-node", "1", *(f"--set={k}={v}" for k, v in values.items()))
    done = run_job(SCAN, url, job=job, flags=flags)
    assert done.returncode == 0, done.stderr[-6000:]
    during = json.loads((tmp_path / "scan.json").read_text())
    assert verifier_key(job) in during["keys"] and f"/stead/jobs/{job}/events/" in " ".join(during["keys"])
    assert during["holding"] == []
    keys, holding = asyncio.run(_holding(url, Settings.from_mapping(values), during["token"]))
    assert holding == [] and any(key.startswith(f"/stead/jobs/{job}/") for key in keys)
    assert verifier_key(job) not in keys  # the job ended: nobody needs its token any more
    assert not (tmp_path / ".stead" / f"{job}.token").exists()
    assert during["token"] not in done.stdout + done.stderr
