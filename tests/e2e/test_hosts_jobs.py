"""One job over several hosts (network namespaces, tests.support.hosts), each typing the same torchrun command line.

The hosts share the repository and the test's folder as machines share a filesystem; each has its own address,
/dev/shm and /tmp. Every host runs `stead run` in a folder of its own (its `.stead/`), with the same job token in
its environment and ``GLOO_SOCKET_IFNAME`` set, as users set them.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support.history import SHARDED_SCRIPT, surviving_history
from tests.support.hosts import IFNAME, Host, test_hosts

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
#: the bound on one `stead run` (a test that hangs fails with its output instead of at the suite's timeout)
RUN_TIMEOUT_S = 150.0


def _env(token: str, *, ifname: bool = True) -> dict[str, str]:
    env = {**os.environ, "STEAD_JOB_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    return {**env, "GLOO_SOCKET_IFNAME": IFNAME} if ifname else env


async def _stead_run(host: Host, folder: Path, args: Sequence[str], token: str, *,
                     ifname: bool = True) -> asyncio.subprocess.Process:
    os.makedirs(folder, exist_ok=True)
    return await host.spawn([sys.executable, "-m", "stead", "run", *args], env=_env(token, ifname=ifname),
                            cwd=folder, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def _ended(process: asyncio.subprocess.Process) -> tuple[int, str]:
    try:
        async with asyncio.timeout(RUN_TIMEOUT_S):
            _, err = await process.communicate()
    except TimeoutError:
        process.kill()
        _, err = await process.communicate()
        raise AssertionError(f"`stead run` did not end within {RUN_TIMEOUT_S} s: {err.decode()[-3000:]}") from None
    assert process.returncode is not None
    return process.returncode, err.decode(errors="replace")


def _steps(timestamps: Path) -> dict[tuple[int, int], int]:
    """The last step each (rank, restart) reached, from examples/train.py's --timestamps lines."""
    last: dict[tuple[int, int], int] = {}
    for line in timestamps.read_text().splitlines():
        rank, restart, step, _ = line.split()
        if not step.isdigit():
            continue  # the crash's own line
        last[int(rank), int(restart)] = max(last.get((int(rank), int(restart)), -1), int(step))
    return last


async def _events(host: Host, folder: Path, job: str) -> list[dict[str, object]]:
    rc, out, err = await host.run([sys.executable, "-m", "stead", "events", "--job", job, "--json"], cwd=folder)
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]
@pytest.mark.extended("two hosts on a static command line (--master-addr, --node-rank) training one job: the "
                      "mutual-TLS test below; a crash recovered across hosts: the chaos schedule across hosts")
async def test_a_static_torchrun_command_line_on_two_hosts_trains_one_job_and_recovers_a_crash(
        tmp_path: Path) -> None:
    token = secrets.token_urlsafe(32)
    timestamps = tmp_path / "steps.log"
    async with test_hosts(2) as hosts:
        flags = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", hosts[0].address, "--master-port",
                 "29500", "--max-restarts", "1", "--job-name", "mh"]
        script = [str(TRAIN), "--steps", "40", "--crash-at-step", "15", "--crash-rank", "1",
                  "--timestamps", str(timestamps)]
        # the joining host first, as often happens: it waits for the master
        joining = await _stead_run(hosts[1], tmp_path / "h1", [*flags, "--node-rank", "1", *script], token)
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, "--node-rank", "0", *script], token)
        (rc0, err0), (rc1, err1) = await asyncio.gather(_ended(serving), _ended(joining))
        assert rc0 == 0, err0[-3000:]
        assert rc1 == 0, err1[-3000:]
        events = await _events(hosts[0], tmp_path / "h0", "mh")
    assert "this host serves its master at 10.77.0.1:29500" in err0
    assert "joined job mh" in err1 and "job mh succeeded" in err1  # the job's outcome, told by its master
    # one job of world size 2: both ranks on their hosts, the crash of rank 1 (host h1) restarted in place
    steps = _steps(timestamps)
    assert steps[(0, 1)] == steps[(1, 1)] == 39, steps
    assert steps[(1, 0)] < 15, steps
    started = {(e["data"]["node_id"], e["data"]["host"]) for e in events if e["type"] == "node.started"}  # type: ignore[index]
    assert started == {("node-0", "h0"), ("node-1", "h1")}, started
    rounds = [e["data"]["members"] for e in events if e["type"] == "round.started"]  # type: ignore[index]
    assert rounds == [["node-0", "node-1"]] * 2, rounds  # the first, and the one after the crash
    assert not (tmp_path / "h1" / ".stead" / "mh.db").exists()  # one event log: on the master's host only


