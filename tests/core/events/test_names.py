"""Typed timer names and effect ids: the string form the log has always stored, read back as the same value."""

from __future__ import annotations

import json

import pytest

from stead.core.errors import CodecError
from stead.core.events import (
    CheckHealthId,
    DecisionTimeout,
    DumpStacksId,
    EffectFailed,
    EmitId,
    GrowWindow,
    HealthTimeout,
    JobSubmitted,
    JoinTimeout,
    KillId,
    LastCall,
    LaunchId,
    NodeJoined,
    NodeRequested,
    Record,
    RejoinTimeout,
    ResizeWait,
    ResourcesTimeout,
    StartWorkersId,
    StopNodeId,
    StopWorkersId,
    TimerFired,
    TimerId,
    TimerName,
    decode_record,
    encode_record,
)
from stead.core.serde import from_json, to_json
from stead.core.statemachine import (
    CheckHealth,
    DumpStacks,
    Effect,
    Emit,
    JobState,
    KillNode,
    LaunchNode,
    StartTimer,
    StartWorkers,
    StopNode,
    StopWorkers,
    fold,
)

#: every kind of timer, with the name stead has always stored for it
TIMERS: list[tuple[str, TimerName]] = [
    ("join-timeout", JoinTimeout()),
    ("join-timeout/2", JoinTimeout(life=2)),
    ("decision/3", DecisionTimeout(round=3)),
    ("health/1", HealthTimeout(check=1)),
    ("resize/4", ResizeWait(round=4)),
    ("grow/5", GrowWindow(round=5)),
    ("rejoin/node-1/2", RejoinTimeout(node_id="node-1", incarnation=2)),
    ("resources/node-0/3", ResourcesTimeout(node_id="node-0", incarnation=3)),
    ("last-call/1", LastCall(round=1)),
]


@pytest.mark.parametrize(("stored", "timer"), TIMERS, ids=[s for s, _ in TIMERS])
def test_a_timer_is_stored_by_its_old_name_and_read_back_typed(stored: str, timer: TimerName) -> None:
    assert str(timer) == stored
    record = Record(seq=7, at=1.5, event=TimerFired(name=timer))
    raw = encode_record(record)
    assert json.loads(raw)["data"] == {"name": stored}
    assert decode_record(raw, where="k") == record


@pytest.mark.parametrize(("stored", "timer"), TIMERS, ids=[s for s, _ in TIMERS])
def test_a_record_written_before_the_types_reads_as_the_typed_timer(stored: str, timer: TimerName) -> None:
    raw = json.dumps({"at": 1.5, "data": {"name": stored}, "seq": 7, "type": "timer.fired", "v": 1}).encode()
    assert decode_record(raw, where="k").event == TimerFired(name=timer)


@pytest.mark.parametrize("stored", ["bogus/1", "decision", "decision/x", "decision/01", "decision/+1",
                                    "decision/1/2", "rejoin/node-1", "join-timeout/", ""])
def test_a_timer_name_stead_never_wrote_is_refused_with_the_names_it_reads(stored: str) -> None:
    raw = json.dumps({"at": 1.5, "data": {"name": stored}, "seq": 7, "type": "timer.fired", "v": 1}).encode()
    with pytest.raises(CodecError, match=r"timer\.fired\.name: .* is not a name this stead reads \(expected "
                                         r"join-timeout\[/LIFE\] or decision/ROUND or .*rejoin/NODE_ID/INCARNATION "
                                         r"or .*last-call/ROUND\)"):
        decode_record(raw, where="k")


def _effects() -> list[tuple[str, Effect, object]]:
    start = StartWorkers(node_id="node-1", incarnation=2, round=3, node_rank=1, nnodes=2, nproc_per_node=1,
                         restart_count=0)
    return [
        ("launch/node-1/2", LaunchNode(node_id="node-1", incarnation=2), LaunchId(node_id="node-1", incarnation=2)),
        ("kill/node-1/2", KillNode(node_id="node-1", incarnation=2), KillId(node_id="node-1", incarnation=2)),
        ("stop-node/node-1/2", StopNode(node_id="node-1", incarnation=2, reason="r"),
         StopNodeId(node_id="node-1", incarnation=2)),
        ("start-workers/3/node-1", start, StartWorkersId(round=3, node_id="node-1")),
        ("stop-workers/3/node-1", StopWorkers(node_id="node-1", incarnation=2, round=3, reason="r"),
         StopWorkersId(round=3, node_id="node-1")),
        ("dump-stacks/40/node-1", DumpStacks(node_id="node-1", incarnation=2, round=3, reason="r", request=40),
         DumpStacksId(request=40, node_id="node-1")),
        ("check-health/1/node-1", CheckHealth(node_id="node-1", incarnation=2, check=1, nodes=("node-1",),
                                              timeout_s=1.0), CheckHealthId(check=1, node_id="node-1")),
        ("timer/rejoin/node-1/2", StartTimer(name=RejoinTimeout(node_id="node-1", incarnation=2), at=1.0),
         TimerId(timer=RejoinTimeout(node_id="node-1", incarnation=2))),
        ("emit/request/node-1/2", Emit(key="request/node-1/2", event=NodeJoined(node_id="node-1", incarnation=2)),
         EmitId(key="request/node-1/2")),
    ]


