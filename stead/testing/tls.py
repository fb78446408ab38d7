"""Throw-away certificates for tests: a certificate authority and the server and client certificates it signs.

::

    ca = CertificateAuthority(tmp_path / "pki")
    server = ca.issue("etcd", server=True)                 # valid for 127.0.0.1, ::1 and localhost
    client = ca.issue("stead", client=True)
    grpc.ssl_channel_credentials(ca.ca_file.read_bytes(), client.key_file.read_bytes(),
                                 client.cert_file.read_bytes())

Keys are EC P-256 (made in milliseconds, accepted by etcd, grpc and OpenSSL),
written as PEM files readable by their owner only. Each authority is its own
root: a certificate of one is untrusted by a peer that trusts another, which is
how a test makes a wrong certificate. Used by :class:`~stead.testing.etcd.EtcdServer`
and by any test that needs TLS between real processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["LOOPBACK_HOSTS", "CertPair", "CertificateAuthority"]

#: the names a certificate is valid for by default: what a test reaches a loopback server by
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
#: how long the certificates are valid (a test run is far shorter; the start is back-dated for clock skew)
_VALID = datetime.timedelta(days=2)
_SKEW = datetime.timedelta(hours=1)


@dataclasses.dataclass(frozen=True)
class CertPair:
    """A certificate and its private key, as PEM files."""

    cert_file: Path
    key_file: Path


def _write_private(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


class CertificateAuthority:
    """A self-signed root written to ``directory/<name>-ca.pem``, which issues certificates into ``directory``."""

    def __init__(self, directory: Path, *, name: str = "stead-test") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW).not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256()))
        #: the authority's certificate: what a peer trusts (etcd's ``--trusted-ca-file``, stead's ``etcd_ca_file``)
        self.ca_file = self.directory / f"{name}-ca.pem"
        self.ca_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, server: bool = False, client: bool = False,
              hosts: Sequence[str] = LOOPBACK_HOSTS) -> CertPair:
        """A certificate for ``name`` signed by this authority, for TLS servers at ``hosts`` and/or clients.

        Written to ``<name>.pem`` and ``<name>-key.pem`` (mode 0600) in the authority's directory.
        """
        if not server and not client:
            raise ValueError(f"certificate {name!r} must be for a server, a client or both: pass server=True "
                             "and/or client=True")
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = [oid for oid, wanted in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                                          (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if wanted]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _SKEW).not_valid_after(now + _VALID)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                           critical=False))
        if server:
            builder = builder.add_extension(_alt_names(hosts), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = CertPair(cert_file=self.directory / f"{name}.pem", key_file=self.directory / f"{name}-key.pem")
        pair.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(pair.key_file, _key_pem(key))
        return pair
