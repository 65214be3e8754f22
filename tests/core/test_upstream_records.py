"""Records as upstream's writer (Jackson, NON_DEFAULT: fields at their default omitted) leaves
them, and how meshd tells an upstream (Java) instance record from its own."""

from __future__ import annotations

import json

from meshd.core.records import EMPTY_LRU_TIME, MESHD_MARKER, InstanceRecord, ModelRecord, VModelRecord
from meshd.decisions.placement.view import InstanceView


def test_upstream_model_and_vmodel_records_with_defaults_omitted() -> None:
    rec = ModelRecord.decode(b'{"mPath":"s3://m","lu":5}')  # no type, no instanceIds
    assert (rec.type, rec.path, rec.instance_ids, rec.refs, rec.last_used) == ("", "s3://m", {}, 0, 5)
    assert VModelRecord.decode(b'{"amid":"a"}') == VModelRecord(active_model="a")


def test_an_upstream_instance_record_is_recognised_and_read() -> None:
    # What a Java instance with nothing loaded writes: no count/rpm/shutdown (defaults), lruTime MAX.
    java = {"lruTime": EMPTY_LRU_TIME, "cap": 1000, "lThreads": 2, "startTime": 7, "vers": 3, "loc": "10.0.0.9"}
    rec = InstanceRecord.decode(json.dumps(java).encode())
    assert rec.upstream and rec.count == 0 and not rec.shutdown and rec.labels == []
    assert InstanceView.from_record("j", rec, empty_lru_ms=42).lru_time == 42  # empty: as if used when seen


def test_meshd_instance_records_carry_the_marker_and_read_as_meshd() -> None:
    mine = InstanceRecord(count=1, lru_time=5, location="h:1")
    wire = json.loads(mine.encode())
    assert wire[MESHD_MARKER] == 1
    back = InstanceRecord.decode(mine.encode())
    assert not back.upstream and back == mine and MESHD_MARKER not in back.extra
    # An older meshd wrote no marker but every field, "shutdown": false included; upstream never does.
    del wire[MESHD_MARKER]
    assert not InstanceRecord.decode(json.dumps(wire).encode()).upstream
    wire.pop("shutdown")
    assert InstanceRecord.decode(json.dumps(wire).encode()).upstream
