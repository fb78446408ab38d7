"""``job.warned``: a node's report of a warning (Slurm's, before a time limit), stored and grouped into warnings."""

from __future__ import annotations

import dataclasses
import json

from stead.core.events import (
    WARNING_SPREAD_S,
    JobWarned,
    Record,
    decode_record,
    encode_record,
    group_warnings,
    same_warning,
)

WARNED = JobWarned(node_id="node-0", incarnation=2, round=1, signal="SIGUSR1", source="slurm", warned_at=1.8e9,
                   time_left_s=118, said="Slurm warned: time limit in ~118 s", committed_step=140)


def test_a_report_of_a_warning_round_trips_with_every_field_and_implies_its_deadline() -> None:
    record = Record(seq=9, at=1.8e9 + 0.5, event=WARNED)
    raw = encode_record(record)
    assert json.loads(raw)["type"] == "job.warned"
    assert decode_record(raw, where="test") == record
    assert WARNED.deadline == 1.8e9 + 118
    assert dataclasses.replace(WARNED, time_left_s=None).deadline is None


def test_a_report_written_with_only_the_required_fields_still_loads() -> None:
    raw = json.dumps({"type": "job.warned", "v": 1, "seq": 3, "at": 1.0, "data": {
        "node_id": "node-1", "incarnation": 1, "round": 0, "signal": "SIGUSR1", "source": "slurm",
        "warned_at": 5}}).encode()
    event = decode_record(raw, where="test").event
    assert event == JobWarned(node_id="node-1", incarnation=1, round=0, signal="SIGUSR1", source="slurm",
                              warned_at=5.0)
    assert isinstance(event, JobWarned) and event.time_left_s is None and event.committed_step is None


def test_the_nodes_reports_of_one_warning_are_one_warning_and_a_later_one_is_another() -> None:
    node1 = dataclasses.replace(WARNED, node_id="node-1", warned_at=WARNED.warned_at + 2, time_left_s=116)
    again = dataclasses.replace(WARNED, warned_at=WARNED.warned_at + 1)  # node-0 again (a retry, its clock read anew)
    later = dataclasses.replace(WARNED, warned_at=WARNED.warned_at + WARNING_SPREAD_S + 1, time_left_s=30)
    warnings = group_warnings([WARNED, node1, again, later])
    assert [(w.first, sorted(w.nodes)) for w in warnings] == [(WARNED, ["node-0", "node-1"]), (later, ["node-0"])]
    assert warnings[0].nodes["node-0"] is WARNED  # a node's first report of it is kept
    assert same_warning(WARNED, node1) and not same_warning(WARNED, later)
    assert not same_warning(WARNED, dataclasses.replace(node1, source="other"))
