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

``EtcdServer(tls=True)`` serves its clients over TLS with certificates made in
its directory (:mod:`stead.testing.tls`) and, unless ``client_cert_auth=False``,
accepts only clients with a certificate of its authority (``--client-cert-auth``).
``EtcdServer(auth=True)`` enables etcd's authentication: a ``root`` user and a
``stead`` user whose role may read and write every key, each with a random
password in a file (:meth:`EtcdServer.add_user` adds more).
:meth:`EtcdServer.client_settings` are the stead settings of a client that gets
in; :attr:`EtcdServer.url` carries none of them.

Without an ``etcd`` binary the tests are skipped on a developer machine, but
fail when the ``CI`` environment variable is set: CI must never silently skip them.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio.to_thread
import grpc
from aetcd import rpc

from stead.core.store import prefix_end
from stead.testing.steps import free_port
from stead.testing.tls import CertificateAuthority, CertPair

__all__ = ["ETCD_MISSING_HINT", "EtcdServer", "etcd_binary"]

ETCD_MISSING_HINT = "etcd not installed: run `make test` (installs etcd-server) or apt-get install etcd-server"
#: how often start() polls /health while etcd boots
_HEALTH_POLL_S = 0.05
#: the user stead's clients of an ``auth=True`` server log in as, and the prefix its role may read and write
STEAD_USER = "stead"
_STEAD_PREFIX = "/"


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

    def __init__(self, *, start_timeout_s: float = 30.0, stop_timeout_s: float = 10.0, tls: bool = False,
                 client_cert_auth: bool = True, auth: bool = False) -> None:
        self._binary = etcd_binary()
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._tls = tls
        self._client_cert_auth = tls and client_cert_auth
        self._auth = auth
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._client_port = 0
        self._peer_port = 0
        #: with ``tls``: the authority the server's and clients' certificates come from
        self.ca: CertificateAuthority | None = None
        self._server_pair: CertPair | None = None
        #: with ``tls`` and ``client_cert_auth``: a client certificate of the server's authority
        self.client_pair: CertPair | None = None
        #: with ``auth``: the password files of ``root`` and of :data:`STEAD_USER`
        self.root_password_file: Path | None = None
        self.password_file: Path | None = None

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client API."""
        if not self._client_port:
            raise RuntimeError("EtcdServer was never started; call start() or use it as a context manager")
        return f"127.0.0.1:{self._client_port}"

    @property
    def url(self) -> str:
        """The store URL, ``etcd://127.0.0.1:PORT`` (a secured server also needs :meth:`client_settings`)."""
        return f"etcd://{self.endpoint}"

    def client_settings(self) -> dict[str, str]:
        """The stead settings (``Settings.from_mapping``) of a client this server lets in: its CA and client
        certificate with ``tls``, the :data:`STEAD_USER` and its password file with ``auth``."""
        values: dict[str, str] = {}
        if self.ca is not None:
            values["etcd_ca_file"] = str(self.ca.ca_file)
            if self.client_pair is not None:
                values["etcd_cert_file"] = str(self.client_pair.cert_file)
                values["etcd_key_file"] = str(self.client_pair.key_file)
        if self.password_file is not None:
            values["etcd_user"] = STEAD_USER
            values["etcd_password_file"] = str(self.password_file)
            if self.ca is None:  # on loopback: a password in the clear reaches no one else
                values["etcd_allow_plaintext_password"] = "true"
        return values

    @property
    def _scheme(self) -> str:
        return "https" if self._tls else "http"

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
            if self._tls:
                self.ca = CertificateAuthority(self._dir / "pki", name="etcd-test")
                # client use too: etcd's JSON gateway dials its own gRPC server with this certificate
                self._server_pair = self.ca.issue("etcd-server", server=True, client=True)
                if self._client_cert_auth:
                    self.client_pair = self.ca.issue("etcd-client", client=True)
        for attempt in range(3):
            if first:  # a fresh pair of ports; another process may grab a port between probing and binding
                self._client_port, self._peer_port = free_port(), free_port()
            try:
                self._launch()
            except RuntimeError:
                if not first or attempt == 2:
                    raise
            else:
                break
        if first and self._auth:
            try:
                self._enable_auth()
            except BaseException:
                self.stop()
                raise

    def _tls_flags(self) -> list[str]:
        if self.ca is None or self._server_pair is None:
            return []
        flags = ["--cert-file", str(self._server_pair.cert_file), "--key-file", str(self._server_pair.key_file)]
        if self._client_cert_auth:
            flags += ["--client-cert-auth", "--trusted-ca-file", str(self.ca.ca_file)]
        return flags

    def _launch(self) -> None:
        assert self._dir is not None
        client = f"{self._scheme}://127.0.0.1:{self._client_port}"
        peer = f"http://127.0.0.1:{self._peer_port}"
        log_path = self._dir / "etcd.log"
        with log_path.open("ab") as log_file:
            self._process = subprocess.Popen(
                [self._binary, "--name", "stead-test", "--data-dir", str(self._dir / "data"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"stead-test={peer}", "--initial-cluster-state", "new",
                 "--heartbeat-interval", "10", "--election-timeout", "100", *self._tls_flags()],
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

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.ca is None:
            return None
        context = ssl.create_default_context(cafile=str(self.ca.ca_file))
        if self.client_pair is not None:
            context.load_cert_chain(self.client_pair.cert_file, self.client_pair.key_file)
        return context

    def _healthy(self, client: str) -> bool:
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1.0, context=self._ssl_context()) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    @contextlib.contextmanager
    def _auth_api(self, *, as_root: bool) -> Iterator[tuple[Any, tuple[tuple[str, str], ...]]]:
        """etcd's Auth service over gRPC (its JSON gateway ignores client certificates once auth is on), and the
        metadata of root's login (none before auth is on)."""
        if self.ca is not None:
            client = self.client_pair
            credentials = grpc.ssl_channel_credentials(
                self.ca.ca_file.read_bytes(), client.key_file.read_bytes() if client else None,
                client.cert_file.read_bytes() if client else None)
            channel = grpc.secure_channel(self.endpoint, credentials)
        else:
            channel = grpc.insecure_channel(self.endpoint)
        with channel:
            api = rpc.AuthStub(channel)
            metadata: tuple[tuple[str, str], ...] = ()
            if as_root:
                assert self.root_password_file is not None
                login = api.Authenticate(rpc.AuthenticateRequest(
                    name="root", password=self.root_password_file.read_text().strip()), timeout=self._start_timeout_s)
                metadata = (("token", login.token),)
            yield api, metadata

    def _add_user(self, api: Any, metadata: tuple[tuple[str, str], ...], name: str, prefix: str | None) -> Path:
        assert self._dir is not None
        password = secrets.token_urlsafe(16)
        path = self._dir / f"{name}.password"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        timeout = self._start_timeout_s
        api.UserAdd(rpc.AuthUserAddRequest(name=name, password=password), timeout=timeout, metadata=metadata)
        if prefix is None:
            api.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=name, role="root"), timeout=timeout, metadata=metadata)
            return path
        api.RoleAdd(rpc.AuthRoleAddRequest(name=name), timeout=timeout, metadata=metadata)
        permission = rpc.Permission(permType=rpc.Permission.READWRITE, key=prefix.encode(),
                                    range_end=prefix_end(prefix.encode()))
        api.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=name, perm=permission), timeout=timeout,
                                metadata=metadata)
        api.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=name, role=name), timeout=timeout, metadata=metadata)
        return path

    def _enable_auth(self) -> None:
        """Users ``root`` and :data:`STEAD_USER` (read and write under ``/``), random passwords in files, then
        authentication on."""
        with self._auth_api(as_root=False) as (api, metadata):
            self.root_password_file = self._add_user(api, metadata, "root", None)
            self.password_file = self._add_user(api, metadata, STEAD_USER, _STEAD_PREFIX)
            api.AuthEnable(rpc.AuthEnableRequest(), timeout=self._start_timeout_s)

    def add_user(self, name: str, *, prefix: str) -> Path:
        """A user (and role of its name) that may read and write the keys under ``prefix``; its password file."""
        with self._auth_api(as_root=True) as (api, metadata):
            return self._add_user(api, metadata, name, prefix)

    def forget_tokens(self) -> None:
        """Make etcd forget every login token it gave (authentication off and on again), as their expiry does."""
        with self._auth_api(as_root=True) as (api, metadata):
            api.AuthDisable(rpc.AuthDisableRequest(), timeout=self._start_timeout_s, metadata=metadata)
        with self._auth_api(as_root=False) as (api, metadata):
            api.AuthEnable(rpc.AuthEnableRequest(), timeout=self._start_timeout_s)

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
