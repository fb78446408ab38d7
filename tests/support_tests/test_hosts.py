"""The test hosts (``tests.support.hosts``): real network namespaces on a bridge, each with its own hostname,
/dev/shm and /tmp; killed, restarted, partitioned and healed as the multi-host tests will."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import anyio
import pytest

from stead.testing.etcd import etcd_binary
from tests.support.hosts import REPO_ROOT, Hosts, namespaces, test_hosts, unavailable_reason

pytestmark = pytest.mark.anyio

PORT = 7000
#: a TCP server on a host: answers every connection with its hostname
SERVER = textwrap.dedent("""
    import socket, sys
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        conn, _ = server.accept()
        conn.sendall(socket.gethostname().encode())
        conn.close()
""")
#: a TCP client on a host: for each target, what the server there says, or ``unreachable``; ``wait`` retries until
#: reached (a bound for a link that just came up, not a measured duration)
CLIENT = textwrap.dedent("""
    import socket, sys, time
    wait, port = sys.argv[1] == "wait", int(sys.argv[2])
    for target in sys.argv[3:]:
        deadline = time.monotonic() + (20 if wait else 0)
        while True:
            try:
                with socket.create_connection((target, port), timeout=2 if wait else 1) as conn:
                    print(conn.recv(100).decode())
                break
            except OSError:
                if time.monotonic() > deadline:
                    print("unreachable")
                    break
                time.sleep(0.1)
