"""The scaler's figures: distributions read to within 2 %, and the requests recommended from them."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stead.plugins.scaler.recommend import quantity, recommend
from stead.plugins.scaler.usage import Distribution, UsageBook

GI, MI = 1 << 30, 1 << 20


@given(st.lists(st.floats(0.0, 1e12), min_size=1, max_size=300), st.sampled_from([0.5, 0.9, 0.95, 0.99, 1.0]))
def test_a_quantile_is_the_true_one_rounded_up_by_at_most_two_percent_and_never_above_the_peak(
        values: list[float], q: float) -> None:
    dist = Distribution()
    for value in values:
        dist.add(value)
    true = sorted(values)[max(1, math.ceil(q * len(values))) - 1]
    read = dist.quantile(q)
    assert read is not None
    assert true <= read * (1 + 1e-9) and read <= max(true * 1.02, 0.0) + 1e-9
    assert read <= dist.peak and dist.peak == max(values)


def test_what_is_not_a_measurement_is_left_out_and_an_empty_distribution_has_no_quantile() -> None:
    dist = Distribution()
    for value in (-1.0, math.nan, math.inf):
        dist.add(value)
    assert dist.count == 0 and dist.quantile(0.5) is None


def test_the_figures_survive_json_as_the_plugin_stores_them() -> None:
    book = UsageBook()
    book.add("node-0", {"rss_bytes": 3 * GI, "cpu_percent": 150.0, "gpu_memory_bytes": None})
    book.add("node-1", {"rss_bytes": 5 * GI, "cpu_percent": 0.0})
    again = UsageBook.from_json(json.loads(json.dumps(book.to_json())))
    assert again.to_json() == book.to_json()
    assert again.resources["rss_bytes"].quantile(1.0) == 5 * GI and again.nodes == {"node-0", "node-1"}
    assert again.samples == 2 and again.resources["gpu_memory_bytes"].count == 0  # unknown is not zero


@pytest.mark.parametrize(("size", "shown"), [
    (14 * GI, "14Gi"), (11.2 * GI, "11.2Gi"), (768 * MI, "768Mi"), (1, "1Mi"), (GI, "1Gi"),
])
def test_quantities_read_as_kubernetes_writes_them(size: float, shown: str) -> None:
    assert quantity(size) == shown


@pytest.mark.parametrize(("peak", "headroom", "wanted"), [
    (11.2 * GI, 0.2, 14 * GI),        # 13.44 Gi -> whole GiB above 4 Gi
    (1.5 * GI, 0.2, 2 * GI),          # 1.8 Gi -> 256 MiB steps under 4 Gi
    (100 * MI, 0.2, 256 * MI),        # never under one step
    (3 * GI, 0.0, 3 * GI),            # exactly on a step: no more
])
def test_memory_is_recommended_at_the_peak_plus_headroom_rounded_up(peak: float, headroom: float,
                                                                    wanted: int) -> None:
    book = UsageBook()
    book.add("node-0", {"rss_bytes": peak})
    [memory] = recommend(book, headroom=headroom)
    assert memory.resource == "memory" and memory.recommend == wanted
    assert memory.line.endswith(f"recommend {quantity(wanted)}")


def test_cpu_is_recommended_at_its_95th_percentile_in_half_cores_and_gpus_are_reported_not_requested() -> None:
    book = UsageBook()
    for i in range(100):  # 3.0 cores most of the time, one burst to 7
        book.add(f"node-{i % 4}", {"cpu_percent": 700.0 if i == 0 else 300.0, "gpu_memory_bytes": 30 * GI,
                                   "gpu_util_percent": 90.0})
    found = {r.resource: r for r in recommend(book, headroom=0.2)}
    assert list(found) == ["cpu", "gpu_memory", "gpu_util"]  # no memory figure: no memory line
    assert found["cpu"].peak == 7.0 and found["cpu"].recommend == 4.0  # p95 3.0 x 1.2 = 3.6 -> 4
    assert found["gpu_memory"].recommend is None and found["gpu_util"].recommend is None
    assert found["gpu_util"].line == "gpu utilisation: median 90%, p95 90%"


def test_what_the_nodes_asked_for_is_shown_beside_what_they_used() -> None:
    book = UsageBook()
    book.add("node-0", {"rss_bytes": 11.2 * GI, "cpu_percent": 300.0})
    found = {r.resource: r for r in recommend(book, headroom=0.2, requested={"memory": 32 * GI, "cpu": 8.0})}
    assert found["memory"].line == "memory: requested 32Gi, peak 11.2Gi, p95 11.2Gi per node; recommend 14Gi"
    assert found["cpu"].line.startswith("cpu: requested 8, peak 3.0 cores")
