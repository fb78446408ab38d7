"""Mutual TLS between the master's server and its clients: real sockets, real grpclib, certificates made per test."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import structlog.testing

from stead.core.config import Settings
from stead.core.errors import ConfigError, HungUp, Unauthenticated
from stead.core.rpc import (
    AgentServicer,
    MasterClient,
    RegisterInfo,
    RpcServer,
    TlsFiles,
    client_context,
    client_tls,
    server_context,
    tls_files,
)
from stead.testing.tls import CertificateAuthority, CertPair

if TYPE_CHECKING:
    from tests.core.rpc.conftest import FakeBackend

pytestmark = pytest.mark.anyio

#: generous: a call on loopback takes milliseconds; this only bounds a broken test
CALL_TIMEOUT_S = 10.0

REGISTER = RegisterInfo(node_id="node-0", incarnation=1, host="host-a", pid=4242, nproc=2)


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "job", name="job")


@pytest.fixture
def host(ca: CertificateAuthority) -> TlsFiles:
    """The job's certificate, for the master and its clients alike (what `stead certs` makes)."""
    pair = ca.issue("host", server=True, client=True)
    return TlsFiles(ca.ca_file, pair.cert_file, pair.key_file)


@pytest.fixture
def stranger(tmp_path: Path) -> CertPair:
    """A certificate another CA signed."""
    return CertificateAuthority(tmp_path / "other", name="other").issue("stranger", server=True, client=True)


@pytest.fixture
async def tls_server(backend: FakeBackend, token: str, host: TlsFiles) -> AsyncIterator[RpcServer]:
    async with RpcServer([AgentServicer(backend)], token=token, tls=server_context(host)) as srv:
        yield srv


async def _register(address: str, token: str, tls: ssl.SSLContext | None) -> None:
    async with MasterClient(address, token, call_timeout_s=CALL_TIMEOUT_S, tls=tls) as client:
        await client.register(REGISTER)


@pytest.mark.parametrize("dial", ["127.0.0.1", "localhost"])
async def test_a_client_with_the_jobs_certificate_calls_a_tls_master(
        tls_server: RpcServer, backend: FakeBackend, token: str, host: TlsFiles, dial: str) -> None:
    await _register(f"{dial}:{tls_server.port}", token, client_context(host))
    assert [info.node_id for info in backend.registered] == ["node-0"]


async def test_the_job_token_is_still_checked_over_tls(
        tls_server: RpcServer, backend: FakeBackend, host: TlsFiles) -> None:
    with pytest.raises(Unauthenticated, match="wrong job token"):
        await _register(tls_server.address, "another-jobs-token", client_context(host))
    assert backend.calls == 0


def _no_certificate(host: TlsFiles) -> ssl.SSLContext:
    """A client that trusts the job's CA but shows no certificate of its own."""
    context = ssl.create_default_context(cafile=str(host.ca_file))
    context.set_alpn_protocols(["h2"])
    return context


@pytest.mark.parametrize("client", ["another CA's certificate", "no certificate"])
async def test_a_client_without_a_certificate_of_the_jobs_ca_is_refused_saying_tls_failed(
        tls_server: RpcServer, backend: FakeBackend, token: str, host: TlsFiles, stranger: CertPair,
        client: str) -> None:
    context = (client_context(TlsFiles(host.ca_file, stranger.cert_file, stranger.key_file))
               if client == "another CA's certificate" else _no_certificate(host))
    # no byte from the master: TLS refused the client (likely) or the master was at its connection limit, which a
    # retry would get past, so the error is retryable (HungUp) while it names TLS first
    with pytest.raises(HungUp, match=r"TLS with the master at .* likely failed: .*refused this client's "
                                     r"certificate.*tls_ca_file"):
        await _register(tls_server.address, token, context)
    assert backend.calls == 0


async def test_a_plain_text_client_of_a_tls_master_is_refused_saying_to_set_the_tls_settings(
        tls_server: RpcServer, backend: FakeBackend, token: str) -> None:
    with pytest.raises(HungUp, match=r"it serves TLS and this client does not \(set tls_ca_file"):
        await _register(tls_server.address, token, None)
    assert backend.calls == 0


async def test_a_client_refuses_a_master_whose_certificate_another_ca_signed(
        backend: FakeBackend, token: str, host: TlsFiles, stranger: CertPair) -> None:
    impostor = TlsFiles(host.ca_file, stranger.cert_file, stranger.key_file)
    async with RpcServer([AgentServicer(backend)], token=token, tls=server_context(impostor)) as srv:
        with pytest.raises(Unauthenticated, match="does not trust the master's certificate"):
            await _register(srv.address, token, client_context(host))
    assert backend.calls == 0


