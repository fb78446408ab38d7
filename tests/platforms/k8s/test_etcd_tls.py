"""The etcd of `stead k8s manifests --with-etcd`: generated certificates, a real etcd serving them with client TLS,
and the bootstrap that turns its authentication on (the Job `stead-etcd-auth`), run twice."""

from __future__ import annotations

import base64
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from stead.core.errors import ConfigError, PlatformError, PlatformUnavailable
from stead.platforms.k8s import etcd as etcd_manifests
from stead.platforms.k8s.etcd_auth import EtcdAuth, main
from stead.testing.etcd import etcd_binary
from tests.support.kube_validate import pod_security_violations, validate_builtin

#: a guard against an etcd that never starts, not a measured duration
START_TIMEOUT_S = 30.0


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _files(tmp_path: Path) -> dict[str, Path]:
    """The generated Secrets' keys as files, as the pods see them mounted."""
    files = {}
    for secret in etcd_manifests.generate_secrets("jobs"):
        for key, value in secret["stringData"].items():
            path = tmp_path / secret["metadata"]["name"] / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value)
            files[f"{secret['metadata']['name']}/{key}"] = path
    return files


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[str, dict[str, Path]]]:
    """A real etcd with the generated server certificate, requiring client certificates: (endpoint, files)."""
    files = _files(tmp_path)
    server = f"{etcd_manifests.SERVER_SECRET}/"
    client_port, peer_port = _free_port(), _free_port()
    endpoint = f"https://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    with (tmp_path / "etcd.log").open("wb") as log:
        process = subprocess.Popen(
            [etcd_binary(), "--name", "tls", "--data-dir", str(tmp_path / "data"), "--listen-client-urls", endpoint,
             "--advertise-client-urls", endpoint, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"tls={peer}", "--cert-file", str(files[server + "tls.crt"]),
             "--key-file", str(files[server + "tls.key"]), "--trusted-ca-file", str(files[server + "ca.crt"]),
             "--client-cert-auth", "--heartbeat-interval", "10", "--election-timeout", "100"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        probe = _client(endpoint, files)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                probe.call("maintenance/status", {})
                break
            except PlatformUnavailable:
                if process.poll() is not None or time.monotonic() > deadline:  # a guard against a hang, not a timing
                    pytest.fail(f"etcd with client TLS never answered:\n{(tmp_path / 'etcd.log').read_text()}")
                time.sleep(0.1)
        yield endpoint, files
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _client(endpoint: str, files: dict[str, Path]) -> EtcdAuth:
    client = f"{etcd_manifests.CLIENT_SECRET}/"
    return EtcdAuth(endpoint, ca_file=str(files[client + "ca.crt"]), cert_file=str(files[client + "tls.crt"]),
                    key_file=str(files[client + "tls.key"]))


def _bootstrap(endpoint: str, files: dict[str, Path], root_password: str | None = None) -> int:
    client, auth = f"{etcd_manifests.CLIENT_SECRET}/", f"{etcd_manifests.AUTH_SECRET}/"
    root_file = files[auth + "root-password"]
    if root_password is not None:
        root_file = root_file.with_name("other-root")
        root_file.write_text(root_password)
    return main(["--endpoint", endpoint, "--ca-file", str(files[client + "ca.crt"]),
                 "--cert-file", str(files[client + "tls.crt"]), "--key-file", str(files[client + "tls.key"]),
                 "--root-password-file", str(root_file), "--user", "stead",
                 "--password-file", str(files[auth + "password"]), "--prefix", "/stead/", "--wait-s", "5"])


def _put(etcd: EtcdAuth, key: str) -> dict[str, Any]:
    return etcd.call("kv/put", {"key": base64.b64encode(key.encode()).decode(), "value": "dg=="})


def test_the_bootstrap_turns_auth_on_once_and_stead_reads_and_writes_only_its_prefix(
        tls_etcd: tuple[str, dict[str, Path]], capsys: pytest.CaptureFixture[str]) -> None:
    endpoint, files = tls_etcd
    assert _bootstrap(endpoint, files) == 0
    assert "authentication turned on" in capsys.readouterr().out
    assert _bootstrap(endpoint, files) == 0  # the Job applied again, or retried: nothing to do
    assert "authentication was on already" in capsys.readouterr().out

    anonymous = _client(endpoint, files)  # a valid client certificate, no password: not enough
    with pytest.raises(PlatformError, match=r"user name is empty|permission denied|user name not found"):
        _put(anonymous, "/stead/jobs/x/events/1")
    stead = _client(endpoint, files)
    assert stead.login("stead", files[f"{etcd_manifests.AUTH_SECRET}/password"].read_text())
    _put(stead, "/stead/jobs/x/events/1")
    with pytest.raises(PlatformError, match="permission denied"):
        _put(stead, "/other/key")


def test_a_client_without_the_certificate_is_refused_at_the_handshake(tls_etcd: tuple[str, dict[str, Path]]) -> None:
    endpoint, files = tls_etcd
    context = ssl.create_default_context(cafile=str(files[f"{etcd_manifests.CLIENT_SECRET}/ca.crt"]))
    request = urllib.request.Request(f"{endpoint}/v3/maintenance/status", data=b"{}", method="POST")
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(request, timeout=10, context=context)


def test_a_root_password_etcd_does_not_have_is_one_clear_line(tls_etcd: tuple[str, dict[str, Path]],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    endpoint, files = tls_etcd
    assert _bootstrap(endpoint, files) == 0
    assert _bootstrap(endpoint, files, root_password="not-it") == 2
    assert "etcd refused 'root''s password" in capsys.readouterr().err


def test_etcd_that_never_answers_fails_after_the_wait(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _files(tmp_path)
    assert _bootstrap(f"https://127.0.0.1:{_free_port()}", files) == 1
    assert "cannot be reached" in capsys.readouterr().err


def test_a_missing_client_certificate_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"stead-etcd-client: ca\.crt, tls\.crt, tls\.key"):
        EtcdAuth("https://x:1", ca_file=str(tmp_path / "no.crt"), cert_file="c", key_file="k")


# -- the generated Secrets and the manifests ------------------------------------------------------------------------


def test_the_generated_certificates_name_the_service_and_chain_to_their_ca() -> None:
    server, client, auth = etcd_manifests.generate_secrets("jobs")
    ca = x509.load_pem_x509_certificate(server["stringData"]["ca.crt"].encode())
    for secret in (server, client):
        cert = x509.load_pem_x509_certificate(secret["stringData"]["tls.crt"].encode())
        cert.verify_directly_issued_by(ca)
        assert secret["stringData"]["ca.crt"] == server["stringData"]["ca.crt"]
        validate_builtin(secret)
    names = x509.load_pem_x509_certificate(server["stringData"]["tls.crt"].encode()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {"stead-etcd", "stead-etcd.jobs.svc", "stead-etcd.jobs.svc.cluster.local"} <= set(names)
    assert set(auth["stringData"]) == {"root-password", "password"}
    assert auth["stringData"]["root-password"] != auth["stringData"]["password"]
    assert etcd_manifests.generate_secrets("jobs")[2]["stringData"] != auth["stringData"]  # new ones each time


def test_etcd_serves_tls_only_to_clients_with_a_certificate_and_admits_only_stead_s_pods() -> None:
    service, stateful_set, policy, job = etcd_manifests.etcd("jobs", "stead:1")
    for obj in (service, stateful_set, policy, job):
        validate_builtin(obj)
    for workload in (stateful_set, job):
        assert pod_security_violations(workload, "restricted") == []
    args = stateful_set["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--client-cert-auth=true" in args and "--trusted-ca-file=/etc/etcd/tls/ca.crt" in args
    assert "--listen-client-urls=https://$(POD_IP):2379,https://127.0.0.1:2379" in args
    assert not [a for a in args if "0.0.0.0" in a or ("http://" in a and "listen-client" in a)]
    (rule,) = policy["spec"]["ingress"]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["egress"] == []
    assert rule["ports"] == [{"protocol": "TCP", "port": 2379}]
    selected = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert selected == [{"stead.dev/role": "master"}, {"app.kubernetes.io/name": "stead-operator"},
                        {"app.kubernetes.io/name": "stead-etcd-auth"}]
    assert all(peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "jobs"}}
               for peer in rule["from"])
    every = etcd_manifests.etcd("jobs", "stead:1", all_namespaces=True)[2]
    assert every["spec"]["ingress"][0]["from"][0]["namespaceSelector"] == {}  # masters of every namespace
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "stead.platforms.k8s.etcd_auth"]