@pytest.mark.long(21)
async def test_a_c10d_endpoint_makes_its_host_the_master_and_a_host_that_disagrees_is_refused(
        tmp_path: Path) -> None:
    token = secrets.token_urlsafe(32)
    async with test_hosts(2) as hosts:
        flags = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:29400",
                 "--rdzv-id", "elastic-mh"]
        script = [str(TRAIN), "--steps", "20"]
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, *script], token)
        # another script's arguments: not the same job, refused on that host, the job unharmed
        other = await _stead_run(hosts[1], tmp_path / "h1", [*flags, str(TRAIN), "--steps", "21"], token)
        rc, err = await _ended(other)
        assert rc == 2, err[-3000:]
        assert "does not mean the same job" in err and "--steps 21" in err, err[-3000:]
        # a wrong token: refused too
        wrong = await _stead_run(hosts[1], tmp_path / "h1", [*flags, *script], secrets.token_urlsafe(32))
        rc, err = await _ended(wrong)
        assert rc == 2 and "refused the job token" in err and "same STEAD_JOB_TOKEN" in err, err[-3000:]
        # no GLOO_SOCKET_IFNAME here: the agent gives its workers the interface it reaches the master from
        joining = await _stead_run(hosts[1], tmp_path / "h1", [*flags, *script], token, ifname=False)
        (rc0, err0), (rc1, err1) = await asyncio.gather(_ended(serving), _ended(joining))
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert "this host serves its master at 10.77.0.1:29400" in err0
    assert "joined job elastic-mh" in err1
    assert "worker_interface_chosen" in err1 and "ifname=eth0" in err1, err1[-3000:]
    assert "worker_interface_chosen" not in err0  # the user chose it there


async def test_a_host_without_the_job_token_is_told_how_to_share_it(tmp_path: Path) -> None:
    async with test_hosts(1) as hosts:
        rc, _, err = await hosts[0].run(
            [sys.executable, "-m", "stead", "run", "--nnodes", "2", "--node-rank", "1", "--master-addr",
             "10.77.0.9", str(TRAIN)], cwd=tmp_path, env={**os.environ, "STEAD_JOB_TOKEN": ""})
    assert rc == 2, err
    assert "needs the same job token on every host: set STEAD_JOB_TOKEN" in err, err


async def test_a_master_address_that_does_not_resolve_is_said_at_once(tmp_path: Path) -> None:
    async with test_hosts(1) as hosts:
        rc, _, err = await hosts[0].run(
            [sys.executable, "-m", "stead", "run", "--nnodes", "2", "--node-rank", "1", "--master-addr",
             "no-such-host.invalid", str(TRAIN)], cwd=tmp_path, env=_env(secrets.token_urlsafe(32)))
    assert rc == 2, err
    assert "the job's master address no-such-host.invalid:29500 does not resolve on this host" in err, err


