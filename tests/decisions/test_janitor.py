"""The janitor's repair plan (pure)."""

from __future__ import annotations

from meshd.core.records import ModelRecord
from meshd.decisions.cache import CacheEntry, State
from meshd.decisions.janitor import plan_repairs


def test_plan_repairs_each_kind_of_drift() -> None:
    records = {
        "stale": ModelRecord(type="t", instance_ids={"me": 1, "peer": 2}),  # not held here
        "unlisted": ModelRecord(type="t", instance_ids={"peer": 2}),  # held, not listed
        "fine": ModelRecord(type="t", instance_ids={"me": 1}),
        "broken": ModelRecord(type="t"),
    }
    entries = [
        CacheEntry("unlisted", 1, 0, State.LOADED),
        CacheEntry("fine", 1, 0, State.LOADED),
        CacheEntry("gone", 1, 0, State.LOADED),  # unregistered
        CacheEntry("loading", 1, 0, State.LOADING),  # not judged while loading
        CacheEntry("broken", 1, 0, State.LOADED),  # its record is corrupt: left alone
    ]
    plan = plan_repairs("me", records, entries, corrupt=["broken"])
    assert plan.remove_from_records == ("stale",)
    assert plan.add_to_records == ("unlisted",)
    assert plan.unload == ("gone",)
    assert not plan_repairs("me", {"fine": records["fine"]}, [entries[1]])


def test_a_copy_beyond_max_copies_elsewhere_is_unloaded_not_added_back() -> None:
    capped = '{"meshd": {"max_copies": 1}}'
    records = {
        # Reloaded on "peer" while this instance was away: adding "me" back would make two.
        "moved": ModelRecord(type="t", key=capped, instance_ids={"peer": 2}),
        # Named only on an instance that is gone: "me" may take its place.
        "orphaned": ModelRecord(type="t", key=capped, instance_ids={"dead": 2}),
        "uncapped": ModelRecord(type="t", instance_ids={"peer": 2}),
    }
    entries = [CacheEntry(m, 1, 0, State.LOADED) for m in records]
    plan = plan_repairs("me", records, entries, live={"me", "peer"})
    assert plan.surplus == ("moved",)
    assert plan.add_to_records == ("orphaned", "uncapped")
    # Without knowing who is live, nothing is judged surplus (start-up before the view).
    assert plan_repairs("me", records, entries).surplus == ()


def test_a_rejoining_instance_leaves_records_already_at_max_elsewhere() -> None:
    capped = '{"meshd": {"max_copies": 1}}'
    # Still named here (not pruned yet), but reloaded on "peer" while this instance was gone.
    records = {"moved": ModelRecord(type="t", key=capped, instance_ids={"me": 1, "peer": 2})}
    entries = [CacheEntry("moved", 1, 0, State.LOADED)]
    assert plan_repairs("me", records, entries, live={"peer"}).surplus == ("moved",)
    # While live, two named holders are the scaler's to resolve (one at a time), not this.
    assert plan_repairs("me", records, entries, live={"me", "peer"}).surplus == ()
