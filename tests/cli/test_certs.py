"""`stead certs`: a per-job CA and certificate whose printed settings give a working mutual TLS master and client."""

from __future__ import annotations

import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from cryptography import x509

from stead.cli.certs import make_certs
from stead.core.config import Settings
from stead.core.events import JobSubmitted
from stead.core.master import Master, MasterConfig
from stead.core.rpc import (
    AgentServicer,
    MasterClient,
    RegisterInfo,
    RegisterResult,
    RpcServer,
    client_tls,
    new_token,
    server_context,
    tls_files,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _certs(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stead", "certs", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def _printed_settings(stdout: str) -> dict[str, str]:
    line = next(line for line in stdout.splitlines() if line.startswith("--set tls_ca_file="))
    words = shlex.split(line)
    return dict(word.split("=", 1) for word in words[1::2])


class _Backend:
    """A master that only registers (the one call these tests make)."""

    def __init__(self) -> None:
        self.registered: list[str] = []

    async def register(self, info: RegisterInfo) -> RegisterResult:
        self.registered.append(info.node_id)
        return RegisterResult(job="j", heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, store_host="127.0.0.1",
                              store_port=1, progress_interval_s=1.0)


def _make(tmp_path: Path) -> dict[str, str]:
    """`stead certs` for loopback, its printed settings checked: absolute paths of files that exist, keys private."""
    out = _certs("--job", "demo", "--dir", "pki", "--host", "127.0.0.1", "--host", "localhost", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    values = _printed_settings(out.stdout)
    assert set(values) == {"tls_ca_file", "tls_cert_file", "tls_key_file"}
    assert all(Path(path).is_absolute() and Path(path).exists() for path in values.values())
    for name in values:
        assert f"export STEAD_{name.upper()}=" in out.stdout
    for key in ("ca-key.pem", "host-key.pem"):
        assert stat.S_IMODE((tmp_path / "pki" / key).stat().st_mode) == 0o600
    return values


async def test_the_printed_settings_serve_and_call_over_mutual_tls(tmp_path: Path) -> None:
    settings = Settings.from_mapping(_make(tmp_path))
    files = tls_files(settings)
    assert files is not None
    backend, token = _Backend(), new_token()
    async with RpcServer([AgentServicer(backend)], token=token, tls=server_context(files)) as srv:  # type: ignore[arg-type]
        for dial in ("127.0.0.1", "localhost"):
            async with MasterClient(f"{dial}:{srv.port}", token, call_timeout_s=10,
                                    tls=client_tls(settings)) as client:
                await client.register(RegisterInfo(node_id=f"via-{dial}", incarnation=1, host="h", pid=1, nproc=1))
    assert backend.registered == ["via-127.0.0.1", "via-localhost"]


def test_existing_files_are_kept_unless_force(tmp_path: Path) -> None:
    assert _certs("--job", "demo", "--dir", "pki", "--host", "127.0.0.1", cwd=tmp_path).returncode == 0
    ca = (tmp_path / "pki" / "ca.pem").read_bytes()
    again = _certs("--job", "demo", "--dir", "pki", "--host", "127.0.0.1", cwd=tmp_path)
    assert again.returncode == 2
    assert "exist already" in again.stderr and "--force" in again.stderr
    assert (tmp_path / "pki" / "ca.pem").read_bytes() == ca
    forced = _certs("--job", "demo", "--dir", "pki", "--host", "127.0.0.1", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "pki" / "ca.pem").read_bytes() != ca


def test_by_default_the_certificate_names_this_machine_and_loopback(tmp_path: Path) -> None:
    out = _certs("--job", "demo", "--dir", "pki", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cert = x509.load_pem_x509_certificate((tmp_path / "pki" / "host.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]
    assert socket.gethostname() in dns and "localhost" in dns and "127.0.0.1" in ips


def test_a_host_that_is_no_name_or_address_is_refused(tmp_path: Path) -> None:
    out = _certs("--job", "demo", "--dir", "pki", "--host", "not a host", cwd=tmp_path)
    assert out.returncode == 2
    assert "--host 'not a host' is neither an IP address nor a host name" in out.stderr
    assert not (tmp_path / "pki").exists()


async def _scale_a_tls_master(tmp_path: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """`stead scale` of a job whose master serves TLS: with the tls_* settings, and without."""
    values = make_certs(job="grow", directory=tmp_path / "pki", hosts=["127.0.0.1"])
    settings = Settings.from_mapping({name: str(path) for name, path in values.items()})
    url = f"sqlite:///{tmp_path / 'grow.db'}"
    config = MasterConfig(job="grow", store_url=url, plugins=["scaler"], tcp_store=False, settings=settings,
                          token_file=str(tmp_path / ".stead" / "grow.token"))
    scale = [sys.executable, "-m", "stead", "scale", "--store", url, "--job", "grow", "--nodes", "2"]
    sets = [word for name, path in values.items() for word in ("--set", f"{name}={path}")]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*scale, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=60)

    async with Master(config) as master:
        await master.submit_job(JobSubmitted(job="grow", min_nodes=1, max_nodes=3, nproc_per_node=1, start_nodes=1))
        return {"with": await anyio.to_thread.run_sync(lambda: run(*sets)),
                "without": await anyio.to_thread.run_sync(run)}


def test_stead_scale_calls_a_tls_master_with_the_settings_and_is_refused_without_them(tmp_path: Path) -> None:
    said = anyio.run(_scale_a_tls_master, tmp_path)
    assert said["with"].returncode == 0, said["with"].stderr
    assert "job 'grow': target 2 nodes (was 1)" in said["with"].stdout
    assert said["without"].returncode != 0
    refused = said["without"].stderr
    assert "it serves TLS and this client does not (set tls_ca_file" in refused, refused[-3000:]
    assert "Traceback" not in refused