@pytest.mark.long(18)
async def test_hosts_with_mutual_tls_train_one_job_and_a_host_without_the_certificates_is_refused(
        tmp_path: Path) -> None:
    token = secrets.token_urlsafe(32)
    certs = tmp_path / "certs"  # on the filesystem every host shares, as users share them (or copy them)
    async with test_hosts(2) as hosts:
        rc, _, err = await hosts[0].run([sys.executable, "-m", "stead", "certs", "--job", "tls-mh", "--dir",
                                           str(certs), "--host", hosts[0].address, "--host", "h0"])
        assert rc == 0, err
        files = {"ca": "ca.pem", "cert": "host.pem", "key": "host-key.pem"}
        tls = [arg for name, file in files.items() for arg in ("--set", f"tls_{name}_file={certs / file}")]
        flags = ["--nnodes", "2", "--master-addr", hosts[0].address, "--master-port", "29500", "--job-name", "tls-mh"]
        script = [str(TRAIN), "--steps", "20"]
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, "--node-rank", "0", *tls, *script], token)
        plain = await _stead_run(hosts[1], tmp_path / "h1", [*flags, "--node-rank", "1", *script], token)
        rc, err = await _ended(plain)
        assert rc == 2 and "TLS with the master at 10.77.0.1:29500 likely failed" in err, err[-3000:]
        assert "it serves TLS and this client does not" in err and "3 times in a row" in err, err[-3000:]
        joining = await _stead_run(hosts[1], tmp_path / "h1", [*flags, "--node-rank", "1", *tls, *script], token)
        (rc0, err0), (rc1, err1) = await asyncio.gather(_ended(serving), _ended(joining))
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0 and "job tls-mh succeeded" in err1, err1[-3000:]


async def _until_step(timestamps: Path, step: int, world: int) -> None:
    """Until ranks 0 to ``world - 1`` have reached ``step`` in one round (examples/train.py's --timestamps)."""
    def reached() -> bool:
        steps = _steps(timestamps) if timestamps.exists() else {}
        return any(all(steps.get((rank, restart), -1) >= step for rank in range(world)) for _, restart in steps)

    async with asyncio.timeout(RUN_TIMEOUT_S):
        while not reached():  # noqa: ASYNC110 (another process writes the file: nothing to wait on)
            await asyncio.sleep(0.1)


@pytest.mark.extended("a killed host's node on the spare: tests/e2e/test_replicated_commit.py; no spare, the job "
                      "shrinking: tests/e2e/test_slurm.py's platform test, on the same hosts platform")
@pytest.mark.parametrize(("nnodes", "hosts_n", "killed", "why"), [
    ("2:2", 3, 1, "a spare host (it offered itself while the job was at MAX) takes the lost host's place"),
    ("2:3", 3, 2, "no spare: the job shrinks to the hosts it has and goes on"),
])
async def test_a_host_killed_costs_its_node_and_the_job_goes_on(tmp_path: Path, nnodes: str, hosts_n: int,
                                                                 killed: int, why: str) -> None:
    token = secrets.token_urlsafe(32)
    timestamps = tmp_path / "steps.log"
    async with test_hosts(hosts_n) as hosts:
        flags = ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:29400",
                 # the default heartbeat timeout (5 s): a 2-core machine running two whole-job tests at once
                 # starved every agent's heartbeats for 3 s in one run, and the killed host must be the only loss
                 "--rdzv-id", "lost-host", "--rdzv-conf", "heartbeat=5",
                 "--set", f"ckpt.dir={tmp_path / 'checkpoints'}"]  # a filesystem every host reads, as users have
        script = [str(TRAIN), "--steps", "150", "--save-every", "5",
                  "--timestamps", str(timestamps)]
        world = int(nnodes.split(":")[1])
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, *script], token)
        joining = [await _stead_run(hosts[i], tmp_path / f"h{i}", [*flags, *script], token)
                   for i in range(1, world)]
        await _until_step(timestamps, 20, world=world)  # every host's node in the round
        if hosts_n > world:  # the spare: it offers itself while the job is at MAX
            joining.append(await _stead_run(hosts[world], tmp_path / f"h{world}", [*flags, *script], token))
            await asyncio.sleep(3.0)  # (its offer is taken within a second)
        await hosts.kill(killed)  # every process on it at once, its memory with them
        rc0, err0 = await _ended(serving)
        survivors = [await _ended(p) for i, p in enumerate(joining, start=1) if i != killed]
        events = await _events(hosts[0], tmp_path / "h0", "lost-host")
    assert rc0 == 0, (why, err0[-3000:])
    assert all(rc == 0 for rc, _ in survivors), (why, [err[-2000:] for _, err in survivors])
    # the killed host's node ended once: as its host hung up (its processes' sockets closed by the kernel), or,
    # where its last keepalive came too long before, by the heartbeat timeout
    lost = [e["data"] for e in events if e["type"] == "node.lost"  # (not the one retired as the job shrank)
            and not e["data"]["reason"].startswith("retired")]  # type: ignore[index]
    hung_up = [e["data"] for e in events if e["type"] == "node.exited"
               and "hung up" in e["data"]["reason"]]  # type: ignore[index]
    assert len(lost) + len(hung_up) == 1, (lost, hung_up)
    started = [(e["data"]["node_id"], e["data"]["incarnation"], e["data"]["host"])  # type: ignore[index]
               for e in events if e["type"] == "node.started"]
    ended = [(d["node_id"], d["incarnation"]) for d in lost + hung_up]
    assert [host for node, incarnation, host in started if (node, incarnation) in ended] == [f"h{killed}"], started
    rounds = [e["data"]["members"] for e in events if e["type"] == "round.started"]  # type: ignore[index]
    if nnodes == "2:2":  # the lost node again, on the spare host; two nodes to the end
        assert ("node-1", 1, "h1") in started and ("node-1", 2, "h2") in started, started
        assert len(rounds[-1]) == 2, rounds
    else:  # the job went on with the two nodes left
        assert len(rounds[0]) == 3 and len(rounds[-1]) == 2, rounds
        assert any(e["type"] == "node.pending" for e in events), [e["type"] for e in events]
    last = _steps(timestamps)
    assert max(last.values()) == 149, last


