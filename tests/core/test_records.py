"""Upstream-compatible JSON records: field names, unknown fields kept, corrupt values reported."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.core.records import InstanceRecord, ModelRecord, RecordError, VModelRecord


def test_model_record_uses_upstream_field_names_and_keeps_unknown_fields() -> None:
    raw = json.dumps(
        {
            "type": "sklearn",
            "mPath": "s3://b/m",
            "encKey": '{"disk_size_bytes": 10}',
            "instanceIds": {"i1": 5},
            "failedIn": {"i2": 7},
            "fails": {"i2": {"msg": "boom"}},
            "refs": 1,
            "autoDel": True,
            "lu": 42,
            "lul": 9,
            "future": {"x": [1, 2]},
        }
    ).encode()
    rec = ModelRecord.decode(raw)
    assert (rec.type, rec.path, rec.key, rec.refs, rec.auto_delete, rec.last_used) == (
        "sklearn",
        "s3://b/m",
        '{"disk_size_bytes": 10}',
        1,
        True,
        42,
    )
    assert rec.instance_ids == {"i1": 5} and rec.failed_in == {"i2": 7} and rec.fails == {"i2": {"msg": "boom"}}
    rec.instance_ids["i3"] = 8
    out = json.loads(rec.encode())
    assert out["future"] == {"x": [1, 2]} and out["lul"] == 9
    assert out["instanceIds"] == {"i1": 5, "i3": 8}


def test_vmodel_and_instance_records_round_trip() -> None:
    v = VModelRecord(owner="o", active_model="a", target_model="b", extra={"z": 1})
    assert VModelRecord.decode(v.encode()) == v
    assert set(json.loads(v.encode())) == {"o", "amid", "tmid", "z"}
    i = InstanceRecord(lru_time=1, count=2, capacity=3, used=1, rpm=5, location="h:1", labels=["mt:x"])
    assert InstanceRecord.decode(i.encode()) == i
    assert {
        "lruTime",
        "count",
        "cap",
        "used",
        "lThreads",
        "lInProg",
        "rpm",
        "shutdown",
        "startTime",
        "vers",
        "loc",
    } <= set(json.loads(i.encode()))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[1,2]",
        b'{"type": 5}',
        b'{"type": "t", "instanceIds": {"a": "x"}}',
        b'{"type": "t", "refs": true}',
        b'{"type": "t", "fails": {"a": 1}}',
        b"\xff\xfe",
        b'{"type": "t", "lu": 1' + b"1" * 5000 + b"}",  # int too long for Python to convert
        b"[" * 100_000,  # nesting deeper than the JSON parser's recursion limit
    ],
)
def test_corrupt_model_records_raise_record_error(raw: bytes) -> None:
    with pytest.raises(RecordError):
        ModelRecord.decode(raw)


@given(st.binary(max_size=200))
def test_decoder_never_raises_anything_but_record_error(raw: bytes) -> None:
    for cls in (ModelRecord, VModelRecord, InstanceRecord):
        try:
            cls.decode(raw)
        except RecordError:
            pass


@given(
    st.dictionaries(
        st.text(max_size=10),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5), lambda c: st.lists(c, max_size=3)
        ),
        max_size=6,
    )
)
def test_decoder_is_total_on_arbitrary_json_objects(obj: dict[str, object]) -> None:
    obj = {**obj, "type": "t"}
    raw = json.dumps(obj).encode()
    try:
        rec = ModelRecord.decode(raw)
    except RecordError:
        return
    # Whatever decoded re-encodes and decodes to the same record.
    assert ModelRecord.decode(rec.encode()) == rec
