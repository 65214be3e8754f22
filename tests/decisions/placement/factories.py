"""Small builders for placement tests: instances and cluster views as plain data."""

from __future__ import annotations

from typing import Any

from meshd.decisions.placement.view import ClusterView, InstanceView

NOW = 1_700_000_000_000  # ms since the epoch, as records carry
UNITS = 10  # default model size in units for these tests
CAP = 1000  # capacity: threshold for "full" is max(10, min(10 x threads, 50))


def inst(iid: str, **kw: Any) -> InstanceView:
    """An instance with room to spare unless told otherwise (capacity 1000, empty, LRU now)."""
    kw.setdefault("capacity", CAP)
    kw.setdefault("lru_time", NOW)
    kw.setdefault("location", f"{iid}:8080")
    if "labels" in kw:
        kw["labels"] = frozenset(kw["labels"])
    return InstanceView(instance_id=iid, **kw)


def full(iid: str, lru_age_ms: int, **kw: Any) -> InstanceView:
    """A full instance (5 units free of 1000) whose least recently used model is `lru_age_ms` old."""
    kw.setdefault("used", CAP - 5)
    kw.setdefault("count", 20)
    return inst(iid, lru_time=NOW - lru_age_ms, **kw)


def view(*instances: InstanceView, self_id: str = "me", now: int = NOW) -> ClusterView:
    return ClusterView(self_id=self_id, now_ms=now, instances={i.instance_id: i for i in instances})