@pytest.mark.long(45)
@pytest.mark.extended("a lost host's node resuming on the spare from a peer host's memory, no disk read, the status "
                      "line: tests/e2e/test_replicated_commit.py (steps faster than the copies)")
async def test_a_lost_host_s_node_resumes_from_its_newest_committed_step_held_in_a_peer_host_s_memory(
        tmp_path: Path) -> None:
    """Each host keeps its checkpoints on a disk of its own (the default ckpt.dir, in each host's own folder): the
    spare that takes the lost host's place can read none of them, so the step it resumes from is the replica of its
    rank that another host held in memory (ckpt.replicas, 1 by default), and nothing committed is trained again."""
    token = secrets.token_urlsafe(32)
    timestamps = tmp_path / "steps.log"
    async with test_hosts(3) as hosts:
        flags = ["--nnodes", "2:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:29400",
                 "--rdzv-id", "replicas", "--rdzv-conf", "heartbeat=5"]
        # a step takes several replica transfers of this small model, so the newest commit is usually in place
        script = [str(TRAIN), "--steps", "120", "--save-every", "1", "--step-time", "0.05", "--timestamps",
                  str(timestamps)]
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, *script], token)
        joining = [await _stead_run(hosts[1], tmp_path / "h1", [*flags, *script], token)]
        await _until_step(timestamps, 15, world=2)
        joining.append(await _stead_run(hosts[2], tmp_path / "h2", [*flags, *script], token))  # the spare
        await asyncio.sleep(3.0)
        killed_at = time.time()
        await hosts.kill(1)
        (rc0, err0), (rc2, err2) = await _ended(serving), await _ended(joining[1])
        events = await _events(hosts[0], tmp_path / "h0", "replicas")
        rc, status, _ = await hosts[0].run([sys.executable, "-m", "stead", "status", "--job", "replicas"],
                                           cwd=tmp_path / "h0")
    assert (rc0, rc2, rc) == (0, 0, 0), (err0[-3000:], err2[-3000:], status)
    restored = [e["data"] for e in events if e["type"] == "ckpt.restored"]
    after = restored[-1]  # the round the spare joined: rank 0 from its own memory, rank 1 from h0's replica
    assert (after["memory_ranks"], after["peer_ranks"], after["disk_ranks"]) == (1, 1, 0), restored  # type: ignore[index]
    resumed = [int(step) for rank, _, step, at in (line.split() for line in timestamps.read_text().splitlines())
               if rank == "1" and step.isdigit() and float(at) > killed_at]
    assert resumed and min(resumed) == after["step"] + 1, (after, resumed[:3])  # type: ignore[operator]
    assert f"restored   last: step {after['step']}: memory 1, peer 1" in status, status
    assert max(_steps(timestamps).values()) == 119
    # the killed host's node ended once (its host hung up, or its heartbeats stopped) and came back on the spare
    ended = [e["data"] for e in events if (e["type"] == "node.lost" and not e["data"]["reason"].startswith("retired"))
             or (e["type"] == "node.exited" and "hung up" in e["data"]["reason"])]  # type: ignore[index]
    assert len(ended) == 1, ended
    started = [(e["data"]["node_id"], e["data"]["host"]) for e in events if e["type"] == "node.started"]  # type: ignore[index]
    assert started[-1] == (ended[0]["node_id"], "h2"), started  # type: ignore[index]


