"""How to reach an etcd cluster: its endpoints, TLS files, user and password, from the store URL and settings.

The URL is ``etcd://[user@]host:port[,host:port][?ca_file=F&cert_file=F&key_file=F&password_file=F]``;
each query key stands for the setting ``etcd_<key>`` and the user for ``etcd_user``, and a value in the
URL wins over the setting. TLS is used when a CA file is given (the server is verified against it); a
client certificate and its key go together. Authentication is used when a user is given; the password
is read from a file, never from the URL or a command line, so that nothing logged or listed by ``ps``
holds it. :attr:`EtcdAccess.public_url` is the URL without user or query: what logs and errors show.

It also says what etcd's refusals mean (:func:`refusal`, :func:`connection_failure`):
grpc reports a TLS handshake that failed as UNAVAILABLE, like an etcd that is
down; the handshake's detail tells them apart where it can, and a certificate
that either side refuses is a permanent :class:`StoreError`, not an outage to
wait out. Where the detail cannot tell (a connection closed at once), the
message says both possibilities.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, StoreUnavailable
from stead.core.store._common import public_store_url

__all__ = ["EtcdAccess", "connection_failure", "etcd_access", "host_port", "refusal", "stale_token",
           "unreachable_advice"]

DEFAULT_PORT = 2379
URL_PREFIX = "etcd://"
#: the URL's query keys, each the setting ``etcd_<key>``
QUERY_KEYS = ("ca_file", "cert_file", "key_file", "password_file")
_EXAMPLE = ("etcd://127.0.0.1:2379, etcd://host1:2379,host2:2379 or "
            "etcd://stead@etcd:2379?ca_file=/etc/etcd/ca.pem&password_file=/run/secrets/etcd-password")


@dataclasses.dataclass(frozen=True)
class EtcdAccess:
    """Where an etcd cluster is and how to get in (file paths, never a secret itself)."""

    endpoints: tuple[tuple[str, int], ...]
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password_file: str = ""
    #: for each field set, where it was given ("ca_file in the store URL", "setting etcd_ca_file")
    origins: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)

    @property
    def public_url(self) -> str:
        """``etcd://host:port[,host:port]``: the URL without user or query, for logs and messages."""
        return URL_PREFIX + ",".join(host_port(host, port) for host, port in self.endpoints)

    def origin(self, field: str) -> str:
        return self.origins.get(field, f"setting etcd_{field}")

    def read(self, field: str) -> bytes:
        """The contents of the file ``field`` names (ca_file, cert_file, key_file, password_file)."""
        path = getattr(self, field)
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {path} ({self.origin(field)}) for etcd at {self.public_url}: "
                              f"{exc.strerror or exc}; check the path and that this user may read it") from None

    def password(self) -> str:
        """The password in :attr:`password_file` (one line; its line end is not part of it)."""
        if not self.password_file:
            raise ConfigError(f"etcd at {self.public_url}: user {self.user!r} is given but no password file; set "
                              "etcd_password_file (or password_file= in the store URL) to a file holding the "
                              "password")
        try:
            text = self.read("password_file").decode()
        except UnicodeDecodeError:
            raise ConfigError(f"password file {self.password_file} ({self.origin('password_file')}) is not UTF-8 "
                              "text; write the password as one line of text") from None
        password = text.removesuffix("\n").removesuffix("\r")
        if not password or "\n" in password:
            raise ConfigError(f"password file {self.password_file} ({self.origin('password_file')}) must hold the "
                              f"password of etcd user {self.user!r} on one line, and it "
                              f"{'is empty' if not password else 'has several lines'}")
        return password


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _endpoints(url: str, hosts: str) -> tuple[tuple[str, int], ...]:
    endpoints: list[tuple[str, int]] = []
    for part in hosts.split(","):
        part = part.strip()
        if part.startswith("["):  # [ipv6]:port
            host, _, rest = part[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port_text = part.partition(":")
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            port = -1
        if not host or not 0 < port < 65536:
            raise ConfigError(f"bad endpoint {part!r} in etcd store URL {public_store_url(url)!r}; use {_EXAMPLE}")
        endpoints.append((host, port))
    return tuple(endpoints)


def _query(url: str, text: str) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ConfigError(f"the query of etcd store URL {public_store_url(url)!r} is malformed: write KEY=VALUE "
                          f"pairs joined by '&', with keys among {', '.join(QUERY_KEYS)}") from None
    values: dict[str, str] = {}
    for key, value in pairs:
        if key not in QUERY_KEYS:
            raise ConfigError(f"etcd store URL {public_store_url(url)!r} has an unknown query key {key!r}; the keys "
                              f"are {', '.join(QUERY_KEYS)} (a password goes in a file: password_file=PATH)")
        if key in values:
            raise ConfigError(f"etcd store URL {public_store_url(url)!r} gives {key} twice; give it once")
        if not value:
            raise ConfigError(f"etcd store URL {public_store_url(url)!r} gives {key} with no value; give a path "
                              "or leave the key out")
        values[key] = value
    return values


def etcd_access(url: str, settings: Settings) -> EtcdAccess:
    """The :class:`EtcdAccess` of ``url`` with ``settings`` filling in what the URL does not say."""
    if not url.startswith(URL_PREFIX):
        raise ConfigError(f"bad etcd store URL {public_store_url(url)!r}; use {_EXAMPLE}")
    rest, _, query = url[len(URL_PREFIX):].partition("?")
    userinfo, at, hosts = rest.rpartition("@")
    if at and ":" in userinfo:
        raise ConfigError("the etcd store URL holds a password (user:password@): it would show in logs and in the "
                          "process list; write the password to a file (mode 0600) and pass password_file=PATH in "
                          "the URL or --set etcd_password_file=PATH")
    hosts = hosts.strip("/")
    if not hosts or (at and not userinfo):
        raise ConfigError(f"bad etcd store URL {public_store_url(url)!r}; use {_EXAMPLE}")
    given = _query(url, query) if query else {}
    values: dict[str, str] = {}
    origins: dict[str, str] = {}
    for field in (*QUERY_KEYS, "user"):
        from_url = urllib.parse.unquote(userinfo) if field == "user" and at else given.get(field, "")
        value = from_url or getattr(settings, f"etcd_{field}")
        if value:
            values[field] = value
            where = "the store URL's user" if field == "user" else f"{field} in the store URL"
            origins[field] = where if from_url else f"setting etcd_{field}"
    access = EtcdAccess(endpoints=_endpoints(url, hosts), origins=origins, **values)
    if bool(access.cert_file) != bool(access.key_file):
        have, missing = ("cert_file", "key_file") if access.cert_file else ("key_file", "cert_file")
        raise ConfigError(f"etcd at {access.public_url}: {have} is given ({access.origin(have)}) but {missing} is "
                          f"not; a client certificate needs both: set etcd_cert_file and etcd_key_file (or "
                          "cert_file= and key_file= in the store URL)")
    if access.cert_file and not access.tls:
        raise ConfigError(f"etcd at {access.public_url}: a client certificate is given but no CA file, so TLS is "
                          "off; set etcd_ca_file (or ca_file= in the store URL) to the CA that signed etcd's "
                          "server certificate")
    if access.password_file and not access.user:
        raise ConfigError(f"etcd at {access.public_url}: a password file is given but no user; set etcd_user (or "
                          "write etcd://USER@host:port)")
    return access


# -- what etcd's refusals mean --------------------------------------------------------------------------------------

#: etcd's words for a login token it no longer takes (expired; the auth store changed under it; auth enabled
#: after this client found it off): logging in again cures them
_STALE_TOKEN = ("invalid auth token", "auth store is old", "user name is empty")
#: grpc's words for a server certificate this client does not trust
_UNTRUSTED_SERVER = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed")
_WRONG_HOST = ("Hostname Verification Check failed", "not in peer certificate")
#: a TLS alert after the handshake: the server refused this client's certificate (TLS 1.3 says so only then)
_CLIENT_REFUSED = ("TSI_DATA_CORRUPTED", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "Unwrap failed")
_HANDSHAKE_FAILED = ("Handshake read failed", "Handshake write failed", "WRONG_VERSION_NUMBER")


def stale_token(details: str) -> bool:
    """Whether etcd refused a call for its login token, so that logging in again cures it."""
    return any(words in details for words in _STALE_TOKEN)


def unreachable_advice(access: EtcdAccess) -> str:
    return (f"is etcd running at {access.public_url.removeprefix(URL_PREFIX)}? start it or pass --store with a "
            "reachable URL")


def refusal(access: EtcdAccess, op: str, details: str) -> StoreError | None:
    """The permanent error of an etcd answer that refuses this client's login or permissions, else None."""
    url, user = access.public_url, access.user
    if "authentication failed" in details:
        return StoreError(f"etcd at {url} refused user {user!r}: wrong password (or no such user); check "
                          f"etcd_password_file ({access.origin('password_file')}: {access.password_file}) and "
                          "etcd_user")
    if "user name is empty" in details and not user:
        return StoreError(f"etcd at {url} refused {op}: it requires a login (its authentication is enabled); set "
                          "etcd_user and etcd_password_file (or etcd://USER@host:port?password_file=PATH)")
    if "permission denied" in details:
        who = f"user {user!r}" if user else "this client (no etcd_user given)"
        return StoreError(f"etcd at {url} refused {op} to {who}: permission denied; grant its role read and write "
                          "on stead's keys (etcdctl role grant-permission ROLE readwrite /stead/ --prefix)")
    return None


def _reason(details: str, marker: str) -> str:
    """The words grpc puts after ``marker`` in ``details`` (OpenSSL's reason), or the whole detail."""
    _, found, after = details.partition(marker)
    return after.strip(" :").split(":")[0].strip() if found else details


def connection_failure(access: EtcdAccess, op: str, code: str, details: str) -> StoreError | StoreUnavailable | None:
    """The error of a connection that TLS (or its absence) broke, recognised in grpc's detail, else None."""
    if code not in ("UNAVAILABLE", "UNKNOWN"):
        return None
    url = access.public_url
    if access.tls:
        marker = next((words for words in _UNTRUSTED_SERVER if words in details), None)
        if marker is not None:
            return StoreError(
                f"etcd at {url} presented a server certificate that {access.ca_file} ({access.origin('ca_file')}) "
                f"does not vouch for ({_reason(details, marker)}); set etcd_ca_file to the CA that signed etcd's "
                "--cert-file, or renew a certificate that expired")
        if any(words in details for words in _WRONG_HOST):
            host = access.endpoints[0][0]
            return StoreError(f"etcd at {url} presented a certificate that is not valid for {host}; connect by a "
                              "name or address its subject alternative names hold, or give etcd a certificate "
                              f"for {host}")
        if any(words in details for words in _CLIENT_REFUSED):
            if not access.cert_file:
                return StoreError(
                    f"etcd at {url} refused the TLS connection for want of a client certificate (it runs with "
                    "--client-cert-auth); set etcd_cert_file and etcd_key_file (or cert_file= and key_file= in the "
                    "store URL) to a certificate signed by a CA in etcd's --trusted-ca-file")
            return StoreError(
                f"etcd at {url} refused the client certificate {access.cert_file} ({access.origin('cert_file')}): "
                "it is not signed by a CA in etcd's --trusted-ca-file, or it expired; use a certificate of that CA")
        if any(words in details for words in _HANDSHAKE_FAILED):
            return StoreUnavailable(
                f"the TLS handshake with etcd at {url} failed during {op} ({details}): either etcd serves plain "
                "HTTP there (then leave etcd_ca_file unset, or use its TLS port), or it went away during the "
                f"handshake ({unreachable_advice(access)})")
    elif "Socket closed" in details:
        return StoreUnavailable(
            f"etcd at {url} closed the connection during {op} ({details}): either it serves TLS there (then set "
            "etcd_ca_file to its CA, and a client certificate if it runs with --client-cert-auth), or it is "
            f"stopping; {unreachable_advice(access)}")
    return None
