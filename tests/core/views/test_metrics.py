"""Prometheus metrics: computed from the log when scraped, served by the master, parsed as Prometheus parses them."""

from __future__ import annotations

import dataclasses
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.events import (
    CheckpointCommitted,
    JobSubmitted,
    NumericsNote,
    NumericsReported,
    Record,
    RecoveryAction,
    RecoveryDecided,
    RoundCompleted,
    RoundStarted,
    StepProgress,
    WorkerFailed,
)
from stead.core.master import Master, MasterConfig
from stead.core.platform import NodeSpec
from stead.core.statemachine import JobState, NodePhase, NodeState
from stead.core.views.metrics import JobMetrics, MetricsServer
from stead.plugins.ckpt.events import CheckpointPersisted
from stead.testing.platforms import RecordingPlatform

pytestmark = pytest.mark.anyio

FAST = Settings(heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0, retry_deadline_s=1.0)
SPEC = JobSubmitted(job="met", min_nodes=1, max_nodes=1, nproc_per_node=1)


def _spec(node_id: str, incarnation: int, address: str, token_file: str) -> NodeSpec:
    return NodeSpec(job="met", node_id=node_id, incarnation=incarnation, command=("stead", "agent"))

MEMBERS = ("node-0", "node-1")
LOG = [
    (0.0, JobSubmitted(job="m", min_nodes=2, max_nodes=2, nproc_per_node=1)),
    (1.0, RoundStarted(round=1, members=MEMBERS, nproc_per_node=1, restart_count=0)), (1.5, RoundCompleted(round=1)),
    *[(2.0 + s, StepProgress(round=1, step=s)) for s in range(1, 5)],  # 4 steps, 1 s each
    (6.3, WorkerFailed(node_id="node-1", round=1, local_rank=0, rank=1, exit_code=1, exited_at=6.2)),
    (6.4, RecoveryDecided(round=1, action=RecoveryAction.RESTART, reason="r", failure_class="transient")),
    (6.5, RoundStarted(round=2, members=MEMBERS, nproc_per_node=1, restart_count=1)), (7.0, RoundCompleted(round=2)),
    (7.5, StepProgress(round=2, step=5)), (8.5, StepProgress(round=2, step=7)),
]


def scrape(url: str, token: str | None = None) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def test_the_metrics_are_the_ledger_the_decisions_and_the_state_of_the_log() -> None:
    state = JobState(step=7, restarts=1, nodes={n: NodeState(node_id=n, incarnation=1, phase=NodePhase.JOINED)
                                                for n in MEMBERS})
    metrics = JobMetrics("m", lambda: state, clock=lambda: 9.0)
    metrics.seed([Record(seq=i, at=at, event=e) for i, (at, e) in enumerate(LOG[:5], 1)])
    for i, (at, event) in enumerate(LOG, 1):  # the reactor tells the seeded records again: counted once
        metrics.observe(Record(seq=i, at=at, event=event), state)
    server = MetricsServer(metrics, host="127.0.0.1", port=0)
    try:
        got = scrape(server.url)
    finally:
        server.close()
    job = (("job", "m"),)
    assert got["stead_goodput_ratio"][job] == pytest.approx(4.5 / 9.0)  # useful: 3 s + 1 s + 0.5 s of 9 s
    assert got["stead_wall_seconds"][(("job", "m"), ("part", "recovery"))] == pytest.approx(1.3)
    assert got["stead_recovery_phase_seconds"][(("job", "m"), ("le", "0.1"), ("phase", "detect"))] == 1.0
    assert got["stead_recovery_phase_seconds"][(("job", "m"), ("le", "0.25"), ("phase", "rendezvous"))] == 0.0
    assert got["stead_recovery_phase_seconds"][(("job", "m"), ("le", "+Inf"), ("phase", "rendezvous"))] == 1.0
    decisions = (("action", "restart"), ("failure_class", "transient"), ("job", "m"))
    assert got["stead_recovery_decisions"][decisions] == 1.0
    assert got["stead_nodes"][(("job", "m"), ("phase", "joined"))] == 2.0
    assert got["stead_step"][job] == 7.0 and got["stead_restarts"][job] == 1.0
    assert got["stead_step_rate"][job] == pytest.approx(2.0)