@pytest.mark.parametrize(("stored", "effect", "ref"), _effects(), ids=[s for s, _, _ in _effects()])
def test_an_effect_id_keeps_its_string_and_a_failed_effect_names_it_typed(stored: str, effect: Effect,
                                                                          ref: object) -> None:
    assert (effect.id, effect.ref) == (stored, ref)
    old = {"effect_id": stored, "kind": effect.kind, "error": "OSError: boom"}  # an EffectFailed as stored
    failed = from_json(EffectFailed, old)
    assert failed.effect_id == ref
    assert to_json(failed)["effect_id"] == stored


@pytest.mark.parametrize("ref", [TimerId(timer=RejoinTimeout(node_id="rack/7", incarnation=2)),
                                 StartWorkersId(round=3, node_id="a/b/c"), EmitId(key="round/2/9")], ids=str)
def test_a_node_or_key_with_slashes_reads_back_whole(ref: object) -> None:
    assert from_json(EffectFailed, {"effect_id": str(ref), "kind": "k", "error": "e"}).effect_id == ref


SPEC = JobSubmitted(job="j", min_nodes=2, max_nodes=2, nproc_per_node=1, last_call_timeout_s=5.0)


def _old_log() -> list[bytes]:
    """A job's records as a stead before the typed names stored them: timers and effect ids by their strings."""
    events = [
        {"type": "job.submitted", "data": to_json(SPEC)},
        {"type": "node.requested", "data": {"node_id": "node-0", "incarnation": 1}},
        {"type": "node.requested", "data": {"node_id": "node-1", "incarnation": 1}},
        {"type": "node.joined", "data": {"node_id": "node-0", "incarnation": 1}},
        {"type": "timer.fired", "data": {"name": "decision/1"}},  # of no failure: ignored
        {"type": "effect.failed", "data": {"effect_id": "launch/node-1/1", "kind": "launch-node", "error": "boom",
                                           "node_id": "node-1", "incarnation": 1}},
        {"type": "timer.fired", "data": {"name": "join-timeout"}},
    ]
    return [json.dumps({"at": 100.0 + seq, "seq": seq, "v": 1, **event}).encode()
            for seq, event in enumerate(events, 1)]


def test_an_old_log_replays_to_the_state_of_the_same_events_typed() -> None:
    typed = [SPEC, NodeRequested(node_id="node-0", incarnation=1), NodeRequested(node_id="node-1", incarnation=1),
             NodeJoined(node_id="node-0", incarnation=1), TimerFired(name=DecisionTimeout(round=1)),
             EffectFailed(effect_id=LaunchId(node_id="node-1", incarnation=1), kind="launch-node", error="boom",
                          node_id="node-1", incarnation=1),
             TimerFired(name=JoinTimeout())]
    old, new = JobState(), JobState()
    for seq, (raw, event) in enumerate(zip(_old_log(), typed, strict=True), 1):
        old = fold(old, decode_record(raw, where=f"event {seq}")).state
        new = fold(new, Record(seq=seq, at=100.0 + seq, event=event)).state
        assert old == new
    assert RejoinTimeout(node_id="node-1", incarnation=2) in old.timers  # the failed launch relaunched node-1
    assert JoinTimeout() not in old.timers  # fired


def test_an_old_snapshot_with_string_timers_reads_as_the_state_it_was() -> None:
    state = JobState()
    for raw in _old_log()[:-1]:
        state = fold(state, decode_record(raw, where="k")).state
    stored = to_json(state)
    assert set(stored["timers"]) == {"join-timeout", "rejoin/node-1/2"}  # the snapshot's keys as they were
    assert from_json(JobState, json.loads(json.dumps(stored))) == state