@pytest.mark.long(55)
@pytest.mark.extended("a node given up for want of room and asked for again once there is: tests/e2e/test_k8s.py's "
                      "failing-host test; a job growing back to MAX: tests/e2e/test_scale.py")
async def test_a_lost_host_that_comes_back_grows_the_job_again_at_once(tmp_path: Path) -> None:
    token = secrets.token_urlsafe(32)
    timestamps = tmp_path / "steps.log"
    async with test_hosts(3) as hosts:
        flags = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:29400",
                 "--rdzv-id", "back", "--rdzv-conf", "heartbeat=3"]
        script = [str(TRAIN), "--steps", "500", "--step-time", "0.03", "--timestamps", str(timestamps)]
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, *script], token)
        joining = [await _stead_run(hosts[i], tmp_path / f"h{i}", [*flags, *script], token) for i in (1, 2)]
        await _until_step(timestamps, 20, world=3)
        await hosts.kill(2)
        async with asyncio.timeout(RUN_TIMEOUT_S):  # the job goes on with two (the scaler gave up on the third)
            while not any(e["type"] == "scaler.pending"  # noqa: ASYNC110 (another process writes the log)
                          for e in await _events(hosts[0], tmp_path / "h0", "back")):
                await asyncio.sleep(0.5)
        await hosts.restart(2)
        back = await _stead_run(hosts[2], tmp_path / "h2-again", [*flags, *script], token)
        (rc0, err0), (rc1, err1), (rc2, err2) = [await _ended(p) for p in (serving, joining[0], back)]
        await _ended(joining[1])
        events = await _events(hosts[0], tmp_path / "h0", "back")
    assert (rc0, rc1, rc2) == (0, 0, 0), (err0[-2000:], err1[-2000:], err2[-2000:])
    rounds = [e["data"]["members"] for e in events if e["type"] == "round.started"]  # type: ignore[index]
    assert len(rounds[0]) == 3 and 2 in [len(r) for r in rounds] and len(rounds[-1]) == 3, rounds
    room = [e for e in events if e["type"] == "platform.room" and "h2" in e["data"]["reason"]]  # type: ignore[index]
    grown = [e["seq"] for e in events if e["type"] == "round.started" and len(e["data"]["members"]) == 3]  # type: ignore[index]
    [gave_up] = [e["seq"] for e in events if e["type"] == "scaler.pending"]
    assert any(gave_up < r["seq"] < grown[-1] for r in room), (room, gave_up, grown)  # type: ignore[operator]
    started = [(e["data"]["node_id"], e["data"]["host"]) for e in events if e["type"] == "node.started"]  # type: ignore[index]
    assert started[-1][1] == "h2", started  # the node asked for again went to the host that came back


@pytest.mark.long(52)
@pytest.mark.extended("a stalled round found from the job's pace and restarted: tests/e2e/test_hang.py; a partition "
                      "across hosts healed: the chaos quick schedule across hosts")
