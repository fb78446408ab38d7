"""The job token itself: a fresh one, whether one can travel in a header, its file, and its verifier.

The master generates one token per job (or is given one) and writes it to a
file only its user can read; agents and workers read that file. The state store
never holds the token, only :func:`token_verifier` of it (see
:mod:`stead.core.jobtoken` for its life cycle); :mod:`stead.core.rpc.auth` puts it
on every call.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path

import structlog

from stead.core.errors import ConfigError

__all__ = ["check_token", "new_token", "read_token_file", "token_verifier", "verifies", "write_token_file"]

log = structlog.get_logger()

# RFC 6750 b64token: what may follow "Bearer " in a header value
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~+/-]+=*")
_TOKEN_BYTES = 32
#: what the verifier's HMAC signs, with the job's name after it; a new scheme gets a new label (and key)
_VERIFIER_LABEL = "stead job token verifier v1"


def new_token() -> str:
    """A fresh random job token (URL-safe text, 256 bits of entropy)."""
    return secrets.token_urlsafe(_TOKEN_BYTES)


def check_token(token: str) -> str:
    """``token`` itself if it can travel in a header; ConfigError otherwise."""
    if not _TOKEN_CHARS.fullmatch(token):
        raise ConfigError("the job token is empty or has characters other than letters, digits and '._~+/-=': "
                          "use the token file the job's master wrote, unchanged")
    return token


def token_verifier(job: str, token: str) -> str:
    """What the store keeps instead of ``job``'s token: HMAC-SHA256 keyed by the token over a label and the job's
    name, in hex. It tells whether a token is the job's; it cannot be turned back into one (stead's tokens are
    256 random bits: a guess is hopeless) nor passed where a token goes."""
    return hmac.new(token.encode(), (_VERIFIER_LABEL + job).encode(), hashlib.sha256).hexdigest()


def verifies(job: str, token: str, verifier: str) -> bool:
    """Whether ``token`` is the one ``verifier`` was made from (compared in constant time)."""
    return hmac.compare_digest(token_verifier(job, token).encode(), verifier.encode())


def write_token_file(path: str | os.PathLike[str], token: str) -> Path:
    """Write ``token`` to ``path`` atomically, readable by this user only (mode 0600)."""
    target = Path(path)
    check_token(token)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token stored in ``path``; ConfigError naming the file when it is missing or malformed."""
    source = Path(path)
    try:
        text = source.read_text(encoding="ascii")
        mode = source.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"job token file {source} does not exist: pass the token file the job's master "
                          "wrote when it started (or start the master first)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read job token file {source}: {exc}; check its path and permissions") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token_file_not_private", path=str(source), mode=oct(stat.S_IMODE(mode)),
                    hint="chmod 600 the file: anyone who reads it can control the job")
    token = text.strip()
    try:
        return check_token(token)
    except ConfigError:
        raise ConfigError(f"job token file {source} does not hold a valid token: "
                          "pass the token file the job's master wrote, unchanged") from None
