"""The diagnosis plugin's basic recovery rules."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from stead.core.config import Settings
from stead.core.errors import ConfigError
from stead.core.events import Event, PluginsStarted, Record, RecoveryAction, RecoveryDecided, WorkerFailed
from stead.core.plugins import NodeTelemetry, NoSettings, PluginContext
from stead.core.statemachine import JobPhase, JobState, NodePhase, NodeState
from stead.core.statemachine.rendezvous import RendezvousState
from stead.core.store import open_store
from stead.plugin import classify, last_exception
from stead.plugins.diagnosis import DiagnosisPlugin
from stead.plugins.diagnosis.settings import DiagnosisSettings

TRACEBACK = "Traceback (most recent call last):\n  File \"train.py\", line 3\n{line}\n"


def _failure(tail: str = "", *, exit_code: int | None = 1, signal: int | None = None, step: int | None = 3,
             round: int = 1) -> WorkerFailed:
    return WorkerFailed(node_id="node-0", round=round, local_rank=0, rank=2, exit_code=exit_code, signal=signal,
                        step=step, error_tail=tail)


@pytest.mark.parametrize(
    ("failure", "action"),
    [
        (_failure(TRACEBACK.format(line="NameError: name 'x' is not defined")), RecoveryAction.FAIL),
        (_failure(TRACEBACK.format(line="[rank2]: ModuleNotFoundError: No module named 'y'")), RecoveryAction.FAIL),
        (_failure(TRACEBACK.format(line="SyntaxError: invalid syntax")), RecoveryAction.FAIL),
        (_failure(TRACEBACK.format(line="RuntimeError: [gloo] Connection reset by peer")), RecoveryAction.RESTART),
        (_failure("", exit_code=None, signal=9), RecoveryAction.RESTART),
        (_failure("", exit_code=137), RecoveryAction.RESTART),
        (_failure("some text without a traceback"), RecoveryAction.RESTART),
        (_failure(TRACEBACK.format(line="stead.core.errors.InvalidRequest: round 2 of dataset 'train' already "
                                        "started from the beginning (no cursor)")), RecoveryAction.FAIL),
        (_failure(TRACEBACK.format(line="[rank0]: stead.plugins.ckpt.errors.StateMismatch: step 3 does not fit")),
         RecoveryAction.FAIL),
        (_failure(TRACEBACK.format(line="stead.core.errors.ConfigError: --set x=1")), RecoveryAction.FAIL),
    ],
)
def test_classify_fails_fast_only_on_errors_a_restart_would_repeat(failure: WorkerFailed,
                                                                   action: RecoveryAction) -> None:
    assert classify(failure)[0] is action


def test_last_exception_reads_the_last_traceback_line() -> None:
    tail = TRACEBACK.format(line="ValueError: first") + TRACEBACK.format(line="KeyError: 'k'")
    assert last_exception(tail) == ("KeyError", "'k'")
    assert last_exception("no error here") is None


def test_last_exception_reads_a_rank_prefixed_traceback_whatever_the_exceptions_name() -> None:
    tail = ("[rank1]: Traceback (most recent call last):\n"
            '[rank1]:   File "train.py", line 26, in <module>\n'
            "[rank1]:     opt.step()\n"
            "[rank1]: stead.core.worker.numerics.NonFiniteGradientError: on rank 1\n")
    assert last_exception(tail) == ("NonFiniteGradientError", "on rank 1")
    # the frames keep their indentation under the prefix: a name without Error at its end is read too
    assert last_exception(tail.replace("NonFiniteGradientError", "StopTraining")) == ("StopTraining", "on rank 1")


async def _decisions(plugin: DiagnosisPlugin, failures: list[WorkerFailed], store: Any = None,
                     stead_settings: Settings | None = None) -> list[Event]:
    """Each failure, in its own round, given to ``plugin`` as the one its round awaits a decision on (the steps
    its decisions skip folded into the state, as the job machine does)."""
    store = store or await open_store("memory://")
    emitted: list[Event] = []
    state = JobState(phase=JobPhase.RECOVERING, awaiting_decision=True)

    async def emit(event: Event) -> Record:
        emitted.append(event)
        return Record(seq=len(emitted), at=0.0, event=event)

    ctx = PluginContext(plugin="diagnosis", job="j", settings=NoSettings(), stead_settings=stead_settings or Settings(),
                        store=store, state=lambda: state, emit=emit, add_rpc_handler=None)
    for seq, failure in enumerate(failures, 1):
        state = dataclasses.replace(state, last_failure=failure)
        await plugin.handle(record=Record(seq=seq, at=0.0, event=failure), ctx=ctx)
        skipped = {s for e in emitted if isinstance(e, RecoveryDecided) for s in e.skip_steps}
        state = dataclasses.replace(state, skip_steps=frozenset(skipped))
    return emitted


VALUE = TRACEBACK.format(line="ValueError: warmup_steps=-3 must not be negative")
OTHER = TRACEBACK.format(line="RuntimeError: CUDA error: an illegal memory access")
#: a network still broken (a partition between two hosts) fails every attempt the same way: not a bug
GLOO = TRACEBACK.format(line="RuntimeError: [gloo/transport/tcp/socket.cc:142] rv != -1. -1 vs -1. connect: "
                             "Invalid argument")


@pytest.mark.anyio
@pytest.mark.parametrize(("steps_and_tails", "actions"), [
    ([(3, VALUE), (3, VALUE)], ["restart", "fail"]),
    ([(3, VALUE), (4, VALUE)], ["restart", "restart"]),  # another step: the world may differ, restarts are kept
    ([(3, VALUE), (3, OTHER)], ["restart", "restart"]),  # another error
    ([(None, VALUE), (None, VALUE)], ["restart", "fail"]),  # no step known: the same traceback twice in a row
    ([(None, VALUE), (None, OTHER), (None, VALUE)], ["restart", "restart", "restart"]),  # ...not in a row
    ([(3, VALUE), (5, OTHER), (3, VALUE)], ["restart", "restart", "fail"]),  # at one step: however far apart
    ([(None, GLOO), (None, GLOO), (None, GLOO)], ["restart", "restart", "restart"]),  # a collective's: the world's
    ([(3, GLOO), (3, GLOO)], ["restart", "restart"]),
    # failing again right after the restore, before its round finished a step: the same traceback is that failure
    ([(3, VALUE), (None, VALUE)], ["restart", "fail"]),
    ([(3, VALUE), (None, OTHER)], ["restart", "restart"]),
    ([(3, VALUE), (5, OTHER), (None, VALUE)], ["restart", "restart", "restart"]),  # not right after it
])
async def test_a_failure_that_repeats_is_a_user_error_on_its_second_occurrence(
        steps_and_tails: list[tuple[int | None, str]], actions: list[str]) -> None:
    failures = [_failure(tail, step=step, round=round_) for round_, (step, tail) in enumerate(steps_and_tails, 1)]
    decided = await _decisions(DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=0)), failures)
    assert [d.action.value for d in decided if isinstance(d, RecoveryDecided)] == actions
    last = decided[-1]
    assert isinstance(last, RecoveryDecided)
    if last.action is RecoveryAction.FAIL:
        assert (last.failure_class, last.rule) == ("user_error", "repeated-failure")
        first_round, last_round = failures[0].round, failures[-1].round
        assert f"round {first_round} (rank 2" in last.evidence and f"round {last_round} (rank 2" in last.evidence
        assert "ValueError: warmup_steps=-3 must not be negative" in last.reason


#: numerics.on_nan=restore: a NaN rolls back and trains its step again (the default skips it)
RESTORE = Settings.from_mapping({"numerics.on_nan": "restore"})


def _nan(host: str, step: int) -> str:
    return TRACEBACK.format(line=f"[rank1]: stead.core.worker.numerics.NonFiniteGradientError: non-finite gradient "
                                 f"(NaN or Inf) on rank 1 (host {host}) at step {step}: gradient bucket(s) [0]")


@pytest.mark.anyio
@pytest.mark.parametrize(("hosts_and_steps", "decided"), [
    ([("h1", 4), ("h1", 9)], [("restart", "non-finite-gradient"), ("relaunch", "non-finite-follows-host")]),
    ([("h1", 4), ("h2", 9)], [("restart", "non-finite-gradient"), ("restart", "non-finite-gradient")]),
    ([("h1", 4), ("h1", 4)], [("restart", "non-finite-gradient"), ("fail", "repeated-failure")]),  # the data's
    ([("h1", 4), ("h2", 9), ("h1", 7)], [("restart", "non-finite-gradient"), ("restart", "non-finite-gradient"),
                                         ("relaunch", "non-finite-follows-host")]),
])
async def test_a_nan_that_comes_back_on_its_host_with_other_data_has_the_host_kept_out(
        hosts_and_steps: list[tuple[str, int]], decided: list[tuple[str, str]]) -> None:
    failures = [_failure(_nan(host, step), step=step, round=round_)
                for round_, (host, step) in enumerate(hosts_and_steps, 1)]
    got = await _decisions(DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=0)), failures,
                           stead_settings=RESTORE)
    decisions = [d for d in got if isinstance(d, RecoveryDecided)]
    assert [(d.action.value, d.rule) for d in decisions] == decided
    if decided[-1][1] == "non-finite-follows-host":
        assert "a non-finite gradient on host h1 again, at step" in decisions[-1].evidence


@pytest.mark.anyio
async def test_a_restarted_master_remembers_the_failures_already_seen() -> None:
    store = await open_store("memory://")
    await _decisions(DiagnosisPlugin(), [_failure(OTHER, round=1)], store)
    (decided,) = await _decisions(DiagnosisPlugin(), [_failure(OTHER, round=2)], store)
    assert isinstance(decided, RecoveryDecided) and decided.action is RecoveryAction.FAIL
    assert "the same error at the same step twice" in decided.reason
    await store.close()


@pytest.mark.anyio
@pytest.mark.parametrize(("table", "fails_at"), [("after = 3", 3), ("after = 0", None),
                                                 ('class = "transient"', None), ('of = ["collective"]', None)])
async def test_the_rules_file_says_when_and_as_what_a_repeat_is_decided(tmp_path: Path, table: str,
                                                                         fails_at: int | None) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text(f"[repeats]\n{table}\n")
    plugin = DiagnosisPlugin(settings=DiagnosisSettings(rules_file=str(rules)))
    decided = await _decisions(plugin, [_failure(VALUE, round=r) for r in (1, 2, 3)])
    actions = [d.action for d in decided if isinstance(d, RecoveryDecided)]
    assert actions == [RecoveryAction.FAIL if r == fails_at else RecoveryAction.RESTART for r in (1, 2, 3)]
    if table.startswith("of"):  # repeats of collective errors only: a transient one is not counted
        assert all(isinstance(d, RecoveryDecided) and d.rule == "unknown" for d in decided)
    if table.startswith("class"):  # decided as a transient repeat: restarted, and named as a repeat
        assert isinstance(decided[-1], RecoveryDecided) and decided[-1].rule == "repeated-failure"


@pytest.mark.parametrize(("table", "problem"), [("after = 1", "after = 1"), ("after = -2", "after = -2"),
                                                ('class = "flaky"', "class = 'flaky'"), ("times = 2", "unknown key"),
                                                ('of = "transient"', "of = 'transient'"),
                                                ('of = ["network"]', "of = 'network'")])
def test_a_bad_repeats_table_is_a_clear_error(tmp_path: Path, table: str, problem: str) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text(f"[repeats]\n{table}\n")
    with pytest.raises(ConfigError, match=re.escape(problem)):
        DiagnosisPlugin(settings=DiagnosisSettings(rules_file=str(rules)))


@pytest.mark.anyio
async def test_follow_on_failures_of_a_round_already_handled_are_ignored() -> None:
    store = await open_store("memory://")
    emitted: list[Event] = []

    async def emit(event: Event) -> Record:
        emitted.append(event)
        return Record(seq=len(emitted), at=0.0, event=event)

    handled = _failure("x")
    state = JobState(phase=JobPhase.RECOVERING, awaiting_decision=True, last_failure=handled)
    ctx = PluginContext(plugin="diagnosis", job="j", settings=NoSettings(), stead_settings=Settings(), store=store,
                        state=lambda: state, emit=emit, add_rpc_handler=None)
    await DiagnosisPlugin().handle(record=Record(seq=1, at=0.0, event=_failure("other")), ctx=ctx)
    assert emitted == []
    await store.close()


#: the job as a master that takes it over finds it after its replay: round 4 running, its node adopted
RUNNING_ROUND_4 = JobState(phase=JobPhase.RUNNING, step=9, rdzv=RendezvousState(round=4, members=("n0",), active=True),
                           nodes={"n0": NodeState(node_id="n0", incarnation=2, phase=NodePhase.JOINED)})
PACED = DiagnosisSettings(hang_floor_s=3.0)


@contextlib.asynccontextmanager
async def takeover_store() -> AsyncIterator[tuple[PluginContext, list[JobState]]]:
    """A diagnosis context on a store where a master that died had published round 4's pace (0.1 s a step);
    the list holds the state the context shows (replace its item to move the job on)."""
    store = await open_store("memory://")
    states = [JobState()]
    ctx = PluginContext(plugin="diagnosis", job="j", settings=NoSettings(), stead_settings=Settings(), store=store,
                        state=lambda: states[0], emit=None, add_rpc_handler=None)  # type: ignore[arg-type]
    old = DiagnosisPlugin(settings=PACED)
    old.clock.start_round(4, 0.0)
    for step in range(10):
        old.clock.observe(4, step, 1.0 + step / 10)
    await old._write_status(ctx, force=True)
    try:
        yield ctx, states
    finally:
        await store.close()


async def caught_up(plugin: DiagnosisPlugin, ctx: PluginContext, states: list[JobState]) -> None:
    """The replay ended with round 4 running: the master announces its plugins."""
    states[0] = RUNNING_ROUND_4
    started = PluginsStarted(plugins=("diagnosis",), deciders=("diagnosis",))
    await plugin.handle(record=Record(seq=1, at=0.0, event=started), ctx=ctx)


@pytest.mark.anyio
async def test_a_master_that_takes_over_a_running_round_goes_on_watching_it_for_hangs() -> None:
    async with takeover_store() as (ctx, states):
        new = DiagnosisPlugin(settings=PACED)
        await new.start(ctx=ctx)  # plugins start before the new master replays its log: it knows nothing yet
        try:
            assert new.clock.round == 0
            await new._write_status(ctx, force=True)  # its watch publishes before the replay ends: nothing is lost
            await caught_up(new, ctx, states)
            assert (new.clock.round, new.clock.step) == (4, 9)
            assert new.clock.threshold()[0] == 3.0, "the step pace the old master learnt was lost"
            assert new._alive == {("n0", 2)}, "a failure of an adopted node would go unclassified"
        finally:
            await new.stop(ctx=ctx)


@pytest.mark.anyio
async def test_a_master_killed_before_it_caught_up_passes_the_pace_on_to_the_next() -> None:
    async with takeover_store() as (ctx, states):
        second = DiagnosisPlugin(settings=PACED)  # starts, publishes before its replay ends, and is killed
        await second.start(ctx=ctx)
        await second._write_status(ctx, force=True)
        await second.stop(ctx=ctx)
        third = DiagnosisPlugin(settings=PACED)
        await third.start(ctx=ctx)
        try:
            await caught_up(third, ctx, states)
            assert (third.clock.round, third.clock.step) == (4, 9)
            assert third.clock.threshold()[0] == 3.0, "a master that died young erased the pace: 600 s to a hang"
        finally:
            await third.stop(ctx=ctx)


@pytest.mark.anyio
async def test_a_stall_the_heartbeats_disprove_leaves_the_hang_threshold_as_it_was() -> None:
    store = await open_store("memory://")
    emitted: list[Event] = []

    async def emit(event: Event) -> Record:
        emitted.append(event)
        return Record(seq=len(emitted), at=0.0, event=event)

    # the progress records of round 4 stopped at step 9 a minute ago (the store was away); the heartbeats say 30
    heard = {"n0": NodeTelemetry(incarnation=2, round=4, step=30, step_compute_s=None, rss_bytes=None,
                                 cpu_percent=None, seen=time.monotonic())}
    ctx = PluginContext(plugin="diagnosis", job="j", settings=NoSettings(), stead_settings=Settings(), store=store,
                        state=lambda: RUNNING_ROUND_4, emit=emit, add_rpc_handler=None,  # type: ignore[arg-type]
                        telemetry=lambda: heard)
    plugin = DiagnosisPlugin(settings=PACED)
    start = time.time() - 60
    plugin.clock.start_round(4, start)
    for step in range(10):
        plugin.clock.observe(4, step, start + 1 + step / 10)
    before = plugin.clock.threshold()
    try:
        await plugin._check_hang(ctx)
        assert emitted == [], "the job was diagnosed as hung while its heartbeats showed it training"
        assert plugin.clock.step == 30
        assert plugin.clock.threshold() == before, "the unrecorded minute counted as one step's time"
    finally:
        await store.close()


@pytest.mark.anyio
async def test_repeated_collective_errors_count_when_the_rules_file_says_so(tmp_path: Path) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text('[repeats]\nof = ["transient", "collective"]\n')
    plugin = DiagnosisPlugin(settings=DiagnosisSettings(rules_file=str(rules), root_cause_wait_s=0))
    decided = await _decisions(plugin, [_failure(GLOO, step=None, round=r) for r in (1, 2)])
    assert [d.action for d in decided if isinstance(d, RecoveryDecided)] == [RecoveryAction.RESTART,
                                                                             RecoveryAction.FAIL]