async def test_a_partition_between_workers_alone_ends_in_a_restarted_round_not_a_hang(tmp_path: Path) -> None:
    """h1 and h2 cannot reach each other, both still reach the master (on h0): their collective stops, the hang
    is found from the job's pace (diagnosis.hang_floor_s) and the round restarts; once the link heals, a new round
    trains to the end."""
    token = secrets.token_urlsafe(32)
    timestamps = tmp_path / "steps.log"
    async with test_hosts(3) as hosts:
        flags = ["--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:29400",
                 "--rdzv-id", "split", "--max-restarts", "20", "--set", "diagnosis.hang_floor_s=3"]
        script = [str(TRAIN), "--steps", "200", "--step-time", "0.03", "--timestamps", str(timestamps)]
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, *script], token)
        joining = [await _stead_run(hosts[i], tmp_path / f"h{i}", [*flags, *script], token) for i in (1, 2)]
        await _until_step(timestamps, 30, world=3)
        await hosts.partition(1, 2)  # only between h1 and h2: both still reach h0, the master's host
        async with asyncio.timeout(RUN_TIMEOUT_S):  # the stalled round is found and restarted
            while not any(e["type"] == "recovery.decided"  # noqa: ASYNC110 (another process writes the log)
                          for e in await _events(hosts[0], tmp_path / "h0", "split")):
                await asyncio.sleep(0.5)
        await hosts.heal(1, 2)
        (rc0, err0), (rc1, err1), (rc2, err2) = [await _ended(p) for p in (serving, *joining)]
        events = await _events(hosts[0], tmp_path / "h0", "split")
    assert (rc0, rc1, rc2) == (0, 0, 0), (err0[-3000:], err1[-2000:], err2[-2000:])
    [end] = [e["seq"] for e in events if e["type"] == "job.succeeded"]
    gone = [e for e in events if e["type"] in ("node.lost", "node.exited") and e["seq"] < end]  # type: ignore[operator]
    assert not gone, gone  # no node was taken for lost: the master reached every host
    rounds = [e["data"]["members"] for e in events if e["type"] == "round.started"]  # type: ignore[index]
    assert len(rounds) >= 2 and all(len(r) == 3 for r in rounds), rounds
    last = _steps(timestamps)
    assert max(last.values()) == 199, last


@pytest.mark.extended("a host cut off past the heartbeat timeout, every sample read once: the chaos quick schedule "
                      "across hosts (its partition fault)")
async def test_a_host_partitioned_past_the_heartbeat_timeout_is_lost_and_every_sample_is_still_read_once(
        tmp_path: Path) -> None:
    # every host in one shared folder (a home directory on NFS, say): the script's own checkpoint and the data
    # history it logs are where every rank reads them
    token = secrets.token_urlsafe(32)
    (tmp_path / "train.py").write_text(SHARDED_TRAIN)
    (tmp_path / "faults.json").write_text("[]")
    (tmp_path / "logs").mkdir()
    async with test_hosts(3) as hosts:
        flags = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:29400",
                 "--rdzv-id", "cut", "--rdzv-conf", "heartbeat=3", "--max-restarts", "3"]
        script = ["train.py", str(SHARDED_N), "2", "3"]
        serving = await _stead_run(hosts[0], tmp_path, [*flags, *script], token)
        joining = [await _stead_run(hosts[i], tmp_path, [*flags, *script], token) for i in (1, 2)]
        await _until_logged(tmp_path / "logs", steps=4, world=3)
        await hosts.partition(2)  # its link down for twice the heartbeat timeout: its processes run on, cut off
        await asyncio.sleep(6.0)
        await hosts.heal(2)
        (rc0, err0), (rc1, err1), (rc2, err2) = [await _ended(p) for p in (serving, *joining)]
        events = await _events(hosts[0], tmp_path, "cut")
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0 and rc2 == 0, (err1[-2000:], err2[-2000:])
    lost = [e for e in events if e["type"] == "node.lost" and "no heartbeat" in e["data"]["reason"]]  # type: ignore[index]
    assert len(lost) == 1, lost
    gone = lost[0]["data"]  # type: ignore[index]
    # fenced: nothing the lost incarnation's agent said after its loss was taken (no failure, no step, no start)
    # before the node started again (the healed host's offer is room: the job may grow back onto it at once)
    again = min([e["seq"] for e in events if e["type"] == "node.started" and e["seq"] > lost[0]["seq"]  # type: ignore[operator]
                 and e["data"]["node_id"] == gone["node_id"]], default=len(events) + 1)  # type: ignore[index]
    after = [e for e in events if lost[0]["seq"] < e["seq"] < again and e["data"].get("node_id") == gone["node_id"]  # type: ignore[index, operator, union-attr]
             and e["data"].get("incarnation", 1) == gone["incarnation"] and e["type"].startswith("worker")]  # type: ignore[index, union-attr]
    assert after == [], after
    rounds = [e["data"]["members"] for e in events if e["type"] == "round.started"]  # type: ignore[index]
    assert len(rounds[0]) == 3 and len(rounds[1]) == 2, rounds  # it went on with the hosts it could reach
    history, worlds = surviving_history(tmp_path / "logs")
    assert worlds[0] == 3 and worlds[1] == 2, worlds
    for epoch in range(2):  # every sample exactly once per epoch, across the loss
        ids = collections.Counter(i for _, _, e, batch in history if e == epoch for i in batch)
        twice = sorted(i for i, n in ids.items() if n > 1)
        assert not twice and set(ids) <= set(range(SHARDED_N)), f"epoch {epoch}: read twice: {twice[:20]}"
        # the healed host's offer grows the job back to 3 at once: a lockstep round of 3 that starts mid-epoch
        # leaves out that epoch's last (remaining % 3) samples, as DistributedSampler(drop_last=True) does
        # (stead.plugins.sharding.lockstep); rounds of 2 over the even remainder leave none
        missing = set(range(SHARDED_N)) - set(ids)
        assert len(missing) < 3 * sum(1 for w in worlds if w == 3), f"epoch {epoch}: never read: {sorted(missing)}"


