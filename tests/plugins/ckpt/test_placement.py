"""Where replicas go: a ring over the round's nodes, never on the source's own host."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stead.plugins.ckpt._placement import Member, targets


def _members(*hosts: str) -> list[Member]:
    return [Member(node_id=f"node-{i}", host=host, first_rank=i) for i, host in enumerate(hosts)]


@pytest.mark.parametrize(("hosts", "replicas", "expected"), [
    (("a", "b", "c"), 1, {"node-0": ("node-1",), "node-1": ("node-2",), "node-2": ("node-0",)}),
    (("a", "b", "c"), 2, {"node-0": ("node-1", "node-2"), "node-1": ("node-2", "node-0"),
                          "node-2": ("node-0", "node-1")}),
    # two nodes per host: the next node on another host, skipping the source's neighbour on its own host
    (("a", "a", "b", "b"), 1, {"node-0": ("node-2",), "node-1": ("node-2",), "node-2": ("node-0",),
                               "node-3": ("node-0",)}),
    # one host: nothing placed (its loss would take both copies)
    (("a", "a", "a"), 1, {"node-0": (), "node-1": (), "node-2": ()}),
    # fewer other hosts than replicas asked: as many as there are, each on a host of its own
    (("a", "b", "b"), 2, {"node-0": ("node-1",), "node-1": ("node-0",), "node-2": ("node-0",)}),
    (("a", "b"), 0, {"node-0": (), "node-1": ()}),
])
def test_placement_table(hosts: tuple[str, ...], replicas: int, expected: dict[str, tuple[str, ...]]) -> None:
    assert targets(_members(*hosts), replicas) == expected


def test_the_placement_does_not_depend_on_the_order_members_are_listed_in() -> None:
    members = _members("a", "b", "c", "a")
    assert targets(members, 1) == targets(list(reversed(members)), 1)


@given(hosts=st.lists(st.sampled_from("abcd"), min_size=1, max_size=12), replicas=st.integers(0, 4))
def test_replicas_are_on_other_hosts_than_their_source_and_than_each_other(hosts: list[str], replicas: int) -> None:
    members = _members(*hosts)
    host_of = {m.node_id: m.host for m in members}
    placed = targets(members, replicas)
    assert set(placed) == set(host_of)
    for source, chosen in placed.items():
        chosen_hosts = [host_of[c] for c in chosen]
        assert host_of[source] not in chosen_hosts
        assert len(set(chosen_hosts)) == len(chosen_hosts)
        # as many as asked, or one per other host when there are fewer
        assert len(chosen) == min(replicas, len(set(hosts) - {host_of[source]}))
