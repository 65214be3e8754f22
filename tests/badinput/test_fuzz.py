"""Hypothesis fuzzing of what turns outside bytes into meshd's values (issue 8), in seconds:
the id splicer on KServe requests, the etcd record decoders, and the watch mirror that
applies stored values. Complements tests/serving/proxy/test_wire.py (splicer vs protobuf parsing on
a nested schema, arbitrary and mutated bytes) and tests/core/test_records.py (arbitrary bytes,
model records from arbitrary JSON objects)."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd._proto.inference.grpc_predict_v2_pb2 import ModelInferRequest
from meshd.core.errors import InvalidArgument
from meshd.core.records import InstanceRecord, ModelRecord, RecordError, VModelRecord
from meshd.kv.memory import MemoryStore
from meshd.kv.table import Table
from meshd.serving.proxy.wire import extract_id, inject_id

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids = st.text(min_size=0, max_size=40)
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8,
)


# ---- the id splicer on KServe ModelInferRequest ------------------------------------------------


@st.composite
def infer_requests(draw: st.DrawFn) -> bytes:
    req = ModelInferRequest(model_name=draw(ids), model_version=draw(st.text(max_size=5)), id=draw(st.text(max_size=5)))
    for _ in range(draw(st.integers(0, 2))):
        t = req.inputs.add(name=draw(st.text(max_size=4)), datatype="FP32")
        t.shape.extend(draw(st.lists(st.integers(0, 2**40), max_size=3)))
    req.raw_input_contents.extend(draw(st.lists(st.binary(max_size=32), max_size=2)))
    data = req.SerializeToString()
    # Unknown fields and a second model_name occurrence: both legal protobuf.
    if draw(st.booleans()):
        data += b"\x0a" + bytes([len(b"dup")]) + b"dup"
    if draw(st.booleans()):
        data += b"\xf8\x07" + bytes([draw(st.integers(0, 127))])  # field 127, varint
    return data


@FAST
@given(data=infer_requests(), value=ids)
def test_spliced_request_parses_with_the_id_set_and_everything_else_kept(data: bytes, value: str) -> None:
    out = inject_id(data, [1], value)
    parsed = ModelInferRequest.FromString(out)
    original = ModelInferRequest.FromString(data)
    assert parsed.model_name == value
    original.model_name = value
    assert parsed == original
    assert extract_id(out, [1]) == value
    assert inject_id(out, [1], value) is out  # already there: the bytes are returned as they are


@FAST
@given(data=infer_requests(), cut=st.integers(0, 10_000), noise=st.binary(min_size=1, max_size=4), value=ids)
def test_damaged_requests_raise_only_invalid_argument(data: bytes, cut: int, noise: bytes, value: str) -> None:
    i = cut % (len(data) + 1)
    for damaged in (data[:i], data[:i] + noise + data[i:]):
        try:
            out = inject_id(damaged, [1], value)
        except InvalidArgument as e:
            assert "protobuf" in e.message
            continue
        # Accepted. The splicer checks only the fields on its path (the rest are skipped by
        # length, never parsed), so damage elsewhere is the runtime's to report; but a
        # message protobuf accepts must come out with the id set and nothing else changed.
        try:
            original = ModelInferRequest.FromString(damaged)
        except DecodeError:
            continue
        original.model_name = value
        assert ModelInferRequest.FromString(out) == original


# ---- the etcd record decoders ------------------------------------------------------------------

counts = st.integers(0, 2**64)
ms = st.integers(0, 2**63)
names = st.text(max_size=12)


def _extra(known: set[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(names.filter(lambda k: k not in known), json_values, max_size=3)


model_records = st.builds(
    ModelRecord,
    type=names,
    path=names,
    key=names,
    instance_ids=st.dictionaries(names, ms, max_size=3),
    failed_in=st.dictionaries(names, ms, max_size=3),
    fails=st.dictionaries(names, st.fixed_dictionaries({"msg": st.text(max_size=20)}), max_size=2),
    refs=counts,
    auto_delete=st.booleans(),
    last_used=ms,
    extra=_extra(set(ModelRecord._NAMES.values())),
)
vmodel_records = st.builds(
    VModelRecord,
    owner=names,
    active_model=names,
    target_model=names,
    failed=st.booleans(),
    extra=_extra(set(VModelRecord._NAMES.values())),
)
instance_records = st.builds(
    InstanceRecord,
    lru_time=ms,
    count=counts,
    capacity=counts,
    used=counts,
    loading_threads=counts,
    loading_in_progress=counts,
    rpm=counts,
    shutdown=st.booleans(),
    start_time=ms,
    version=counts,
    location=names,
    zone=names,
    labels=st.lists(names, max_size=3),
    extra=_extra(set(InstanceRecord._NAMES.values())),
)
RECORD_TYPES = (ModelRecord, VModelRecord, InstanceRecord)


@FAST
@given(rec=st.one_of(model_records, vmodel_records, instance_records))
def test_valid_records_round_trip(rec: ModelRecord | VModelRecord | InstanceRecord) -> None:
    raw = rec.encode()
    again = type(rec).decode(raw)
    assert again == rec
    assert again.encode() == raw  # stable bytes: a rewrite of an unchanged record changes nothing


@FAST
@given(obj=st.dictionaries(st.text(max_size=8), json_values, max_size=6), base=st.sampled_from(range(3)))
def test_arbitrary_json_objects_decode_or_raise_record_error(obj: dict[str, Any], base: int) -> None:
    # Start from a valid record's fields so that the wrongly typed ones are reached too.
    valid = [ModelRecord("t"), VModelRecord(), InstanceRecord()][base]
    merged = {**json.loads(valid.encode()), **obj}
    raw = json.dumps(merged).encode()
    for cls in RECORD_TYPES:
        try:
            rec = cls.decode(raw)
        except RecordError:
            continue
        assert cls.decode(rec.encode()) == rec


@FAST
@given(raw=st.binary(max_size=120) | st.text(max_size=60).map(str.encode))
def test_arbitrary_bytes_decode_or_raise_record_error(raw: bytes) -> None:
    for cls in RECORD_TYPES:
        try:
            cls.decode(raw)
        except RecordError:
            pass


# ---- the watch mirror applying stored values ---------------------------------------------------


@FAST
@given(
    writes=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.none() | st.binary(max_size=40) | model_records.map(lambda r: r.encode()),
        ),
        max_size=8,
    )
)
def test_mirror_applies_any_value_and_reports_the_corrupt_ones(writes: list[tuple[str, bytes | None]]) -> None:
    """Whatever sequence of values (or deletions) the watch delivers, the mirror never raises;
    each id ends up either decoded or listed as corrupt (with a reason), matching the last value."""
    table: Table[ModelRecord] = Table(MemoryStore(), "p/registry/", ModelRecord.decode, ModelRecord.encode)
    last: dict[str, bytes | None] = {}
    for revision, (item_id, value) in enumerate(writes, start=1):
        table._apply(table.key(item_id), value, revision)
        last[item_id] = value
    for item_id, value in last.items():
        assert not (item_id in table.entries and item_id in table.corrupt)
        if value is None:
            assert table.get(item_id) is None and item_id not in table.corrupt
            continue
        try:
            expected = ModelRecord.decode(value)
        except RecordError:
            assert table.get(item_id) is None and table.corrupt[item_id]
        else:
            assert table.get(item_id) == expected and item_id not in table.corrupt