#: the sharded-data job of tests/e2e/test_sharding.py, a little slower per step so that a host can be cut off
#: while it trains
SHARDED_N = 240
SHARDED_TRAIN = SHARDED_SCRIPT.replace("        stead.report_step(step)\n",
                                       "        stead.report_step(step)\n        time.sleep(0.1)\n")
assert SHARDED_TRAIN != SHARDED_SCRIPT, "the sharded job's script changed: slow its steps another way"


async def _until_logged(logs: Path, *, steps: int, world: int) -> None:
    """Until every rank of a round of ``world`` ranks has logged ``steps`` steps of data."""
    def done() -> bool:
        for round_ in {p.stem.split("-")[0] for p in logs.glob("*.jsonl")}:
            counts = [len((logs / f"{round_}-{r}.jsonl").read_text().splitlines()) - 1
                      if (logs / f"{round_}-{r}.jsonl").exists() else 0 for r in range(world)]
            if min(counts) >= steps:
                return True
        return False

    async with asyncio.timeout(RUN_TIMEOUT_S):
        while not done():  # noqa: ASYNC110 (other processes write the files: nothing to wait on)
            await asyncio.sleep(0.1)


@pytest.mark.extended("a killed master restarted and its nodes adopted: tests/e2e/test_master_crash.py; the master's "
                      "host lost across hosts: tests/e2e/test_hosts_elected.py")
async def test_the_master_killed_on_its_host_is_restarted_there_and_the_other_host_s_node_is_adopted(
        tmp_path: Path) -> None:
    token = secrets.token_urlsafe(32)
    timestamps = tmp_path / "steps.log"
    async with test_hosts(2) as hosts:
        flags = ["--nnodes", "2", "--master-addr", hosts[0].address, "--master-port", "29500", "--job-name", "mk"]
        script = [str(TRAIN), "--steps", "150", "--timestamps", str(timestamps)]
        serving = await _stead_run(hosts[0], tmp_path / "h0", [*flags, "--node-rank", "0", *script], token)
        joining = await _stead_run(hosts[1], tmp_path / "h1", [*flags, "--node-rank", "1", *script], token)
        await _until_step(timestamps, 20, world=2)
        rc, out, err = await hosts[0].run([sys.executable, "-m", "stead", "status", "--job", "mk", "--json"],
                                          cwd=tmp_path / "h0")
        assert rc == 0, err
        rc, _, err = await hosts[0].run(["kill", "-9", str(json.loads(out)["master_pid"])])
        assert rc == 0, err
        (rc0, err0), (rc1, err1) = await asyncio.gather(_ended(serving), _ended(joining))
        events = await _events(hosts[0], tmp_path / "h0", "mk")
    assert rc0 == 0 and "starting a new one" in err0, err0[-3000:]
    assert rc1 == 0 and "job mk succeeded" in err1, err1[-3000:]
    # no worker restarted: one round, each rank stepped from 0 to the end in its first incarnation
    assert [e["type"] for e in events].count("round.started") == 1
    assert _steps(timestamps) == {(0, 0): 149, (1, 0): 149}
