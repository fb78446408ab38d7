"""One job over several hosts whose `stead run`s elect its master through etcd (``--rdzv-backend etcd``): one
elected, the others hot standbys; the master's host killed, a standby takes the job over and no worker restarts.

etcd runs on a host of its own (tests.support.hosts_etcd). Each host runs `stead run` in a folder of its own, with
the same job token in its environment and ``GLOO_SOCKET_IFNAME`` set, as users set them.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.e2e.test_hosts_jobs import RUN_TIMEOUT_S, TRAIN, _env, _steps, _until_step
from tests.support.hosts import Host, test_hosts
from tests.support.hosts_etcd import etcd_on

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def _stead_run(host: Host, folder: Path, args: Sequence[str], token: str) -> asyncio.subprocess.Process:
    """`stead run ARGS` on ``host``, its stderr in ``folder/stderr`` (read while it runs)."""
    os.makedirs(folder, exist_ok=True)
    with open(folder / "stderr", "wb") as err:  # noqa: ASYNC230 (a local file, opened at once)
        return await host.spawn([sys.executable, "-m", "stead", "run", *args], env=_env(token), cwd=folder,
                                stdout=asyncio.subprocess.DEVNULL, stderr=err)


async def _ended(process: asyncio.subprocess.Process, folder: Path) -> tuple[int, str]:
    try:
        async with asyncio.timeout(RUN_TIMEOUT_S):
            await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"`stead run` did not end within {RUN_TIMEOUT_S} s: "
                             f"{(folder / 'stderr').read_text()[-3000:]}") from None
    assert process.returncode is not None
    return process.returncode, (folder / "stderr").read_text(errors="replace")


async def _until_said(folder: Path, text: str) -> None:
    async with asyncio.timeout(RUN_TIMEOUT_S):
        while text not in (folder / "stderr").read_text(errors="replace"):  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("how", ["killed", pytest.param("SIGTERM", marks=pytest.mark.extended(
    "a standby taking the job over with no worker restarted: the killed variant; a candidate whose master is "
    "killed and its lease ended, the next one taking the job over: tests/cli/test_elected.py"))])
@pytest.mark.long(40)
async def test_the_elected_master_s_host_lost_a_standby_takes_the_job_over_and_no_worker_restarts(
        tmp_path: Path, how: str) -> None:
    token = secrets.token_urlsafe(32)
    timestamps = tmp_path / "steps.log"
    async with test_hosts(4) as hosts, etcd_on(hosts[3]) as etcd:
        flags = ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd, "--rdzv-id", "elected",
                 "--rdzv-conf", "heartbeat=5"]  # the lease's TTL too: a starved candidate must not lose it
        script = [str(TRAIN), "--steps", "300", "--step-time", "0.03", "--timestamps", str(timestamps)]
        folders = [tmp_path / f"h{i}" for i in range(3)]
        first = await _stead_run(hosts[0], folders[0], [*flags, *script], token)
        await _until_said(folders[0], "this host was elected its master")
        others = [await _stead_run(hosts[i], folders[i], [*flags, *script], token) for i in (1, 2)]
        await _until_step(timestamps, 40, world=2)
        # the master's host ran no node: the job's two nodes went to the other hosts, and it stayed the spare
        assert "elected its master" not in (folders[1] / "stderr").read_text() + (folders[2] / "stderr").read_text()
        if how == "killed":  # every process on it at once (its master may still get a signal as its parent dies)
            await hosts.kill(0)
        else:  # its `stead run` told to stop (the machine shutting down): it hands the job over and leaves
            first.send_signal(signal.SIGTERM)
        ended = [await _ended(p, f) for p, f in zip(others, folders[1:], strict=True)]
        rc, out, err = await hosts[1].run([sys.executable, "-m", "stead", "events", "--job", "elected", "--store",
                                           f"etcd://{etcd}", "--json"], cwd=folders[1])
        await first.wait()
    if how == "SIGTERM":
        said = (folders[0] / "stderr").read_text()
        assert first.returncode == 143 and "hands the job to another host's master" in said, said[-3000:]
    assert all(code == 0 for code, _ in ended), [text[-3000:] for _, text in ended]
    said = "".join(text for _, text in ended)
    assert said.count("(taking the job over)") == 1, said[-4000:]
    assert rc == 0, err
    started = [line for line in out.splitlines() if '"node.started"' in line]
    assert len(started) == 2 and all('"h0"' not in line for line in started), started
    assert out.count('"round.started"') == 1, out[-3000:]  # no new round: the workers went on through the takeover
    steps = _steps(timestamps)
    assert steps == {(0, 0): 299, (1, 0): 299}, steps  # one incarnation of each rank, every step


async def test_hosts_that_name_an_etcd_no_one_serves_are_told_so(tmp_path: Path) -> None:
    async with test_hosts(1) as hosts:
        rc, _, err = await hosts[0].run(
            [sys.executable, "-m", "stead", "run", "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
             "10.77.0.9:2379", "--rdzv-id", "nowhere", str(TRAIN)], cwd=tmp_path,
            env=_env(secrets.token_urlsafe(32)))
    assert rc == 2, err
    assert "etcd at 10.77.0.9:2379 is unreachable" in err, err