def test_checkpoint_save_and_persist_times_are_histograms_of_what_the_records_carry() -> None:
    records = [Record(seq=1, at=0.0, event=SPEC), Record(seq=2, at=1.0, event=CheckpointCommitted(step=1, save_s=0.2)),
               Record(seq=3, at=2.0, event=CheckpointCommitted(step=2, save_s=0.04)),
               Record(seq=4, at=2.5, event=CheckpointCommitted(step=3)),  # an agent that timed nothing
               Record(seq=5, at=3.0, event=CheckpointPersisted(step=2, path="p", world_size=1, persist_s=3.5))]
    metrics = JobMetrics("met", JobState, clock=lambda: 4.0)
    metrics.seed(records)
    registry = CollectorRegistry()
    registry.register(metrics)
    got = {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
           for f in text_string_to_metric_families(generate_latest(registry).decode())}
    took = got["stead_checkpoint_seconds"]

    def count(stage: str, le: str) -> float:
        return took[(("job", "met"), ("le", le), ("stage", stage))]

    assert count("save", "0.05") == 1.0 and count("save", "0.25") == 2.0
    assert count("save", "+Inf") == 2.0  # counted: the two that said how long
    assert count("persist", "2.5") == 0.0 and count("persist", "5") == 1.0
    assert got["stead_checkpoints"][(("job", "met"), ("tier", "memory"))] == 3.0


def test_the_numerical_faults_are_counted_by_rule_with_the_steps_skipped_the_notes_and_the_bounded_restores() -> None:
    def decided(round_: int, rule: str, **kw: object) -> RecoveryDecided:
        return RecoveryDecided(round=round_, action=RecoveryAction.RESTART, reason="r", failure_class="numerical",
                               rule=rule, **kw)  # type: ignore[arg-type]

    events = [SPEC, decided(1, "non-finite-gradient", skip_steps=(6,)), decided(2, "loss-spike", skip_steps=(9,)),
              decided(3, "non-finite-gradient", skip_steps=(6,)),  # the same step again: one step skipped
              decided(4, "replica-mismatch", restore_at_most=11),
              RecoveryDecided(round=5, action=RecoveryAction.RESTART, reason="r", failure_class="transient"),
              NumericsReported(node_id="node-0", round=2, dropped=2, notes=(
                  NumericsNote(kind="step_skipped", rank=0, step=6), NumericsNote(kind="loss_spike", rank=1, step=9),
                  NumericsNote(kind="loss_spike", rank=1, step=12, action="record")))]
    metrics = JobMetrics("met", JobState, clock=lambda: 4.0)
    metrics.seed([Record(seq=i, at=float(i), event=e) for i, e in enumerate(events, 1)])
    registry = CollectorRegistry()
    registry.register(metrics)
    got = {f.name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
           for f in text_string_to_metric_families(generate_latest(registry).decode())}
    job = (("job", "met"),)
    assert got["stead_numerical_faults"] == {(("job", "met"), ("rule", "loss-spike")): 1.0,
                                             (("job", "met"), ("rule", "non-finite-gradient")): 2.0,
                                             (("job", "met"), ("rule", "replica-mismatch")): 1.0}
    assert got["stead_steps_skipped"][job] == 2.0
    assert got["stead_numerics_notes"] == {(("job", "met"), ("kind", "dropped")): 2.0,
                                           (("job", "met"), ("kind", "loss_spike")): 2.0,
                                           (("job", "met"), ("kind", "step_skipped")): 1.0}
    assert got["stead_bounded_restores"][job] == 1.0


