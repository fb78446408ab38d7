"""etcd secured: TLS (CA, client certificate) and logins against a real etcd with --client-cert-auth and auth on.

Each way in that cannot work is refused with an error that says what to check, and a refusal that retrying
cannot cure is permanent (StoreError), not an outage to wait out; no password shows in a log line or an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import anyio
import pytest
import structlog.testing

from stead.core.config import Settings
from stead.core.errors import ConfigError, StoreError, StoreUnavailable
from stead.core.store import open_store, public_store_url
from stead.core.store.etcd import etcd_access
from stead.testing.etcd import EtcdServer
from stead.testing.steps import free_port
from stead.testing.tls import CertificateAuthority

pytestmark = pytest.mark.anyio

#: a guard against a hung watch, not a measured duration
WATCH_TIMEOUT_S = 10


#: the contract suite's settings (short reconnect intervals); nothing asserts on durations
BASE = Settings(retry_initial_s=0.05, retry_max_s=0.2, store_timeout_s=5.0)


def secured(server: EtcdServer, **changes: str) -> Settings:
    """The settings of a client that gets into ``server``, with ``changes`` (a value "" unsets a setting)."""
    return Settings.from_mapping({**server.client_settings(), **changes}, base=BASE)


@pytest.fixture
def other_ca(tmp_path: Path) -> CertificateAuthority:
    """An authority the server does not trust (and that did not sign the server's certificate)."""
    return CertificateAuthority(tmp_path / "other", name="other")


@pytest.fixture
def plain_auth_etcd() -> Iterator[EtcdServer]:
    """An etcd with logins required but no TLS."""
    with EtcdServer(auth=True) as server:
        yield server


def _messages(caught: pytest.ExceptionInfo[BaseException]) -> str:
    error: BaseException | None = caught.value
    texts = []
    while error is not None:
        texts.append(f"{error} {error!r}")
        error = error.__cause__ or error.__context__
    return " ".join(texts)


async def test_a_client_with_the_ca_a_client_certificate_and_the_password_gets_in_and_watches(
        secure_etcd: EtcdServer) -> None:
    store = await open_store(secure_etcd.url, settings=secured(secure_etcd))
    try:
        async with aclosing(store.watch("/secured/w/")) as events:
            revision = await store.put("/secured/w/k", b"v")
            with anyio.fail_after(WATCH_TIMEOUT_S):
                event = await anext(events)
        assert (event.key, event.value, event.revision) == ("/secured/w/k", b"v", revision)
        async with store.lease(1) as lease:
            assert await store.create_all([("/secured/leased", b"x")])
            assert await store.compare_and_put("/secured/leased", b"y", expected_mod_revision=0) is False
            assert lease.id
        assert await store.delete_prefix("/secured/") >= 2
    finally:
        await store.close()


async def test_the_url_alone_carries_tls_and_the_user(secure_etcd: EtcdServer) -> None:
    values = secure_etcd.client_settings()
    url = (f"etcd://{values['etcd_user']}@{secure_etcd.endpoint}?ca_file={values['etcd_ca_file']}"
           f"&cert_file={values['etcd_cert_file']}&key_file={values['etcd_key_file']}"
           f"&password_file={values['etcd_password_file']}")
    store = await open_store(url, settings=BASE)
    try:
        assert store.url == secure_etcd.url  # neither user nor files in what logs and errors show
        assert await store.get("/secured/none") is None
    finally:
        await store.close()


async def test_tls_with_several_endpoints_verifies_the_servers_as_the_first_host(secure_etcd: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    store = await open_store(f"etcd://{dead},{secure_etcd.endpoint}", settings=secured(secure_etcd))
    try:
        assert await store.revision() > 0
    finally:
        await store.close()


async def test_no_client_certificate_is_refused_for_want_of_one(secure_etcd: EtcdServer) -> None:
    with pytest.raises(StoreError, match=r"for want of a client certificate .*set etcd_cert_file and etcd_key_file"):
        await open_store(secure_etcd.url, settings=secured(secure_etcd, etcd_cert_file="", etcd_key_file=""))


async def test_a_client_certificate_of_another_ca_is_refused_naming_the_certificate(
        secure_etcd: EtcdServer, other_ca: CertificateAuthority) -> None:
    pair = other_ca.issue("intruder", client=True)
    settings = secured(secure_etcd, etcd_cert_file=str(pair.cert_file), etcd_key_file=str(pair.key_file))
    with pytest.raises(StoreError, match=f"refused the client certificate {pair.cert_file} .*--trusted-ca-file") as e:
        await open_store(secure_etcd.url, settings=settings)
    assert not isinstance(e.value, StoreUnavailable)


async def test_a_server_the_ca_does_not_vouch_for_is_refused(secure_etcd: EtcdServer,
                                                               other_ca: CertificateAuthority) -> None:
    with pytest.raises(StoreError, match=f"server certificate that {other_ca.ca_file} .*does not vouch for"):
        await open_store(secure_etcd.url, settings=secured(secure_etcd, etcd_ca_file=str(other_ca.ca_file)))


async def test_a_wrong_password_is_refused_for_good_and_shows_nowhere(secure_etcd: EtcdServer,
                                                                      tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password-8d1f\n")
    with structlog.testing.capture_logs() as logs, pytest.raises(StoreError) as caught:
        await open_store(secure_etcd.url, settings=secured(secure_etcd, etcd_password_file=str(wrong)))
    assert not isinstance(caught.value, StoreUnavailable)
    assert "refused user 'stead': wrong password (or no such user); check etcd_password_file" in str(caught.value)
    assert str(wrong) in str(caught.value)
    assert "not-the-password-8d1f" not in _messages(caught) + repr(logs)


async def test_no_password_or_login_token_shows_in_any_log_line_or_error(secure_etcd: EtcdServer) -> None:
    assert secure_etcd.password_file is not None and secure_etcd.root_password_file is not None
    secrets = [secure_etcd.password_file.read_text().strip(), secure_etcd.root_password_file.read_text().strip()]
    with structlog.testing.capture_logs() as logs:
        store = await open_store(secure_etcd.url, settings=secured(secure_etcd))
        try:
            await store.put("/secured/k", b"v")
            with pytest.raises(StoreError) as caught:  # one error from the logged-in store, for its text
                await store.put("/secured/k", b"x" * (2 << 20))
            token = store._auth_token  # type: ignore[attr-defined]
        finally:
            await store.close()
    said = repr(logs) + _messages(caught)
    assert logs and token
    for secret in [*secrets, token]:
        assert secret not in said


async def test_an_auth_token_etcd_no_longer_takes_is_renewed_once_and_the_call_goes_through(
        secure_etcd: EtcdServer) -> None:
    store = await open_store(secure_etcd.url, settings=secured(secure_etcd))
    try:
        await store.put("/secured/renew", b"1")
        first = store._auth_token  # type: ignore[attr-defined]
        await anyio.to_thread.run_sync(secure_etcd.forget_tokens)  # as their expiry does
        kv = await store.get("/secured/renew")
        assert kv is not None and kv.value == b"1"
        assert store._auth_token != first  # type: ignore[attr-defined]
        await anyio.to_thread.run_sync(secure_etcd.forget_tokens)
        async with aclosing(store.watch("/secured/renew")) as events:  # a watch logs in again too
            await store.put("/secured/renew", b"2")
            with anyio.fail_after(WATCH_TIMEOUT_S):
                assert (await anext(events)).value == b"2"
        await store.delete("/secured/renew")
    finally:
        await store.close()


async def test_a_user_without_permission_on_stead_s_keys_is_told_to_grant_it(secure_etcd: EtcdServer) -> None:
    password_file = await anyio.to_thread.run_sync(lambda: secure_etcd.add_user("narrow", prefix="/stead/jobs/a/"))
    store = await open_store(secure_etcd.url, settings=secured(secure_etcd, etcd_user="narrow",
                                                               etcd_password_file=str(password_file)))
    try:  # its own job's keys (and the revision, which needs no key) work; another job's are refused
        await store.put("/stead/jobs/a/k", b"v")
        with pytest.raises(StoreError, match="refused get to user 'narrow': permission denied; grant its role"):
            await store.get("/stead/jobs/b/k")
        with pytest.raises(StoreError, match="refused watch to user 'narrow': permission denied"):
            async with aclosing(store.watch("/stead/jobs/b/")) as events:
                await anext(events)
        await store.delete("/stead/jobs/a/k")
    finally:
        await store.close()


async def test_no_login_to_an_etcd_that_requires_one_says_which_settings_to_give(
        plain_auth_etcd: EtcdServer) -> None:
    store = await open_store(plain_auth_etcd.url, settings=BASE)
    try:
        with pytest.raises(StoreError, match=r"requires a login .*set etcd_user and etcd_password_file"):
            await store.put("/k", b"v")
    finally:
        await store.close()


async def test_a_password_goes_to_an_etcd_without_tls_only_when_a_setting_allows_it(
        plain_auth_etcd: EtcdServer) -> None:
    allowed = secured(plain_auth_etcd)
    assert allowed.etcd_allow_plaintext_password  # what the test server's clients are given on loopback
    refused = dataclasses.replace(allowed, etcd_allow_plaintext_password=False)
    with pytest.raises(ConfigError, match=r"user 'stead' \(setting etcd_user\) would send its password without "
                                          r"TLS.* set etcd_ca_file .* etcd_allow_plaintext_password=true"):
        await open_store(plain_auth_etcd.url, settings=refused)
    store = await open_store(plain_auth_etcd.url, settings=allowed)
    try:
        assert await store.put("/plain/k", b"v") > 0
    finally:
        await store.close()


async def test_tls_to_a_plain_etcd_says_it_may_serve_plain_http(etcd: str, secure_etcd: EtcdServer) -> None:
    settings = secured(secure_etcd, etcd_user="", etcd_password_file="")
    with pytest.raises(StoreUnavailable, match=r"TLS handshake with etcd at .* either etcd serves plain HTTP there"):
        await open_store(etcd, settings=settings)


async def test_plain_to_a_tls_etcd_says_it_may_serve_tls(secure_etcd: EtcdServer) -> None:
    with pytest.raises(StoreUnavailable, match="either it serves TLS there \\(then set etcd_ca_file"):
        await open_store(secure_etcd.url, settings=BASE)


def test_the_url_s_values_win_over_the_settings() -> None:
    settings = Settings.from_mapping({"etcd_ca_file": "/s/ca.pem", "etcd_user": "s", "etcd_password_file": "/s/pw"})
    access = etcd_access("etcd://u@h:1,k?ca_file=/u/ca.pem", settings)
    assert (access.endpoints, access.ca_file, access.user, access.password_file) == (
        (("h", 1), ("k", 2379)), "/u/ca.pem", "u", "/s/pw")
    assert access.public_url == "etcd://h:1,k:2379"
    assert access.origin("ca_file") == "ca_file in the store URL"
    assert access.origin("password_file") == "setting etcd_password_file"


@pytest.mark.parametrize(("url", "values", "message"), [
    ("etcd://h:1?ca_file=/a&pasword=x", {}, "unknown query key 'pasword'; the keys are ca_file, cert_file, key_file, "
                                            "password_file"),
    ("etcd://h:1?ca_file=/a&ca_file=/b", {}, "gives ca_file twice"),
    ("etcd://h:1?ca_file=", {}, "gives ca_file with no value"),
    ("etcd://h:1?ca_file=/a&cert_file=/c", {}, "cert_file is given .* but key_file is not"),
    ("etcd://h:1", {"etcd_ca_file": "/a", "etcd_key_file": "/k"}, "key_file is given .* but cert_file is not"),
    ("etcd://h:1?cert_file=/c&key_file=/k", {}, "no CA file, so TLS is off; set etcd_ca_file"),
    ("etcd://h:1?password_file=/p", {}, "a password file is given but no user; set etcd_user"),
    ("etcd://@h:1", {}, "bad etcd store URL"),
])
def test_a_bad_secured_url_is_a_config_error_that_says_what_to_write(url: str, values: dict[str, str],
                                                                    message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        etcd_access(url, Settings.from_mapping(values))


async def test_a_password_in_the_url_is_refused_without_repeating_it() -> None:
    with pytest.raises(ConfigError, match=r"holds a password .* pass password_file=PATH") as caught:
        await open_store("etcd://stead:hunter2-secret@127.0.0.1:2379", settings=BASE)
    assert "hunter2-secret" not in _messages(caught)
    with pytest.raises(ConfigError) as caught:
        await open_store("etcdd://stead:hunter2-secret@h:1?password=hunter2-secret", settings=BASE)
    assert "hunter2-secret" not in _messages(caught)


async def test_a_missing_certificate_or_password_file_is_named(secure_etcd: EtcdServer, tmp_path: Path) -> None:
    absent = tmp_path / "absent.pem"
    with pytest.raises(ConfigError, match=f"cannot read {absent} \\(setting etcd_ca_file\\)"):
        await open_store(secure_etcd.url, settings=secured(secure_etcd, etcd_ca_file=str(absent)))
    with pytest.raises(ConfigError, match=f"cannot read {absent} \\(setting etcd_password_file\\)"):
        await open_store(secure_etcd.url, settings=secured(secure_etcd, etcd_password_file=str(absent)))
    empty = tmp_path / "empty.password"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="must hold the password of etcd user 'stead' on one line, and it is empty"):
        await open_store(secure_etcd.url, settings=secured(secure_etcd, etcd_password_file=str(empty)))


def test_public_store_urls_drop_users_and_queries() -> None:
    assert public_store_url("etcd://u@h:1,k:2?ca_file=/x") == "etcd://h:1,k:2"
    assert public_store_url("sqlite:///a/b.db") == "sqlite:///a/b.db"
    assert public_store_url("etcd://u:p@h") == "etcd://h"


def test_settings_name_the_etcd_security_fields_the_manifests_use() -> None:
    names = {f.name for f in dataclasses.fields(Settings)}
    assert {"etcd_ca_file", "etcd_cert_file", "etcd_key_file", "etcd_user", "etcd_password_file"} <= names
    assert Settings.from_env({"STEAD_ETCD_CA_FILE": "/ca.pem"}).etcd_ca_file == "/ca.pem"
