"""The janitor's repair plan (pure)."""

from __future__ import annotations

from meshd.cache import CacheEntry, State
from meshd.kv.records import ModelRecord
from meshd.reconcile import plan_repairs


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