async def test_a_client_refuses_a_master_whose_certificate_does_not_name_the_address_it_dialled(
        backend: FakeBackend, token: str, host: TlsFiles, ca: CertificateAuthority) -> None:
    elsewhere = ca.issue("elsewhere", server=True, client=True, hosts=("10.1.2.3", "other.example"))
    misnamed = TlsFiles(ca.ca_file, elsewhere.cert_file, elsewhere.key_file)
    async with RpcServer([AgentServicer(backend)], token=token, tls=server_context(misnamed)) as srv:
        with pytest.raises(Unauthenticated, match=r"not valid for '127\.0\.0\.1'.*names the host or address"):
            await _register(srv.address, token, client_context(host))
    assert backend.calls == 0


async def test_a_tls_client_of_a_plain_text_master_says_the_master_runs_without_tls(
        backend: FakeBackend, token: str, host: TlsFiles) -> None:
    async with RpcServer([AgentServicer(backend)], token=token) as srv:
        with pytest.raises(Unauthenticated, match="answered in plain text: its master runs without the tls_"):
            await _register(srv.address, token, client_context(host))
    assert backend.calls == 0


def _settings(**values: object) -> Settings:
    return Settings.from_mapping({name: str(value) for name, value in values.items()})


def test_without_tls_settings_there_is_no_tls() -> None:
    assert tls_files(Settings()) is None
    assert client_tls(Settings()) is None


def test_the_three_settings_give_the_files(host: TlsFiles) -> None:
    settings = _settings(tls_ca_file=host.ca_file, tls_cert_file=host.cert_file, tls_key_file=host.key_file)
    assert tls_files(settings) == host
    assert client_tls(settings) is not None


@pytest.mark.parametrize("given", [("tls_ca_file",), ("tls_cert_file", "tls_key_file"),
                                   ("tls_ca_file", "tls_key_file")])
def test_some_but_not_all_tls_settings_are_a_config_error_naming_the_missing(host: TlsFiles,
                                                                             given: tuple[str, ...]) -> None:
    files = {"tls_ca_file": host.ca_file, "tls_cert_file": host.cert_file, "tls_key_file": host.key_file}
    missing = [name for name in files if name not in given]
    with pytest.raises(ConfigError, match=f"only {' and '.join(given)} (is|are) set: set {' and '.join(missing)} too "
                                          r"\(`stead certs"):
        tls_files(_settings(**{name: files[name] for name in given}))


@pytest.mark.parametrize("broken", ["tls_ca_file", "tls_cert_file", "tls_key_file"])
def test_a_missing_tls_file_is_a_config_error_naming_the_setting_and_file(
        host: TlsFiles, tmp_path: Path, broken: str) -> None:
    files = {"tls_ca_file": host.ca_file, "tls_cert_file": host.cert_file, "tls_key_file": host.key_file}
    files[broken] = tmp_path / "nowhere.pem"
    with pytest.raises(ConfigError, match=f"setting {broken}='.*nowhere.pem': cannot read the file"):
        tls_files(_settings(**files))


@pytest.mark.parametrize("broken", ["tls_ca_file", "tls_cert_file", "tls_key_file"])
def test_a_tls_file_that_is_not_pem_is_a_config_error_naming_the_setting_and_file(
        host: TlsFiles, tmp_path: Path, broken: str) -> None:
    files = {"tls_ca_file": host.ca_file, "tls_cert_file": host.cert_file, "tls_key_file": host.key_file}
    files[broken] = tmp_path / "notes.txt"
    files[broken].write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=f"setting {broken}='.*notes.txt': the file holds no PEM"):
        tls_files(_settings(**files))


def test_a_key_that_is_not_the_certificates_is_a_config_error_naming_both(host: TlsFiles, stranger: CertPair) -> None:
    mismatched = TlsFiles(host.ca_file, host.cert_file, stranger.key_file)
    for make in (server_context, client_context):
        with pytest.raises(ConfigError, match=r"tls_cert_file=.* and tls_key_file=.* are not a certificate and "
                                              r"its own private key"):
            make(mismatched)


@pytest.mark.parametrize("client", ["no certificate", "plain text"])
async def test_the_master_logs_a_tls_handshake_it_refused(
        tls_server: RpcServer, token: str, host: TlsFiles, client: str) -> None:
    context = _no_certificate(host) if client == "no certificate" else None
    with structlog.testing.capture_logs() as logs, pytest.raises(HungUp):
        await _register(tls_server.address, token, context)
    refused = [entry for entry in logs if entry["event"] == "rpc_tls_refused"]
    assert refused and "tls_ca_file" in refused[0]["hint"], logs
    assert refused[0]["log_level"] == "warning"


async def test_a_connection_that_never_starts_its_tls_handshake_is_closed_after_the_auth_timeout(
        backend: FakeBackend, token: str, host: TlsFiles) -> None:
    async with RpcServer([AgentServicer(backend)], token=token, tls=server_context(host), auth_timeout_s=0.2) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                assert await reader.read() == b""  # the server hung up on the silent stranger
        finally:
            writer.close()
