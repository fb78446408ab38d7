"""What a NaN gradient or a loss spike leads to: numerics.on_nan (skip, restore, fail), numerics.loss_spike=skip and
numerics.nan_budget, decided by the diagnosis plugin."""

from __future__ import annotations

import pytest

from stead.core.config import Settings
from stead.core.events import RecoveryDecided
from stead.plugin import NumericsSettings
from stead.plugins.diagnosis import DiagnosisPlugin
from stead.plugins.diagnosis.numerical import decide_numerical, fault_step, restore_bound
from stead.plugins.diagnosis.rules import Action, Classification, FailureClass
from stead.plugins.diagnosis.settings import DiagnosisSettings
from tests.plugins.test_diagnosis import TRACEBACK, _decisions, _failure


def _nan(host: str, step: int) -> str:
    return TRACEBACK.format(line=f"[rank1]: stead.core.worker.numerics.NonFiniteGradientError: non-finite gradient "
                                 f"(NaN or Inf) on rank 1 (host {host}) at step {step}: gradient bucket(s) [0]")


def _spike(host: str, step: int) -> str:
    return TRACEBACK.format(line=f"[rank1]: stead.core.worker.loss_spike.LossSpikeError: loss spike on rank 1 (host "
                                 f"{host}) at step {step}: loss 40, 31.0 robust standard deviations above the median 2")


async def _decided(tails: list[tuple[str, int]], **numerics: str) -> list[RecoveryDecided]:
    failures = [_failure(tail, step=step - 1, round=round_) for round_, (tail, step) in enumerate(tails, 1)]
    settings = Settings.from_mapping({f"numerics.{k}": v for k, v in numerics.items()})
    got = await _decisions(DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=0)), failures,
                           stead_settings=settings)
    return [d for d in got if isinstance(d, RecoveryDecided)]


@pytest.mark.anyio
@pytest.mark.parametrize(("tails", "numerics", "decided"), [
    # the default (skip): each NaN rolls back and skips its step; other steps, other hosts: each its own skip
    ([(_nan("h1", 4), 4), (_nan("h2", 9), 9)], {},
     [("restart", "non-finite-gradient", (4,)), ("restart", "non-finite-gradient", (9,))]),
    # a loss spike under loss_spike=skip (the worker raises only then): its step skipped, whatever on_nan says
    ([(_spike("h1", 7), 7)], {"on_nan": "restore"}, [("restart", "loss-spike", (7,))]),
    # a skipped step is no repeated failure; one that faults again although skipped takes the usual path
    ([(_nan("h1", 4), 4), (_nan("h1", 4), 4), (_nan("h1", 4), 4)], {},
     [("restart", "non-finite-gradient", (4,)), ("restart", "non-finite-gradient", ()),
      ("fail", "repeated-failure", ())]),
    # a NaN on the same host at another step: the host's, not the batch's (nothing skipped, the node relaunched)
    ([(_nan("h1", 4), 4), (_nan("h1", 9), 9)], {},
     [("restart", "non-finite-gradient", (4,)), ("relaunch", "non-finite-follows-host", ())]),
    # restore: today's behaviour, nothing skipped; the same NaN at the same step again fails the job
    ([(_nan("h1", 4), 4), (_nan("h1", 4), 4)], {"on_nan": "restore"},
     [("restart", "non-finite-gradient", ()), ("fail", "repeated-failure", ())]),
    # fail: at once
    ([(_nan("h1", 4), 4)], {"on_nan": "fail"}, [("fail", "non-finite-gradient", ())]),
    # the budget: the third fault with nan_budget=2 fails the job, loss spikes and NaNs alike
    ([(_nan("h1", 4), 4), (_spike("h2", 6), 6), (_nan("h3", 12), 12)], {"nan_budget": "2"},
     [("restart", "non-finite-gradient", (4,)), ("restart", "loss-spike", (6,)), ("fail", "nan-budget", ())]),
    ([(_nan("h1", 4), 4)], {"nan_budget": "0", "on_nan": "restore"}, [("fail", "nan-budget", ())]),
])
async def test_a_numerical_fault_is_skipped_restored_or_fails_the_job_as_the_settings_say(
        tails: list[tuple[str, int]], numerics: dict[str, str],
        decided: list[tuple[str, str, tuple[int, ...]]]) -> None:
    decisions = await _decided(tails, **numerics)
    assert [(d.action.value, d.rule, d.skip_steps) for d in decisions] == decided
    for decision, (_, rule, skip) in zip(decisions, decided, strict=True):
        assert decision.failure_class == ("user_error" if rule == "repeated-failure" else "numerical")
        if skip:
            assert f"step {skip[0]}'s batch is skipped on every rank" in decision.evidence


@pytest.mark.anyio
async def test_the_budget_decision_names_the_count_and_the_setting_to_raise() -> None:
    *_, last = await _decided([(_nan("h1", 4), 4), (_nan("h2", 9), 9)], nan_budget="1")
    assert last.action.value == "fail"
    assert "numerical fault 2 of the job" in last.evidence and "numerics.nan_budget=1" in last.evidence
    assert "--set numerics.nan_budget=N" in last.evidence and "at step 9" in last.evidence