""")


def running_pid(pid: int) -> bool:
    """Whether ``pid`` is still running (a zombie, dead and not yet reaped, has no namespaces left)."""
    try:
        os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return False
    return True


async def serve(hosts: Hosts, i: int) -> None:
    server = await hosts[i].spawn([sys.executable, "-I", "-c", SERVER, hosts[i].address, str(PORT)],
                                  stdout=subprocess.PIPE)
    assert server.stdout is not None
    assert await server.stdout.readline() == b"listening\n"


async def reach(hosts: Hosts, i: int, *targets: str, wait: bool = True) -> list[str]:
    rc, out, err = await hosts[i].run([sys.executable, "-I", "-c", CLIENT, "wait" if wait else "once", str(PORT),
                                      *targets])
    assert rc == 0, err
    return out.split()


async def test_hosts_reach_each_other_by_address_and_by_hostname() -> None:
    async with test_hosts(2) as hosts:
        assert [(h.name, h.address, h.ifname) for h in hosts] == [("h0", "10.77.0.1", "eth0"),
                                                                  ("h1", "10.77.0.2", "eth0")]
        await serve(hosts, 0)
        assert await reach(hosts, 1, "h0", "10.77.0.1") == ["h0", "h0"]
        for host in hosts:  # the local hostname resolves on the host itself, as gloo looks it up
            rc, out, err = await host.run([sys.executable, "-I", "-c", "import socket; n = socket.gethostname(); "
                                           "print(n, socket.gethostbyname(n))"])
            assert (rc, out.split()) == (0, [host.name, host.address]), err
            rc, out, _ = await host.run(["ip", "-o", "-4", "addr", "show", "dev", host.ifname])
            assert f"{host.address}/24" in out
        root = await anyio.run_process(["ip", "-o", "addr"])
        assert b"10.77." not in root.stdout  # the root namespace is never touched


async def test_dev_shm_and_tmp_are_private_per_host_and_shared_paths_are_visible(tmp_path: Path) -> None:
    name = f"stead-hosts-test-{uuid.uuid4().hex}"
    (tmp_path / "token").write_text("secret")
    async with test_hosts(2) as hosts:
        rc, _, err = await hosts[0].run(["bash", "-c", f"echo a > /dev/shm/{name} && echo b > /tmp/{name} && "
                                         f"cat {tmp_path}/token > {tmp_path}/from-h0"], cwd=tmp_path)
        assert rc == 0, err
        rc, out, _ = await hosts[0].run(["cat", f"/dev/shm/{name}", f"/tmp/{name}"])
        assert (rc, out.split()) == (0, ["a", "b"])
        rc, out, _ = await hosts[1].run(["ls", "-A", "/dev/shm", "/tmp"])
        assert name not in out
        assert not await anyio.Path(f"/dev/shm/{name}").exists() and not await anyio.Path(f"/tmp/{name}").exists()
        assert (tmp_path / "from-h0").read_text() == "secret"  # a shared path is the same directory everywhere
        rc, out, err = await hosts[1].run(["cat", "from-h0", str(REPO_ROOT / "pyproject.toml")], cwd=tmp_path)
        assert rc == 0 and out.startswith("secret"), err


async def test_a_shared_path_under_tmp_outside_pytest_is_visible_as_a_repo_cloned_there_is() -> None:
    clone = Path(tempfile.mkdtemp(prefix="stead-hosts-clone-", dir=tempfile.gettempdir()))  # as CI clones the repo
    try:
        (clone / ".venv").mkdir()
        (clone / ".venv" / "marker").write_text("venv\n")
        async with test_hosts(1, shared=(clone, clone / ".venv")) as hosts:  # one inside the other: bound once
            rc, out, err = await hosts[0].run(["bash", "-c", "cat .venv/marker && echo run > out && ls -A /tmp"],
                                              cwd=clone)
            assert rc == 0, err
            assert out.split() == ["venv", clone.name]  # the clone, and nothing else of the machine's /tmp
        assert (clone / "out").read_text() == "run\n"
    finally:
        shutil.rmtree(clone)


async def test_a_killed_host_loses_every_process_and_its_memory_and_restarts_empty() -> None:
    async with test_hosts(2) as hosts:
        rc, _, _ = await hosts[0].run(["bash", "-c", "echo x > /dev/shm/seg && echo y > /tmp/file"])
        assert rc == 0
        lone = await hosts[0].spawn(["sleep", "1000"])
        family = await hosts[0].spawn(["bash", "-c", "sleep 1000 & sleep 1000 & echo $! && wait"],
                                      stdout=subprocess.PIPE)
        assert family.stdout is not None
        grandchild = int(await family.stdout.readline())
        survivor = await hosts[1].spawn(["sleep", "1000"])
        on_h0 = hosts[0].processes()
        assert {lone.pid, family.pid, grandchild} <= on_h0 and survivor.pid not in on_h0

        await hosts.kill(0)
        assert await lone.wait() == -signal.SIGKILL and await family.wait() == -signal.SIGKILL
        assert not any(map(running_pid, on_h0))
        assert survivor.returncode is None
        with pytest.raises(RuntimeError, match="restart"):
            await hosts[0].run(["true"])

        await hosts.restart(0)
        rc, out, _ = await hosts[0].run(["bash", "-c", "hostname; ls -A /dev/shm; test -e /tmp/file || echo gone"])
        assert (rc, out.split()) == (0, ["h0", "gone"])  # /dev/shm empty, /tmp without the file written before
        assert hosts[0].processes() == {hosts[0].holder_pid}
        await serve(hosts, 0)
        assert await reach(hosts, 1, "h0") == ["h0"]
        survivor.kill()
        await survivor.wait()


async def test_a_partitioned_host_reaches_nobody_until_healed_and_keeps_its_processes() -> None:
    async with test_hosts(3) as hosts:
        await serve(hosts, 0)
        await serve(hosts, 2)
        assert await reach(hosts, 1, "h0") == ["h0"]
        sleeper = await hosts[1].spawn(["sleep", "1000"])
        await hosts.partition(1)
        assert await reach(hosts, 1, "h0", "h2", wait=False) == ["unreachable", "unreachable"]
        assert await reach(hosts, 2, "h0") == ["h0"]  # the others still reach each other
        await hosts.heal(1)
        assert await reach(hosts, 1, "h0", "h2") == ["h0", "h2"]
        assert sleeper.returncode is None and running_pid(sleeper.pid)  # cut off, not killed
        sleeper.kill()
        await sleeper.wait()

        await hosts.partition(0, 1)  # only between h0 and h1
        assert await reach(hosts, 1, "h0", "h2", wait=False) == ["unreachable", "h2"]
        assert await reach(hosts, 2, "h0") == ["h0"]
        await hosts.heal(0, 1)
        assert await reach(hosts, 1, "h0") == ["h0"]


async def test_nothing_is_left_after_exit_even_when_the_body_raises_with_a_host_killed() -> None:
    links = set(os.listdir("/sys/class/net"))
    before = namespaces()
    with pytest.raises(ValueError, match="the body failed"):
        async with test_hosts(2) as hosts:
            made = namespaces() - before
            assert len(made) == 3  # the switch and two hosts
            running = await hosts[1].spawn(["sleep", "1000"])
            holders = [h.holder_pid for h in hosts]
            await hosts.kill(0)
            raise ValueError("the body failed")
    assert namespaces() == before
    assert await running.wait() == -signal.SIGKILL
    assert not any(map(running_pid, holders))
    assert set(os.listdir("/sys/class/net")) == links  # no veth or bridge ever reached the root namespace


async def test_a_python_of_the_venv_imports_torch_on_a_host_and_reaches_etcd_on_another(tmp_path: Path) -> None:
    async with test_hosts(2) as hosts:
        url = f"http://{hosts[0].address}:2379"
        etcd = await hosts[0].spawn([etcd_binary(), "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls",
                                     url, "--advertise-client-urls", url], stderr=subprocess.DEVNULL)
        script = textwrap.dedent("""
            import sys, time, urllib.request
            import torch
            deadline = time.monotonic() + 30
            while True:
                try:
                    print(torch.__name__, urllib.request.urlopen("http://h0:2379/version", timeout=2).read().decode())
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        """)
        rc, out, err = await hosts[1].run([sys.executable, "-c", script], cwd=REPO_ROOT)
        assert rc == 0 and out.startswith("torch ") and "etcdserver" in out, err
        etcd.terminate()
        with anyio.fail_after(30):
            await etcd.wait()


def test_test_hosts_are_skipped_with_the_reason_where_a_tool_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    reason = unavailable_reason()
    assert reason is not None
    assert ("ip, nsenter" in reason and "PATH" in reason) or "root" in reason


def test_test_hosts_are_skipped_with_the_failing_command_where_namespaces_cannot_be_made() -> None:
    reason = unavailable_reason() or (None if shutil.which("setpriv") else "setpriv (util-linux) is not on PATH")
    if reason is not None:
        pytest.skip(reason)
    script = textwrap.dedent("""
        import anyio, pytest
        from tests.support.hosts import HostsUnavailable, namespaces, test_hosts

        async def main() -> None:
            try:
                async with test_hosts(2):
                    print("made")
            except pytest.skip.Exception as exc:
                print("skipped:", exc.msg)
            try:
                async with test_hosts(2, skip_unavailable=False):  # a benchmark's choice
                    print("made")
            except HostsUnavailable as exc:
                print("raised:", exc)
            print("left:", sorted(namespaces()))

        anyio.run(main)
    """)
    # root without CAP_SYS_ADMIN and CAP_NET_ADMIN, as in a container that may not make namespaces
    done = subprocess.run(["setpriv", "--bounding-set=-sys_admin,-net_admin", sys.executable, "-c", script],
                          cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    skipped, raised, left = done.stdout.splitlines()
    assert skipped.startswith("skipped: test hosts cannot be made here: `") and "ip netns add" in skipped
    assert "Operation not permitted" in skipped
    assert raised.startswith("raised: test hosts cannot be made here: `") and "Operation not permitted" in raised
    assert left == "left: []"
