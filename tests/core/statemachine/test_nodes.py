"""The ready count the job machine carries on its nodes mapping, join by join (see ``_nodes.Nodes``)."""

from __future__ import annotations

import dataclasses

from stead.core.events import JobSubmitted, NodeLost
from stead.core.serde import from_json, to_json
from stead.core.statemachine import JobState
from stead.core.statemachine.node_counts import Nodes, Ready, ready_count
from stead.testing.replay import folded, node_up

SPEC = JobSubmitted(job="j", min_nodes=4, max_nodes=4, nproc_per_node=1)


def test_a_join_carries_the_ready_count_on_and_a_replaced_state_keeps_it() -> None:
    state = folded(SPEC, *node_up("node-0"), *node_up("node-1"))
    assert isinstance(state.nodes, Nodes) and state.nodes.ready == 2 == len(state.ready)
    again = dataclasses.replace(state, seq=state.seq + 1)
    assert again.nodes is state.nodes and len(Ready(again)) == 2


def test_a_loaded_state_counts_its_ready_nodes_and_the_next_node_event_goes_on_from_that_count() -> None:
    loaded = from_json(JobState, to_json(folded(SPEC, *node_up("node-0"), *node_up("node-1"), *node_up("node-2"))))
    assert not isinstance(loaded.nodes, Nodes) and ready_count(loaded.nodes) == 3
    after = folded(NodeLost(node_id="node-1", incarnation=1, reason="gone"), start=loaded)
    assert isinstance(after.nodes, Nodes) and after.nodes.ready == 2 == len(after.ready)


def test_a_mapping_made_without_its_count_counts_it_when_read() -> None:
    state = folded(SPEC, *node_up("node-0"), *node_up("node-1"))
    assert Nodes(state.nodes).ready == 2 and Nodes(list(state.nodes.items())).ready == 2 and Nodes().ready == 0
