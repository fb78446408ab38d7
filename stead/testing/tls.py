"""Throw-away certificates for tests: a certificate authority and the server and client certificates it signs.

::

    ca = CertificateAuthority(tmp_path / "pki")
    server = ca.issue("etcd", server=True)                 # valid for 127.0.0.1, ::1 and localhost
    client = ca.issue("stead", client=True)
    grpc.ssl_channel_credentials(ca.ca_file.read_bytes(), client.key_file.read_bytes(),
                                 client.cert_file.read_bytes())

Keys are EC P-256 (see :mod:`stead.core.certs`, which makes them), written as
PEM files, the keys readable by their owner only. Each authority is its own
root: a certificate of one is untrusted by a peer that trusts another, which is
how a test makes a wrong certificate. Used by :class:`~stead.testing.etcd.EtcdServer`
and by any test that needs TLS between real processes.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from pathlib import Path

from stead.core.certs import Authority, write_private

__all__ = ["LOOPBACK_HOSTS", "CertPair", "CertificateAuthority"]

#: the names a certificate is valid for by default: what a test reaches a loopback server by
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
#: how long the certificates are valid (a test run is far shorter; the start is back-dated for clock skew)
_VALID = datetime.timedelta(days=2)


@dataclasses.dataclass(frozen=True)
class CertPair:
    """A certificate and its private key, as PEM files."""

    cert_file: Path
    key_file: Path


class CertificateAuthority:
    """A self-signed root written to ``directory/<name>-ca.pem``, which issues certificates into ``directory``."""

    def __init__(self, directory: Path, *, name: str = "stead-test") -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._authority = Authority(name, valid=_VALID)
        #: the authority's certificate: what a peer trusts (etcd's ``--trusted-ca-file``, stead's ``etcd_ca_file``)
        self.ca_file = self.directory / f"{name}-ca.pem"
        self.ca_file.write_bytes(self._authority.own.cert_pem)

    def issue(self, name: str, *, server: bool = False, client: bool = False,
              hosts: Sequence[str] = LOOPBACK_HOSTS) -> CertPair:
        """A certificate for ``name`` signed by this authority, for TLS servers at ``hosts`` and/or clients.

        Written to ``<name>.pem`` and ``<name>-key.pem`` (mode 0600) in the authority's directory.
        """
        issued = self._authority.issue(name, server=server, client=client, hosts=hosts)
        pair = CertPair(cert_file=self.directory / f"{name}.pem", key_file=self.directory / f"{name}-key.pem")
        pair.cert_file.write_bytes(issued.cert_pem)
        write_private(pair.key_file, issued.key_pem)
        return pair
