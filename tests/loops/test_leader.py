"""The leader's pure plans: which dead instances to prune, which models to preload."""

from __future__ import annotations

from meshd.core.records import ModelRecord
from meshd.decisions.placement.view import ClusterView, InstanceView
from meshd.loops.leader import MissingInstances, preload_plan, prune_plan


def test_instances_are_pruned_only_after_being_missing_long_enough() -> None:
    m = MissingInstances()
    m.observe({"a", "dead"}, {"a"}, now_ms=1_000)
    assert prune_plan(m, 500_000, 600_000) == set()
    m.observe({"a", "dead", "back"}, {"a", "back"}, now_ms=601_000)
    assert prune_plan(m, 601_000, 600_000) == {"dead"}
    m.observe({"dead"}, {"dead"}, now_ms=602_000)  # it came back: its clock resets
    assert prune_plan(m, 700_000, 600_000) == set()


def test_preload_most_recent_first_within_half_the_free_space_above_the_reserve() -> None:
    views = {i: InstanceView(i, capacity=100, used=0, lru_time=1_000) for i in "ab"}
    view = ClusterView("a", 10_000, views)  # 200 units free; reserve 25; budget (200-25)/2 = 87
    records = {
        "old": ModelRecord(type="t", last_used=500),  # older than the cluster's LRU
        "recent": ModelRecord(type="t", last_used=9_000),
        "newer": ModelRecord(type="t", last_used=9_500),
        "loaded": ModelRecord(type="t", last_used=9_900, instance_ids={"a": 1}),
        "failing": ModelRecord(type="t", last_used=9_800, failed_in={"a": 9_000, "b": 9_100}),
        "third": ModelRecord(type="t", last_used=8_000),
    }
    plan = preload_plan(view, records, lambda rec: 40, failure_expiry_ms=900_000)
    assert plan == ["newer", "recent"]  # 80 of the 87 units; "third" no longer fits
    full = {i: InstanceView(i, capacity=100, used=95, lru_time=1_000) for i in "ab"}
    assert preload_plan(ClusterView("a", 10_000, full), records, lambda rec: 1, 900_000) == []


def test_cluster_gauges_count_managed_loaded_and_failing_models() -> None:
    from meshd.loops.leader import ClusterGauges, cluster_gauges

    view = ClusterView("a", 10_000, {"a": InstanceView("a", capacity=10)})
    records = {
        "live": ModelRecord(type="t", instance_ids={"a": 1}),
        "dead-copy": ModelRecord(type="t", instance_ids={"gone": 1}),
        "failing": ModelRecord(type="t", failed_in={"a": 9_000}),
        "old-failure": ModelRecord(type="t", failed_in={"a": 1}),
    }
    assert cluster_gauges(view, records, failure_expiry_ms=5_000) == ClusterGauges(4, 1, 1)
