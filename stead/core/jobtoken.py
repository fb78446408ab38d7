"""The job token's life cycle: where a master finds it, what the store keeps of it, and when that goes.

Whoever reads the state store must not get the token, which controls the job
over RPC. So the store keeps only a verifier of it (:func:`~stead.core.rpc.token_verifier`,
under ``/stead/jobs/<job>/token-verifier``), and the token travels the way
users already share secrets: the environment (``STEAD_JOB_TOKEN``: a Kubernetes
Secret, or `stead run`'s supervisor handing it to each master it starts) and
the token file ``.stead/<job>.token`` (mode 0600), which agents, workers and
`stead scale` read. A master takes the token it was given, else the one in its
token file, else makes one; a token that does not match the job's verifier is
refused, since the job's agents and workers hold the other one and a master
that cannot answer them would split the job. The verifier and the token file
last until the job ends: the master of its end removes both, and the next run
of that job name starts with a new token.

A master holds the token for as long as it runs with :func:`held_job_token`: it
gives the token, writes the token file and, when the master leaves a job that
ended, forgets both.

A store written before the verifier holds the token in plaintext under
``/stead/jobs/<job>/token``: the first master that sees it takes it (when it
was given no other), writes the verifier and deletes the plaintext.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import structlog

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, StoreUnavailable
from stead.core.events.log import job_prefix
from stead.core.retry import retrying
from stead.core.store import StateStore
from stead.core.tokenfile import check_token, new_token, read_token_file, token_verifier, verifies, write_token_file

__all__ = ["JOB_TOKEN_ENV", "default_token_file", "find_token", "forget_job_token", "held_job_token", "job_token",
           "legacy_token_key", "verifier_key"]

log = structlog.get_logger("stead.jobtoken")

#: a given token shorter than this is warned about: the store's verifier is only as hard to guess offline as the
#: token (stead's own tokens are 43 characters, 256 bits)
_STRONG_TOKEN_CHARS = 32

#: the job's token, when it is given to a process (a master, `stead scale`) rather than read from its file
JOB_TOKEN_ENV = "STEAD_JOB_TOKEN"


def default_token_file(job: str) -> Path:
    """Where a job's token file is by default: ``.stead/<job>.token`` under the working directory."""
    return Path(".stead") / f"{job}.token"


def verifier_key(job: str) -> str:
    return f"{job_prefix(job)}token-verifier"


def legacy_token_key(job: str) -> str:
    """Where stead before the verifier kept the token itself (read once, to migrate it, then deleted)."""
    return f"{job_prefix(job)}token"


