"""A real etcd server on a test host (tests.support.hosts), at the host's address, for jobs whose hosts elect their
master (``--rdzv-backend etcd``)::

    async with test_hosts(4) as hosts, etcd_on(hosts[3]) as endpoint:   # "10.77.0.4:PORT"
        ...

The server is a single-member cluster with short raft timings (as :class:`stead.testing.etcd.EtcdServer`'s), its
data in the host's private /tmp: killing the host loses it. Its port is one the host's kernel picked; it is
stopped (and waited for) on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator

from stead.testing.etcd import etcd_binary
from tests.support.hosts import Host

__all__ = ["etcd_on"]

#: how long etcd may take to report healthy
START_TIMEOUT_S = 30.0

_FREE_PORTS = """
import socket
for _ in range(2):
    s = socket.socket()
    s.bind(('{a}', 0))
    print(s.getsockname()[1])
"""
_HEALTHY = """
import sys, time, urllib.request
deadline = time.monotonic() + {timeout}
while time.monotonic() < deadline:
    try:
        if b'true' in urllib.request.urlopen('http://{endpoint}/health', timeout=1).read():
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.05)
sys.exit(1)
"""


@contextlib.asynccontextmanager
async def etcd_on(host: Host) -> AsyncIterator[str]:
    """etcd serving at ``host``'s address; yields its client endpoint ``ADDRESS:PORT``."""
    rc, out, err = await host.run([sys.executable, "-c", _FREE_PORTS.format(a=host.address)])
    assert rc == 0, err
    client_port, peer_port = out.split()
    client, peer = f"http://{host.address}:{client_port}", f"http://{host.address}:{peer_port}"
    process = await host.spawn(
        [etcd_binary(), "--name", "stead-hosts", "--data-dir", f"/tmp/etcd-{host.name}",
         "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"stead-hosts={peer}",
         "--initial-cluster-state", "new", "--heartbeat-interval", "10", "--election-timeout", "100"],
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        endpoint = f"{host.address}:{client_port}"
        rc, _, _ = await host.run([sys.executable, "-c", _HEALTHY.format(timeout=START_TIMEOUT_S, endpoint=endpoint)])
        if rc != 0:
            process.kill()
            _, log = await process.communicate()
            raise AssertionError(f"etcd on {host.name} did not become healthy: {log.decode()[-2000:]}")
        yield endpoint
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await process.communicate()
            except TimeoutError:
                process.kill()
                await process.wait()
