"""Certificates for mutual TLS: a certificate authority and the certificates it signs, as PEM bytes.

``stead certs`` makes a per-job authority and one certificate every host of the job
uses, as server and as client; ``stead k8s manifests --etcd-generate-certs`` makes
the optional etcd's; :mod:`stead.testing.tls` makes throw-away ones for tests. Keys
are EC P-256 (made in milliseconds, accepted by OpenSSL, grpc and etcd); a
certificate's start is back-dated an hour so that hosts whose clocks differ a little
accept it at once.
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

__all__ = ["Authority", "Issued", "write_private"]

#: how far a certificate's start is back-dated, for clocks that differ between hosts
_SKEW = datetime.timedelta(hours=1)


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes


def write_private(path: Path, data: bytes, *, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` readable by its owner only (mode 0600); an existing file is an error unless
    ``overwrite`` (FileExistsError)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _alt_names(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _name(common: str) -> x509.Name:
    """``O=stead`` and, unless empty, ``CN=common`` (a client certificate for etcd has none: see k8s/etcd.py)."""
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "stead")]
    if common:
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common))
    return x509.Name(attributes)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                         decipher_only=False)


class Authority:
    """A self-signed root (in memory) that signs certificates; each authority trusts only its own."""

    def __init__(self, name: str, *, valid: datetime.timedelta) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(f"{name} CA")
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW).not_valid_after(now + valid)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256()))
        self._valid = valid

    @property
    def own(self) -> Issued:
        """The authority's own certificate (what peers trust) and key (what signs: keep it private)."""
        return Issued(cert_pem=self._cert.public_bytes(serialization.Encoding.PEM), key_pem=_key_pem(self._key))

    def issue(self, name: str, *, server: bool, client: bool, hosts: Sequence[str]) -> Issued:
        """A certificate for ``name`` (its common name; "" for none), valid for TLS servers at ``hosts`` (IP addresses
        become IP SANs, names DNS SANs) and/or for clients."""
        if not server and not client:
            raise ValueError(f"certificate {name!r} must be for a server, a client or both: pass server=True "
                             "and/or client=True")
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = [oid for oid, wanted in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                                          (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if wanted]
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self._cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _SKEW)
            .not_valid_after(now + self._valid)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                           critical=False))
        if server:
            builder = builder.add_extension(_alt_names(hosts), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(cert_pem=cert.public_bytes(serialization.Encoding.PEM), key_pem=_key_pem(key))