def find_token(token_file: Path, *, explicit_file: bool = False,
               environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``(token, where it came from)``: ``STEAD_JOB_TOKEN``, else ``token_file`` if it exists; None if neither.

    ``explicit_file``: the file was named by the user, so it wins over the environment and must exist.
    """
    env = os.environ if environ is None else environ
    if not explicit_file and env.get(JOB_TOKEN_ENV):
        try:
            return check_token(env[JOB_TOKEN_ENV].strip()), JOB_TOKEN_ENV
        except ConfigError:
            raise ConfigError(f"{JOB_TOKEN_ENV} does not hold a valid job token: set it to the token of the job's "
                              "Secret or token file, unchanged") from None
    if explicit_file or token_file.exists():
        return read_token_file(token_file), f"token file {token_file}"
    return None


def _mismatch(job: str, store: StateStore, source: str) -> ConfigError:
    key = verifier_key(job)
    return ConfigError(
        f"job {job!r} in {store.url} runs with another token than {source} (the store keeps a "
        f"verifier of the job's token under {key}): its agents and workers hold the job's token, and a master with "
        f"another could not answer them. Pass the job's token: {JOB_TOKEN_ENV}, or the token file its master wrote "
        f"({default_token_file(job)} where `stead run` ran). If none of the job's nodes runs any more, delete "
        f"{key} from the store (on etcd: etcdctl del {key}) and start it again with a new token, or run it under "
        "another job name")


async def _migrate(store: StateStore, job: str, settings: Settings) -> str | None:
    """The plaintext token of a store written before the verifier, now kept as a verifier only; None if none."""
    key = legacy_token_key(job)
    kv = await retrying(lambda: store.get(key), settings, what=f"job token of {job}")
    if kv is None:
        return None
    try:
        token = check_token(kv.value.decode("ascii"))
    except (UnicodeDecodeError, ConfigError):
        token = None  # unusable: it authenticates nobody, so it is simply dropped
    if token is not None:
        made = token_verifier(job, token).encode()
        await retrying(lambda: store.compare_and_put(verifier_key(job), made, expected_mod_revision=0), settings,
                       what=f"job token verifier of {job}")
    await retrying(lambda: store.delete(key), settings, what=f"job token of {job}")
    log.info("job_token_migrated", job=job, key=key, kept="verifier only" if token else "nothing (not a token)")
    return token


async def job_token(store: StateStore, job: str, *, given: str | None, token_file: Path, settings: Settings) -> str:
    """The job's token for a master: ``given``, else the plaintext one of an older store, else the token file's,
    else a new one; the store's verifier is written when there is none, and a token it does not verify is
    refused (ConfigError)."""
    legacy = await _migrate(store, job, settings)
    in_file = find_token(token_file, environ={})
    if given:
        token, source = check_token(given), "the one this master was given"
        if len(token) < _STRONG_TOKEN_CHARS:
            log.warning("job_token_weak", job=job, length=len(token),
                        hint=f"whoever can read the store can guess a token this short from its verifier offline: "
                             f"give one of at least {_STRONG_TOKEN_CHARS} random characters (or none: the master "
                             "makes one)")
    elif legacy:
        token, source = legacy, f"the one in the store's plaintext {legacy_token_key(job)}"
    elif in_file is not None:
        token, source = in_file[0], f"the one in {in_file[1]}"
    else:
        token, source = new_token(), f"a new one (this master was given none, and {token_file} does not exist)"
    key = verifier_key(job)
    made = token_verifier(job, token).encode()
    while True:
        kv = await retrying(lambda: store.get(key), settings, what=f"job token verifier of {job}")
        if kv is not None:
            if verifies(job, token, kv.value.decode("ascii", errors="replace")):
                return token
            raise _mismatch(job, store, source)
        if await retrying(lambda: store.compare_and_put(key, made, expected_mod_revision=0), settings,
                          what=f"job token verifier of {job}"):
            log.info("job_token_verifier_written", job=job, key=key, token=source)
            return token


async def forget_job_token(store: StateStore, job: str, token_file: Path) -> None:
    """The job ended: nobody needs its token any more, so its verifier and then its token file go (the file
    stays while the verifier does, so that the next run of the job name here finds the token that matches)."""
    try:
        await store.delete(verifier_key(job))
    except (StoreUnavailable, StoreError) as exc:
        log.warning("job_token_verifier_kept", job=job, key=verifier_key(job), error=str(exc),
                    token_file=str(token_file), hint="the next run of this job name takes the token from the file")
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(token_file)


@contextlib.asynccontextmanager
async def held_job_token(store: StateStore, job: str, *, given: str | None, token_file: Path, settings: Settings,
                         ended: Callable[[], bool]) -> AsyncIterator[str]:
    """A master's hold on the job's token: gives it (:func:`job_token`), written to ``token_file`` for the agents,
    workers and `stead scale`; on the way out, forgets it (:func:`forget_job_token`) if ``ended()``, else leaves
    the verifier and the file for the master that takes the job over."""
    token = await job_token(store, job, given=given, token_file=token_file, settings=settings)
    write_token_file(token_file, token)
    try:
        yield token
    finally:
        if ended():
            await forget_job_token(store, job, token_file)
