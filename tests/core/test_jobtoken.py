"""The job token's life cycle with a real master: the store keeps a verifier, never the token; a master with a
token that is not the job's refuses; the job's end removes the verifier and the token file; an older store's
plaintext token is migrated."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.events import JobStopped, JobSubmitted
from stead.core.jobtoken import held_job_token, legacy_token_key, verifier_key
from stead.core.master import Master, MasterConfig
from stead.core.rpc import MasterClient, RegisterInfo, new_token, token_verifier
from stead.core.store import StateStore, open_store

pytestmark = pytest.mark.anyio

FAST = Settings(heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0, retry_deadline_s=1.0)


def _config(tmp_path: Path, job: str = "tok", **changes: object) -> MasterConfig:
    config = MasterConfig(job=job, store_url=f"sqlite:///{tmp_path / 'state.db'}", settings=FAST,
                          token_file=str(tmp_path / f"{job}.token"), tcp_store=False, plugins=[])
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def _job(job: str = "tok") -> JobSubmitted:
    return JobSubmitted(job=job, min_nodes=1, max_nodes=1, nproc_per_node=1)


async def _everything(store: StateStore) -> list[tuple[str, bytes]]:
    return [(kv.key, kv.value) for kv in await store.range("/")]


async def test_the_store_keeps_a_verifier_of_the_token_and_never_the_token(tmp_path: Path) -> None:
    async with Master(_config(tmp_path)) as master:
        await master.submit_job(_job())
        token = master.token
        stored = await _everything(master.store)
        assert (verifier_key("tok"), token_verifier("tok", token).encode()) in stored
        assert not [key for key, value in stored if token in key or token.encode() in value]
        assert (tmp_path / "tok.token").read_text().strip() == token  # the agents' copy


async def test_a_master_taking_over_a_running_job_uses_the_token_file_and_answers_its_agents(tmp_path: Path) -> None:
    async with Master(_config(tmp_path)) as first:
        await first.submit_job(_job())
        token = first.token
    assert (tmp_path / "tok.token").exists()  # the job runs on: its agents still read it
    async with Master(_config(tmp_path)) as second:
        assert second.token == token
        async with MasterClient(second.address, token, call_timeout_s=5) as client:
            assert (await client.register(RegisterInfo(node_id="node-0", incarnation=1, host="localhost", pid=1,
                                                       nproc=1))).job == "tok"


async def test_a_master_given_a_token_the_job_s_verifier_does_not_match_refuses_clearly(tmp_path: Path) -> None:
    async with Master(_config(tmp_path)) as first:
        await first.submit_job(_job())
    with pytest.raises(ConfigError, match=r"job 'tok' in sqlite:///.* runs with another token than the one this "
                                          r"master was given .*Pass the job's token: STEAD_JOB_TOKEN"):
        async with Master(_config(tmp_path, token=new_token())):
            pass


async def test_a_master_with_no_token_for_a_running_job_refuses_saying_where_it_looked(tmp_path: Path) -> None:
    async with Master(_config(tmp_path)) as first:
        await first.submit_job(_job())
    (tmp_path / "tok.token").unlink()
    with pytest.raises(ConfigError, match=f"than a new one \\(this master was given none, and {tmp_path}/tok.token "
                                          "does not exist\\)"):
        async with Master(_config(tmp_path)):
            pass


async def test_the_job_s_end_removes_its_verifier_and_token_file_and_its_next_run_takes_a_new_token(
        tmp_path: Path) -> None:
    async with Master(_config(tmp_path)) as first:
        await first.submit_job(_job())
        await first.submit(JobStopped(reason="stopped by the test"))
        await first.wait()
        ended = first.token
    assert not (tmp_path / "tok.token").exists()
    store = await open_store(_config(tmp_path).store_url)
    try:
        assert await store.get(verifier_key("tok")) is None
    finally:
        await store.close()
    again = new_token()
    async with Master(_config(tmp_path, token=again)) as second:
        assert second.token == again != ended


async def test_an_older_store_s_plaintext_token_becomes_a_verifier_and_stays_the_job_s_token(tmp_path: Path) -> None:
    config = _config(tmp_path)
    old = new_token()
    store = await open_store(config.store_url)
    try:
        await store.put(legacy_token_key("tok"), old.encode())
    finally:
        await store.close()
    async with Master(config) as master:
        assert master.token == old
        stored = dict(await _everything(master.store))
        assert legacy_token_key("tok") not in stored
        assert stored[verifier_key("tok")] == token_verifier("tok", old).encode()


@pytest.mark.parametrize("ended", [False, True], ids=["running", "ended"])
async def test_a_held_token_is_written_for_the_agents_and_forgotten_only_when_the_job_ended(tmp_path: Path,
                                                                                            ended: bool) -> None:
    store = await open_store("memory://")
    token_file = tmp_path / "tok.token"
    try:
        async with held_job_token(store, "tok", given=None, token_file=token_file, settings=FAST,
                                  ended=lambda: ended) as token:
            assert token_file.read_text().strip() == token
            assert (await store.get(verifier_key("tok"))) is not None
        assert token_file.exists() is not ended
        assert ((await store.get(verifier_key("tok"))) is None) is ended
    finally:
        await store.close()


def test_a_verifier_depends_on_the_job_and_the_token() -> None:
    token = new_token()
    assert token_verifier("a", token) == token_verifier("a", token)
    assert token_verifier("a", token) != token_verifier("b", token)
    assert token_verifier("a", token) != token_verifier("a", new_token())
    assert token not in token_verifier("a", token)
