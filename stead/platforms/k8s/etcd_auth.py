"""Turn etcd's authentication on for stead, once: what the Job ``stead-etcd-auth`` runs.

``python -m stead.platforms.k8s.etcd_auth --endpoint https://stead-etcd.NS.svc:2379
--ca-file ... --cert-file ... --key-file ... --root-password-file ... --user stead
--password-file ... --prefix /stead/`` creates etcd's ``root`` user (with the
``root`` role, which ``auth enable`` requires), the user stead's clients log in as,
with a role of the same name that may read and write the keys under the prefix
only, and turns authentication on. Run again, it finds root can log in (auth is
on), makes sure the user and its role are there, and stops: the Job may be
retried or applied again. It waits for etcd up to ``--wait-s`` (the etcd pod
may still be starting).

It speaks etcd's JSON gateway (``/v3/auth/...``) over client-certificate TLS with
the standard library, so that stead's image needs nothing more; etcd's own image
has etcdctl but no shell to run several commands, and a Job of one etcdctl
command per container could not be run twice.
"""

from __future__ import annotations

import argparse
import base64
import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stead.core.errors import ConfigError, PlatformError, PlatformUnavailable
from stead.core.store import prefix_end

__all__ = ["DEFAULT_WAIT_S", "EtcdAuth", "main"]

#: how long the Job waits for etcd to answer before it fails (and is retried by Kubernetes)
DEFAULT_WAIT_S = 300.0
#: one request's limit
REQUEST_TIMEOUT_S = 10.0
#: between two tries while etcd does not answer
_RETRY_S = 2.0
ROOT = "root"


class EtcdAuth:
    """etcd's auth API at ``endpoint`` (``https://host:port``), over client-certificate TLS."""

    def __init__(self, endpoint: str, *, ca_file: str, cert_file: str, key_file: str,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        try:
            self._tls = ssl.create_default_context(cafile=ca_file)
            self._tls.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"the client certificate for etcd cannot be loaded ({exc}); check --ca-file "
                              f"{ca_file}, --cert-file {cert_file} and --key-file {key_file} (the Secret "
                              "stead-etcd-client: ca.crt, tls.crt, tls.key)") from None
        self._token = ""

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``/v3/<path>``; etcd's answer, or PlatformError with etcd's message (PlatformUnavailable when
        etcd cannot be reached)."""
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        request = urllib.request.Request(f"{self.endpoint}/v3/{path}", data=json.dumps(body).encode(),
                                         headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self._tls) as response:
                found = json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                error = json.loads(exc.read() or b"{}")
            except ValueError:
                error = {}
            raise PlatformError(str(error.get("message") or error.get("error") or f"HTTP {exc.code}")) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PlatformUnavailable(f"etcd at {self.endpoint} cannot be reached ({exc})") from None
        return found if isinstance(found, dict) else {}

    def login(self, user: str, password: str) -> bool:
        """Log in (later calls carry the token); False when authentication is not on."""
        try:
            self._token = str(self.call("auth/authenticate", {"name": user, "password": password})["token"])
        except PlatformError as exc:
            if "authentication is not enabled" in str(exc):
                return False
            raise ConfigError(f"etcd refused {user!r}'s password ({exc}): authentication is on with another "
                              f"password than the Secret's; give the Secret the password etcd has") from None
        return True

    def _ensure(self, path: str, body: dict[str, Any]) -> None:
        try:
            self.call(path, body)
        except PlatformError as exc:
            if "already exists" not in str(exc):
                raise

    def enable(self, *, root_password: str, user: str, password: str, prefix: str) -> bool:
        """Make ``user`` (read and write under ``prefix``) and turn authentication on; False when it was on."""
        was_on = self.login(ROOT, root_password)
        if not was_on:
            self._ensure("auth/user/add", {"name": ROOT, "password": root_password})
            self._ensure("auth/role/add", {"name": ROOT})
            self.call("auth/user/grant", {"user": ROOT, "role": ROOT})
        self._ensure("auth/user/add", {"name": user, "password": password})
        self._ensure("auth/role/add", {"name": user})
        self.call("auth/role/grant", {"name": user, "perm": {
            "permType": "READWRITE", "key": _b64(prefix.encode()), "range_end": _b64(prefix_end(prefix.encode()))}})
        self.call("auth/user/grant", {"user": user, "role": user})
        if not was_on:
            self.call("auth/enable", {})
        return not was_on


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _read(path: str, what: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc.strerror}); mount the Secret stead-etcd-auth") \
            from None
    if not text:
        raise ConfigError(f"{what} {path} is empty; put the password in the Secret stead-etcd-auth")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """0 when authentication is on (turned on now, or found on); 1 when etcd never answered; 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m stead.platforms.k8s.etcd_auth",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--endpoint", required=True, help="etcd's client URL, https://HOST:PORT")
    parser.add_argument("--ca-file", required=True)
    parser.add_argument("--cert-file", required=True)
    parser.add_argument("--key-file", required=True)
    parser.add_argument("--root-password-file", required=True)
    parser.add_argument("--user", required=True, help="the user stead's clients log in as")
    parser.add_argument("--password-file", required=True)
    parser.add_argument("--prefix", default="/stead/", help="the keys the user may read and write")
    parser.add_argument("--wait-s", type=float, default=DEFAULT_WAIT_S, help="how long to wait for etcd to answer")
    args = parser.parse_args(argv)
    try:
        etcd = EtcdAuth(args.endpoint, ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file)
        root_password = _read(args.root_password_file, "--root-password-file")
        password = _read(args.password_file, "--password-file")
        deadline = time.monotonic() + args.wait_s
        while True:
            try:
                turned_on = etcd.enable(root_password=root_password, user=args.user, password=password,
                                        prefix=args.prefix)
                break
            except PlatformUnavailable as exc:
                if time.monotonic() >= deadline:
                    print(f"{parser.prog}: error: {exc}; waited {args.wait_s:g} s", file=sys.stderr)
                    return 1
                time.sleep(_RETRY_S)
    except (ConfigError, PlatformError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"etcd at {args.endpoint}: authentication {'turned on' if turned_on else 'was on already'}; user "
          f"{args.user!r} may read and write {args.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