async def test_a_master_serves_its_metrics_and_frees_the_port_when_it_stops(tmp_path: Path) -> None:
    config = MasterConfig(job="met", settings=FAST, platform=RecordingPlatform(), node_spec=_spec,
                          token_file=str(tmp_path / "met.token"), tcp_store=False, plugins=[], metrics_port=0)
    async with Master(config) as master:
        await master.submit_job(SPEC)
        assert master.metrics_url is not None
        got = scrape(master.metrics_url)
        assert sum(got["stead_nodes"].values()) == 1.0  # its one node, in whatever phase it is by now
        assert got["stead_goodput_ratio"][(("job", "met"),)] == 0.0
        port = int(master.metrics_url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as probe:  # nothing listens there any more
        assert probe.connect_ex(("127.0.0.1", port)) != 0


async def test_metrics_are_off_unless_asked_for(tmp_path: Path) -> None:
    config = MasterConfig(job="quiet", settings=FAST, token_file=str(tmp_path / "q.token"), tcp_store=False,
                          plugins=[])
    async with Master(config) as master:
        assert master.metrics_url is None and master.metrics is None


def _refused(url: str, headers: dict[str, str]) -> int:
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
    return caught.value.code


def test_a_scrape_without_the_token_is_refused_401_and_one_with_it_is_served() -> None:
    server = MetricsServer(JobMetrics("m", JobState), host="127.0.0.1", port=0, token="s3cret")
    try:
        assert _refused(server.url, {}) == 401
        assert _refused(server.url, {"Authorization": "Bearer wrong"}) == 401
        assert _refused(server.url, {"Authorization": "Basic czNjcmV0"}) == 401
        assert "stead_goodput_ratio" in scrape(server.url, token="s3cret")
    finally:
        server.close()


async def test_a_master_serves_metrics_on_metrics_host_behind_the_token_of_metrics_token_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.token").write_text("tok-1\n")  # as a Secret's file may end: the newline is not the token
    settings = dataclasses.replace(FAST, metrics_host="127.0.0.2", metrics_token_file=str(tmp_path / "metrics.token"))
    config = MasterConfig(job="met", settings=settings, platform=RecordingPlatform(), node_spec=_spec,
                          token_file=str(tmp_path / "met.token"), tcp_store=False, plugins=[], metrics_port=0)
    async with Master(config) as master:
        assert master.metrics_url is not None and master.metrics_url.startswith("http://127.0.0.2:")
        assert _refused(master.metrics_url, {}) == 401
        assert "stead_nodes" in scrape(master.metrics_url, token="tok-1")


async def test_an_empty_metrics_token_file_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    settings = dataclasses.replace(FAST, metrics_token_file=str(tmp_path / "empty"))
    config = MasterConfig(job="met", settings=settings, token_file=str(tmp_path / "met.token"), tcp_store=False,
                          plugins=[], metrics_port=0)
    with pytest.raises(ConfigError, match=r"metrics_token_file .* is empty; write the token"):
        async with Master(config):
            pass


def test_stead_master_serves_no_metrics_unless_asked() -> None:
    from stead.cli import build_parser

    args = build_parser().parse_args(["master", "--store", "memory://", "--job", "j"])
    assert args.metrics_port == -1 and Settings().metrics_host == "127.0.0.1"


#: the longest a test waits for the metrics server to do something on its own (a bound for a broken test only)
WITHIN_S = 10.0


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` within WITHIN_S (it sends nothing first: the request was never read)."""
    sock.settimeout(WITHIN_S)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_metrics_connection_that_sends_nothing_is_closed_after_metrics_request_timeout_s() -> None:
    # each connection holds a thread of the master: a silent one held it for ever
    server = MetricsServer(JobMetrics("m", JobState), host="127.0.0.1", port=0, request_timeout_s=0.2)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as silent:
            assert _closed_by_server(silent), "a silent metrics connection was kept"
        with socket.create_connection(("127.0.0.1", server.port)) as partial:
            partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and the rest never comes
            assert _closed_by_server(partial), "a metrics connection that stopped mid-request was kept"
        assert "stead_goodput_ratio" in scrape(server.url)
    finally:
        server.close()


def test_metrics_connections_over_metrics_max_connections_are_closed_at_once_and_scrapes_go_on() -> None:
    server = MetricsServer(JobMetrics("m", JobState), host="127.0.0.1", port=0, max_connections=2,
                           request_timeout_s=600)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            assert _closed_by_server(extra), "a connection over metrics_max_connections was served"
    finally:
        for sock in held:
            sock.close()
    try:
        deadline = time.monotonic() + WITHIN_S
        while True:  # the held connections' threads see them closed, and give their slots back
            try:
                assert "stead_goodput_ratio" in scrape(server.url)
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:  # a guard against a hang, not a timing
                    pytest.fail("the slots of closed metrics connections were not given back")
                time.sleep(0.05)
    finally:
        server.close()


@pytest.mark.parametrize("what", ["port", "host"])
async def test_a_metrics_address_the_master_cannot_serve_on_is_a_config_error_that_says_which(
        tmp_path: Path, what: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] if what == "port" else 0
        host = "127.0.0.1" if what == "port" else "no-such-host.invalid"
        settings = dataclasses.replace(FAST, metrics_host=host)
        config = MasterConfig(job="met", settings=settings, token_file=str(tmp_path / "met.token"), tcp_store=False,
                              plugins=[], metrics_port=port)
        with pytest.raises(ConfigError, match=rf"cannot serve metrics on {host}:{port}: .+; choose another "
                                              r"metrics_port \(0: a free one\) or a metrics_host of this machine"):
            async with Master(config):
                pass
