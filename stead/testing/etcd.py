"""A real, throw-away etcd server on loopback for tests and benchmarks.

``EtcdServer`` starts the ``etcd`` binary on two free loopback ports (client and
peer) with a temporary data directory, waits until it reports healthy, and on
exit stops it and removes the directory. ``stop()`` and ``start()`` simulate
the store going down and coming back (same URL, same data); ``kill()`` takes it
down as a crash does (SIGKILL), ``pause()``/``resume()`` freeze it (SIGSTOP and
SIGCONT: connections stay open and nothing answers, as with a hung server or a
partition). Raft timings are
shortened so that a single-member cluster elects itself at once and etcd's
minimum lease TTL is one second, which keeps lease tests short.

Without an ``etcd`` binary the tests are skipped on a developer machine, but
fail when the ``CI`` environment variable is set: CI must never silently skip them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import anyio.to_thread

from stead.testing.steps import free_port

__all__ = ["ETCD_MISSING_HINT", "EtcdServer", "etcd_binary"]

ETCD_MISSING_HINT = "etcd not installed: run `make test` (installs etcd-server) or apt-get install etcd-server"
#: how often start() polls /health while etcd boots
_HEALTH_POLL_S = 0.05


def etcd_binary() -> str:
    """The path of ``etcd``; skips the calling test when it is missing (fails instead when ``CI`` is set)."""
    path = shutil.which("etcd")
    if path is not None:
        return path
    if os.environ.get("CI"):
        raise RuntimeError(f"{ETCD_MISSING_HINT} (CI is set, and CI must run the etcd tests, not skip them)")
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(ETCD_MISSING_HINT)
    raise RuntimeError(ETCD_MISSING_HINT)


class EtcdServer:
    """A single-member etcd cluster on 127.0.0.1; use as ``with EtcdServer() as etcd:`` (or ``async with``)."""

    def __init__(self, *, start_timeout_s: float = 30.0, stop_timeout_s: float = 10.0) -> None:
        self._binary = etcd_binary()
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._client_port = 0
        self._peer_port = 0

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client API."""
        if not self._client_port:
            raise RuntimeError("EtcdServer was never started; call start() or use it as a context manager")
        return f"127.0.0.1:{self._client_port}"

    @property
    def url(self) -> str:
        """The store URL, ``etcd://127.0.0.1:PORT``."""
        return f"etcd://{self.endpoint}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start etcd (again, on the same ports and data after stop()) and wait until it is healthy."""
        if self.running:
            return
        first = self._dir is None
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="stead-etcd-"))
        for attempt in range(3):
            if first:  # a fresh pair of ports; another process may grab a port between probing and binding
                self._client_port, self._peer_port = free_port(), free_port()
            try:
                self._launch()
                return
            except RuntimeError:
                if not first or attempt == 2:
                    raise

    def _launch(self) -> None:
        assert self._dir is not None
        client = f"http://127.0.0.1:{self._client_port}"
        peer = f"http://127.0.0.1:{self._peer_port}"
        log_path = self._dir / "etcd.log"
        with log_path.open("ab") as log_file:
            self._process = subprocess.Popen(
                [self._binary, "--name", "stead-test", "--data-dir", str(self._dir / "data"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"stead-test={peer}", "--initial-cluster-state", "new",
                 "--heartbeat-interval", "10", "--election-timeout", "100"],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._process = None
                raise RuntimeError(f"etcd exited during start-up; its log ends with:\n{self._log_tail()}")
            if self._healthy(client):
                return
            time.sleep(_HEALTH_POLL_S)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {self._start_timeout_s}s; "
                           f"its log ends with:\n{self._log_tail()}")

    def _healthy(self, client: str) -> bool:
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1.0) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _log_tail(self) -> str:
        assert self._dir is not None
        with contextlib.suppress(OSError):
            return "\n".join((self._dir / "etcd.log").read_text(errors="replace").splitlines()[-20:])
        return "(no log)"

    def stop(self) -> None:
        """Stop etcd (SIGTERM, then SIGKILL), keeping its data for a later start()."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a paused etcd cannot act on SIGTERM
            process.terminate()
            try:
                process.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def kill(self) -> None:
        """SIGKILL etcd (a crash: nothing flushed beyond what etcd's WAL holds), keeping its data for start()."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): its ports stay open, no request is answered until resume()."""
        if self._process is None or self._process.poll() is not None:
            raise RuntimeError("etcd is not running; start() it before pausing it")
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused etcd run again (SIGCONT)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop etcd and delete its data directory."""
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EtcdServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> EtcdServer:
        try:
            await anyio.to_thread.run_sync(self.start)
        except BaseException:
            self.close()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await anyio.to_thread.run_sync(self.close)