@pytest.mark.anyio
async def test_the_fault_count_survives_a_master_restart() -> None:
    from stead.core.store import open_store

    store = await open_store("memory://")
    settings = Settings.from_mapping({"numerics.nan_budget": "1"})
    plugin = DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=0))
    await _decisions(plugin, [_failure(_nan("h1", 4), step=3)], store=store, stead_settings=settings)
    after_restart = DiagnosisPlugin(settings=DiagnosisSettings(root_cause_wait_s=0))  # reads the store afresh
    (decision,) = [d for d in await _decisions(after_restart, [_failure(_nan("h2", 9), step=8, round=2)],
                                               store=store, stead_settings=settings)
                   if isinstance(d, RecoveryDecided)]
    assert (decision.action.value, decision.rule) == ("fail", "nan-budget")


def _found(rule: str, evidence: str = "X at step 5: y") -> Classification:
    return Classification(FailureClass.NUMERICAL, Action.RESTART, rule, evidence)


@pytest.mark.parametrize(("rule", "settings", "faults", "skipped", "expected"), [
    ("non-finite-gradient", NumericsSettings(), 1, frozenset(), ("restart", (5,))),
    ("non-finite-gradient", NumericsSettings(), 6, frozenset(), ("fail", ())),  # default budget 5
    ("non-finite-gradient", NumericsSettings(), 5, frozenset({5}), (None, ())),  # skipped already: usual path
    ("non-finite-gradient", NumericsSettings(on_nan="restore"), 1, frozenset(), (None, ())),
    ("non-finite-gradient", NumericsSettings(on_nan="fail"), 1, frozenset(), ("fail", ())),
    ("loss-spike", NumericsSettings(on_nan="fail"), 1, frozenset(), ("restart", (5,))),
    ("replica-mismatch", NumericsSettings(), 99, frozenset(), (None, ())),  # not this module's: the host's fault
])
def test_decide_numerical_table(rule: str, settings: NumericsSettings, faults: int, skipped: frozenset[int],
                                expected: tuple[str | None, tuple[int, ...]]) -> None:
    verdict = decide_numerical(_found(rule), settings=settings, faults=faults, skipped=skipped)
    assert (verdict.found.action.value if verdict.found else None, verdict.skip_steps) == expected


def test_fault_step_reads_the_step_the_error_names() -> None:
    assert fault_step("non-finite gradient (NaN or Inf) on rank 1 (host h) at step 12: bucket") == 12
    assert fault_step("loss spike on rank 0 (host h-at step 3x)") is None
    assert fault_step("no step here") is None


def _mismatch(agreed: str, *, blamed: bool = True) -> str:
    if blamed:
        line = ("[rank1]: stead.core.worker.numerics.ReplicaMismatchError: replica mismatch: rank 1 (host h1) at step "
                f"8: its parameters differ from the majority's (2 of 3 replicas agree) in 0.weight; {agreed}. The step")
    else:
        line = ("[rank0]: stead.core.worker.numerics.ReplicaMismatchError: replicas' parameters differ at step 8 and "
                f"no replica can be blamed: 2 replicas, no majority (host h0, rank 0); {agreed}. stead restores")
    return TRACEBACK.format(line=line)


@pytest.mark.anyio
@pytest.mark.parametrize(("tail", "decided"), [
    # fingerprints every 3 steps: the corruption of step 6 or 7 reached every replica before step 8 showed it
    (_mismatch("fingerprints last agreed at step 5"), ("relaunch", "replica-mismatch", 5)),
    (_mismatch("fingerprints last agreed at step 5", blamed=False), ("restart", "replica-mismatch-unattributed", 5)),
    # none compared since this run restored step 3 / since the initial state
    (_mismatch("fingerprints last agreed at step 3 (the step this run of the workers restored; none compared "
               "since)"), ("relaunch", "replica-mismatch", 3)),
    (_mismatch("fingerprints last agreed at step -1 (the script's initial state; none compared since)"),
     ("relaunch", "replica-mismatch", -1)),
    # an error that names no agreed step (another stead's): the usual restore, no bound
    (_mismatch("no step named"), ("relaunch", "replica-mismatch", None)),
    # another numerical fault: no bound
    (_nan("h1", 4), ("restart", "non-finite-gradient", None)),
])
async def test_a_replica_mismatch_bounds_the_restore_to_the_last_step_whose_fingerprints_agreed(
        tail: str, decided: tuple[str, str, int | None]) -> None:
    (decision,) = await _decided([(tail, 8)])
    assert (decision.action.value, decision.rule, decision.restore_at_most) == decided
    bound = decided[2]
    if bound is not None and bound >= 0:
        said = f"the restore is bounded to step {bound}, the last whose replicas' fingerprints agreed"
        assert said in decision.reason
        assert "none left there: the round starts from the script's initial state" in decision.reason
    elif bound is not None:
        assert "the round starts from the initial state, no checkpoint is restored" in decision.reason
    else:
        assert "bounded" not in decision.reason


@pytest.mark.anyio
async def test_a_mismatch_that_fails_the_job_bounds_nothing() -> None:
    tail = _mismatch("fingerprints last agreed at step 5")
    first, *_, last = await _decided([(tail, 8), (tail, 8)])  # the same error at the same step: repeated-failure
    assert (first.action.value, first.restore_at_most) == ("relaunch", 5)
    assert (last.action.value, last.rule, last.restore_at_most) == ("fail", "repeated-failure", None)


def test_restore_bound_reads_the_step_the_error_names() -> None:
    assert restore_bound(_found("replica-mismatch", "x; fingerprints last agreed at step 12. The")) == 12
    assert restore_bound(_found("replica-mismatch-unattributed", "fingerprints last agreed at step -1 (the")) == -1
    assert restore_bound(_found("non-finite-gradient", "fingerprints last agreed at step 12")) is None
