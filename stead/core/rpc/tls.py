"""Mutual TLS for stead's RPC: the ``tls_*`` settings checked, and the ssl contexts of servers and channels.

With ``tls_ca_file``, ``tls_cert_file`` and ``tls_key_file`` set, the master's
server speaks only TLS and asks every client for a certificate signed by the CA;
every client checks the master's certificate against the CA (the address it
dials must be one of the certificate's names: a DNS name, or an IP address
SAN for an address) and shows its own. The job token is checked on top, as
without TLS. Both sides offer ALPN ``h2``, which grpclib requires.

:func:`tls_files` checks the settings before anything starts (all three or
none; each file readable PEM); :func:`server_context` and :func:`client_context`
build the contexts (an ssl error there, such as a key that is not the
certificate's, is a :class:`~stead.core.errors.ConfigError` naming the files).
:data:`TLS_HINT` is what every TLS failure tells its reader to check.
"""

from __future__ import annotations

import dataclasses
import ssl
from pathlib import Path

import structlog

from stead.core.config import Settings
from stead.core.errors import ConfigError

__all__ = ["TLS_HINT", "TlsFiles", "client_context", "client_tls", "server_context", "tls_files"]

log = structlog.get_logger()

#: the settings, in the order they are named
_SETTINGS = ("tls_ca_file", "tls_cert_file", "tls_key_file")
#: what each setting's file must hold
_HOLDS = {"tls_ca_file": "CERTIFICATE", "tls_cert_file": "CERTIFICATE", "tls_key_file": "PRIVATE KEY"}
#: what to check when a TLS handshake fails, on either side
TLS_HINT = ("check that both sides set tls_ca_file, tls_cert_file and tls_key_file (all three, on every host and "
            "every `stead` command that calls the master), that tls_ca_file is the same CA on every host and signed "
            "both certificates, and that the master's certificate names the host or address it is reached by "
            "(`stead certs --host NAME_OR_IP` makes one that does)")


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """The CA every peer's certificate must be signed by, and this host's certificate and key (PEM files)."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def tls_files(settings: Settings) -> TlsFiles | None:
    """The TLS files the settings name, each checked to be readable PEM of the right kind; None without TLS."""
    values = {name: str(getattr(settings, name)) for name in _SETTINGS}
    given = [name for name, value in values.items() if value]
    if not given:
        return None
    missing = [name for name in _SETTINGS if name not in given]
    if missing:
        raise ConfigError(f"TLS needs all three of {', '.join(_SETTINGS)}, but only {' and '.join(given)} "
                          f"{'is' if len(given) == 1 else 'are'} set: set "
                          f"{' and '.join(missing)} too (`stead certs --job NAME --dir DIR` makes the three files), "
                          f"or unset {' and '.join(given)} to run without TLS")
    for name in _SETTINGS:
        _check_pem(name, Path(values[name]))
    return TlsFiles(*(Path(values[name]) for name in _SETTINGS))


def _check_pem(name: str, path: Path) -> None:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"setting {name}={str(path)!r}: cannot read the file ({exc.strerror or exc}); give the "
                          "path of a PEM file this user can read, on this host") from None
    marker = f"-----BEGIN {_HOLDS[name]}-----".encode()
    found = marker in data or (_HOLDS[name] == "PRIVATE KEY" and b" PRIVATE KEY-----" in data)
    if not found:
        raise ConfigError(f"setting {name}={str(path)!r}: the file holds no PEM {_HOLDS[name].lower()} (no "
                          f"'{marker.decode()}' line); give the {_what(name)} (`stead certs` writes it)")


def _what(name: str) -> str:
    return {"tls_ca_file": "CA's certificate", "tls_cert_file": "host's certificate",
            "tls_key_file": "host's private key"}[name]


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server's context: its certificate, and a client certificate signed by the CA required of every peer."""
    context = _context(files, ssl.Purpose.CLIENT_AUTH)
    context.verify_mode = ssl.CERT_REQUIRED
    context.sslobject_class = _ServerSide
    return context


class _ServerSide(ssl.SSLObject):
    """A server's side of one TLS connection, which logs a handshake it refused: asyncio closes such a connection
    without a word (its log says so only in debug mode), and the application never sees it."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as exc:
            log.warning("rpc_tls_refused", reason=exc.reason or str(exc), error=str(exc),
                        hint="a client without a certificate signed by tls_ca_file, or a plain-text one: "
                        + TLS_HINT)
            raise


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """A client's context: the server's certificate checked against the CA and the address dialled; its own shown."""
    context = _context(files, ssl.Purpose.SERVER_AUTH)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls(settings: Settings) -> ssl.SSLContext | None:
    """The client context the settings ask for (None without TLS): what every client of the master passes."""
    files = tls_files(settings)
    return client_context(files) if files is not None else None


def _context(files: TlsFiles, purpose: ssl.Purpose) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(purpose, cafile=str(files.ca_file))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"setting tls_ca_file={str(files.ca_file)!r} holds no usable CA certificate ({exc}); give "
                          "the CA's certificate that `stead certs` wrote (ca.pem)") from None
    try:
        context.load_cert_chain(str(files.cert_file), str(files.key_file))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"settings tls_cert_file={str(files.cert_file)!r} and tls_key_file="
                          f"{str(files.key_file)!r} are not a certificate and its own private key ({exc}); give "
                          "the pair `stead certs` wrote together") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    return context
