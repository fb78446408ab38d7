"""Recorded event logs of real jobs, replayed: a change in what a log means shows up as a diff.

``logs/<name>.jsonl`` is the event log of a real job with a real fault (a worker crash, a lost
node, a hang, a resize, a killed master, an OOM; see ``record.py``, which ran them), as
``stead events --json`` printed it. Each is folded by the job machine's one fold
(:func:`stead.core.statemachine.fold`) and by the recovery view (:mod:`stead.core.views.recovery`);
what they make of it (phase, rounds, restarts, each node's phase, the records refused, the effects
asked for, every recovery with its phases) must equal ``expected/<name>.json``. A change to the job
machine or the recovery fold that changes the meaning of a real job's log fails here; when the
change is meant, write the summaries anew with ``python tests/replay/test_replay.py --update`` and
commit them with it: their diff says what changed. The reactor's replay (``Reactor.resume``, from
the log alone or from a snapshot, in this format or the one before timers were part of the state)
must reach the same state.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from stead.core.config import Settings
from stead.core.events import Record, decode_record, encode_record
from stead.core.events.log import EventLog, job_prefix
from stead.core.master.reactor import Reactor
from stead.core.serde import to_json
from stead.core.statemachine import Effect, Emit, JobState, fold
from stead.core.store import StateStore, open_store
from stead.core.views.recovery import recoveries
from stead.testing import FakeClock

HERE = Path(__file__).parent
LOGS = sorted((HERE / "logs").glob("*.jsonl"))
EXPECTED = HERE / "expected"


def load(path: Path) -> list[Record]:
    return [decode_record(line.encode(), where=f"{path.name} line {i}")
            for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


def summary(records: list[Record]) -> dict[str, Any]:
    """What the fold and the recovery view make of ``records``: every figure a change in meaning would move."""
    state, refused, effects = JobState(), [], collections.Counter[str]()
    for record in records:
        result = fold(state, record)
        state = result.state
        if result.rejected is not None:
            refused.append(f"{record.seq} {record.event.type_name}: {result.rejected}")
        effects.update(effect.kind for effect in result.effects)
    return {
        "records": len(records),
        "kinds": dict(sorted(collections.Counter(r.event.type_name for r in records).items())),
        "phase": state.phase.value,
        "reason": state.reason,
        "rounds": state.rdzv.round,
        "members": list(state.rdzv.members),
        "restarts": state.restarts,
        "resumed": state.life,
        "step": state.step,
        "checkpoint_step": state.checkpoint_step,
        "nodes": {n.node_id: f"{n.phase.value} (incarnation {n.incarnation})" for n in state.nodes.values()},
        "timers": sorted(str(timer) for timer in state.timers),  # by the names the log stores
        "refused": refused,
        "effects": dict(sorted(effects.items())),
        "recoveries": [{"cause": r.kind.value, "round": r.round, "outcome": r.outcome.value,
                        "phases": {p.value: round(s, 3) for p, s in r.phases.items()}} for r in recoveries(records)],
    }


def _expected(path: Path) -> Path:
    return EXPECTED / f"{path.stem}.json"


def test_the_recorded_logs_are_there_and_small() -> None:
    assert {p.stem for p in LOGS} >= {"worker-crash", "node-loss", "hang", "resize", "master-kill", "oom-batch",
                                      "k8s-oom"}
    assert sum(p.stat().st_size for p in LOGS) < 200 * 1024
    assert sorted(p.stem for p in EXPECTED.glob("*.json")) == [p.stem for p in LOGS]


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_a_recorded_log_folds_to_its_expected_summary(path: Path) -> None:
    got, expected = summary(load(path)), json.loads(_expected(path).read_text())
    assert got == expected, (f"{path.name} no longer means what {_expected(path).name} says; if the change is "
                             "meant, run `python tests/replay/test_replay.py --update` and commit the diff")


# -- the reactor's replay -------------------------------------------------------------------------------------


class _Refuses:
    """The executor of a replay: every effect of the log was carried out already, so none may run again."""

    async def run(self, effect: Effect) -> None:
        raise AssertionError(f"{effect.id} ran again on a replay of a log whose effects were all done")


#: keys written together (a store's transaction takes at most 128)
_PER_WRITE = 64


async def _stored(records: list[Record], *, job: str = "replayed") -> tuple[StateStore, EventLog]:
    """A memory store holding ``records`` as the master that wrote them left them: its effects all done."""
    store = await open_store("memory://")
    events, state, effects = EventLog(store, job), JobState(), dict[str, bytes]()
    for record in records:
        result = fold(state, record)
        state = result.state
        for effect in result.effects:  # an emission's key was written with its event; any other was marked done
            effects[f"{job_prefix(job)}effects/{effect.id}"] = b"" if isinstance(effect, Emit) else b"done"
    items = [*((events.key(r.seq), encode_record(r)) for r in records), *effects.items()]
    for i in range(0, len(items), _PER_WRITE):
        await store.put_all(items[i:i + _PER_WRITE])
    return store, events


async def _resumed(events: EventLog, records: list[Record]) -> JobState:
    clock = FakeClock(start=records[0].at)  # held at the log's start: no timer it armed is due, none fires
    async with Reactor(events, _Refuses(), settings=Settings(), clock=clock) as reactor:
        return await reactor.resume()


@pytest.mark.anyio
@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
async def test_the_reactor_resumes_a_recorded_log_to_the_fold_s_state(path: Path) -> None:
    records = load(path)
    store, events = await _stored(records)
    try:
        state = await _resumed(events, records)
    finally:
        await store.close()
    assert state == _folded(records)


def _folded(records: list[Record]) -> JobState:
    state = JobState()
    for record in records:
        state = fold(state, record).state
    return state


def _with_timers(records: list[Record]) -> int:
    """How many records of ``records`` fold to a state with a timer armed (the first such prefix)."""
    state = JobState()
    for i, record in enumerate(records, 1):
        state = fold(state, record).state
        if state.timers:
            return i
    raise AssertionError("no prefix of the log arms a timer")


@pytest.mark.anyio
@pytest.mark.parametrize("older", [False, True], ids=["this-format", "before-timers-were-state"])
async def test_a_snapshot_of_a_recorded_log_resumes_with_its_timers(older: bool) -> None:
    """A snapshot taken where a timer was armed resumes with it armed, in this format and in the one a master
    before 51e6d0c wrote (the timers beside the state, not in it: ``Reactor._load_snapshot`` reads both)."""
    records = load(HERE / "logs" / "worker-crash.jsonl")
    upto = records[:_with_timers(records)]
    at_snapshot = _folded(upto)
    body: dict[str, Any] = {"state": to_json(at_snapshot)}
    if older:
        body = {"state": {k: v for k, v in body["state"].items() if k != "timers"}, "timers": body["state"]["timers"]}
    store, events = await _stored(upto)
    try:
        await events.save_snapshot(at_snapshot.seq, body)
        for record in upto:  # the snapshot, not the records, is what the reactor resumes from
            await store.delete(events.key(record.seq))
        state = await _resumed(events, upto)
    finally:
        await store.close()
    assert state.timers and state == at_snapshot


def _update() -> None:
    EXPECTED.mkdir(exist_ok=True)
    for path in LOGS:
        _expected(path).write_text(json.dumps(summary(load(path)), indent=1) + "\n")
        print(f"wrote {_expected(path)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the expected summaries of the recorded logs anew")
    parser.add_argument("--update", action="store_true", required=True)
    parser.parse_args()
    sys.path.insert(0, str(HERE.parents[1]))
    _update()

