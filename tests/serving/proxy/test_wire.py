"""The wire-level id splicer agrees with real protobuf parsing, and rejects malformed bytes cleanly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd._proto.inference.grpc_predict_v2_pb2 import ModelInferRequest
from meshd.core.errors import InvalidArgument
from meshd.serving.proxy.wire import MAX_FIELD_NUMBER, check_path, extract_id, inject_id

# --- wire encoding helpers (for building inputs byte by byte) -------------------------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64s are ten bytes on the wire
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tag(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return tag(field, 2) + varint(len(payload)) + payload


# --- a dynamic proto2 schema: paths of depth 1-4, with presence on every string -------------
#
# Node.child / Node.other are Node, Node.leaf is Leaf. Proto2 so that HasField tells an
# absent string from an empty one (what extract_id distinguishes).

_F = descriptor_pb2.FieldDescriptorProto


def _schema() -> tuple[type[Message], type[Message]]:
    fdp = descriptor_pb2.FileDescriptorProto(name="meshd_wire_test.proto", package="wt", syntax="proto2")
    node = fdp.message_type.add(name="Node")
    leaf = fdp.message_type.add(name="Leaf")
    opt, rep = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
    for name, number, label, typ, type_name in [
        ("name", 1, opt, _F.TYPE_STRING, None),
        ("child", 2, opt, _F.TYPE_MESSAGE, ".wt.Node"),
        ("other", 3, opt, _F.TYPE_MESSAGE, ".wt.Node"),
        ("nums", 4, rep, _F.TYPE_INT64, None),
        ("blob", 5, opt, _F.TYPE_BYTES, None),
        ("label", 6, opt, _F.TYPE_STRING, None),
        ("f64", 8, opt, _F.TYPE_FIXED64, None),
        ("f32", 9, opt, _F.TYPE_FIXED32, None),
        ("leaf", 12, opt, _F.TYPE_MESSAGE, ".wt.Leaf"),
        ("far", 300, opt, _F.TYPE_STRING, None),
    ]:
        f = node.field.add(name=name, number=number, label=label, type=typ)
        if type_name:
            f.type_name = type_name
    for name, number, label, typ in [
        ("data", 1, opt, _F.TYPE_BYTES),
        ("key", 2, opt, _F.TYPE_STRING),
        ("deltas", 3, rep, _F.TYPE_SINT32),
        ("deep", 2000, opt, _F.TYPE_STRING),
    ]:
        leaf.field.add(name=name, number=number, label=label, type=typ)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("wt.Node")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("wt.Leaf")),
    )


Node, Leaf = _schema()
NODE_STRINGS = (1, 6, 300)
NODE_MESSAGES = (2, 3)
LEAF_STRINGS = (2, 2000)
UNKNOWN_FIELDS = (7, 20, 99, 1000, 100_000, MAX_FIELD_NUMBER)  # in neither Node nor Leaf
MAX_DEPTH = 4

ids = st.text(max_size=12)  # any Unicode but surrogates: ids are UTF-8


@st.composite
def unknown_field(draw: st.DrawFn, depth: int = 0) -> bytes:
    field = draw(st.sampled_from(UNKNOWN_FIELDS))
    wire = draw(st.sampled_from((0, 1, 2, 5, 3) if depth < 3 else (0, 1, 2, 5)))
    if wire == 0:
        return tag(field, 0) + varint(draw(st.integers(-(2**63), 2**64 - 1)))
    if wire == 1:
        return tag(field, 1) + draw(st.binary(min_size=8, max_size=8))
    if wire == 5:
        return tag(field, 5) + draw(st.binary(min_size=4, max_size=4))
    if wire == 2:
        return ld(field, draw(st.binary(max_size=8)))
    # A group: deprecated but legal, and has to be skipped tag by tag.
    inner = draw(st.lists(unknown_field(depth + 1), max_size=3))
    return tag(field, 3) + b"".join(inner) + tag(field, 4)


@st.composite
def leaf_bytes(draw: st.DrawFn) -> bytes:
    parts = []
    for kind in draw(st.lists(st.sampled_from(("str", "data", "deltas", "unknown")), max_size=5)):
        if kind == "str":
            parts.append(ld(draw(st.sampled_from(LEAF_STRINGS)), draw(ids).encode()))
        elif kind == "data":
            parts.append(ld(1, draw(st.binary(max_size=8))))
        elif kind == "deltas":
            n = draw(st.integers(-(2**31), 2**31 - 1))
            parts.append(tag(3, 0) + varint((n << 1) ^ (n >> 31)))
        else:
            parts.append(draw(unknown_field()))
    return b"".join(parts)


@st.composite
def node_bytes(draw: st.DrawFn, depth: int = 0) -> bytes:
    """A serialized Node with duplicated fields, empty sub-messages and unknown fields."""
    kinds: tuple[str, ...] = ("str", "msg", "leaf", "nums", "packed", "blob", "fixed", "unknown")
    if depth >= MAX_DEPTH:
        kinds = ("str", "nums", "blob", "unknown")
    parts = []
    for kind in draw(st.lists(st.sampled_from(kinds), max_size=6 if depth < 2 else 3)):
        if kind == "str":
            parts.append(ld(draw(st.sampled_from(NODE_STRINGS)), draw(ids).encode()))
        elif kind == "msg":
            parts.append(ld(draw(st.sampled_from(NODE_MESSAGES)), draw(node_bytes(depth + 1))))
        elif kind == "leaf":
            parts.append(ld(12, draw(leaf_bytes())))
        elif kind == "nums":
            parts.append(tag(4, 0) + varint(draw(st.integers(-(2**63), 2**63 - 1))))
        elif kind == "packed":
            nums = draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3))
            parts.append(ld(4, b"".join(varint(n) for n in nums)))
        elif kind == "blob":
            parts.append(ld(5, draw(st.binary(max_size=8))))
        elif kind == "fixed":
            parts.append(draw(st.sampled_from([tag(8, 1) + b"\x01" * 8, tag(9, 5) + b"\xff" * 4])))
        else:
            parts.append(draw(unknown_field()))
    return b"".join(parts)


# Concatenating serialized messages is legal protobuf: it merges them, so it duplicates fields.
node_messages = st.lists(node_bytes(), min_size=1, max_size=2).map(b"".join)


@st.composite
def node_paths(draw: st.DrawFn) -> tuple[int, ...]:
    """A path valid in the schema: Node messages, then a Node string or Leaf.<string>."""
    depth = draw(st.integers(1, 4))
    if depth >= 2 and draw(st.booleans()):
        nodes = draw(st.lists(st.sampled_from(NODE_MESSAGES), min_size=depth - 2, max_size=depth - 2))
        return (*nodes, 12, draw(st.sampled_from(LEAF_STRINGS)))
    inner = draw(st.lists(st.sampled_from(NODE_MESSAGES), min_size=depth - 1, max_size=depth - 1))
    return (*inner, draw(st.sampled_from(NODE_STRINGS)))


@st.composite
def along(draw: st.DrawFn, path: tuple[int, ...], level: int = 0) -> bytes:
    """A message whose fields include 0-2 occurrences of path[level] (each built the same way
    one level down), among random fields: random messages rarely hold a deep path."""
    in_leaf = level > 0 and path[level - 1] == 12
    filler = leaf_bytes() if in_leaf else node_bytes(depth=MAX_DEPTH - 1)
    parts = [draw(filler) for _ in range(draw(st.integers(0, 2)))]
    for _ in range(draw(st.integers(0, 2))):
        if level == len(path) - 1:
            parts.append(ld(path[level], draw(ids).encode()))
        else:
            parts.append(ld(path[level], draw(along(path, level + 1))))
    return b"".join(draw(st.permutations(parts)))


@st.composite
def messages_and_paths(draw: st.DrawFn) -> tuple[bytes, tuple[int, ...]]:
    path = draw(node_paths())
    return draw(st.one_of(node_messages, along(path))), path


def _field_name(msg: Message, number: int) -> str:
    name: str = msg.DESCRIPTOR.fields_by_number[number].name
    return name


def set_path(msg: Message, path: Sequence[int], value: str) -> None:
    """What inject_id must be equivalent to, done with protobuf's own API."""
    for f in path[:-1]:
        msg = getattr(msg, _field_name(msg, f))
    setattr(msg, _field_name(msg, path[-1]), value)


def get_path(msg: Message, path: Sequence[int]) -> str | None:
    """What extract_id must return, from a parsed message (proto2: presence on strings)."""
    for f in path[:-1]:
        if not msg.HasField(_field_name(msg, f)):
            return None
        msg = getattr(msg, _field_name(msg, f))
    name = _field_name(msg, path[-1])
    value: str = getattr(msg, name)
    return value if msg.HasField(name) else None


def assert_same(got: Message, expected: Message) -> None:
    # == includes unknown fields; the serialized form shows their order too.
    assert got == expected
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


# --- properties against real protobuf --------------------------------------------------------


@settings(max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(case=messages_and_paths(), value=ids)
def test_inject_matches_protobuf_nested(case: tuple[bytes, tuple[int, ...]], value: str) -> None:
    data, path = case
    expected = Node.FromString(data)
    set_path(expected, path, value)
    out = inject_id(data, path, value)
    assert_same(Node.FromString(out), expected)
    assert extract_id(out, path) == value
    # Now it is there: the fast path returns the very object.
    assert inject_id(out, path, value) is out


@settings(max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(case=messages_and_paths())
def test_extract_matches_protobuf_nested(case: tuple[bytes, tuple[int, ...]]) -> None:
    data, path = case
    assert extract_id(data, path) == get_path(Node.FromString(data), path)


@st.composite
def infer_requests(draw: st.DrawFn) -> bytes:
    """Real ModelInferRequests (proto3), sometimes concatenated, with unknown fields mixed in."""
    parts = []
    for _ in range(draw(st.integers(1, 2))):
        req = ModelInferRequest(
            model_name=draw(ids), model_version=draw(st.text(max_size=3)), id=draw(st.text(max_size=3))
        )
        for key in draw(st.lists(st.text(max_size=4), max_size=2)):
            req.parameters[key].string_param = draw(st.text(max_size=4))
        for name in draw(st.lists(st.text(max_size=4), max_size=2)):
            tensor = req.inputs.add(name=name, datatype="FP32", shape=draw(st.lists(st.integers(0, 9), max_size=3)))
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32, allow_nan=False), max_size=3)))
        req.raw_input_contents.extend(draw(st.lists(st.binary(max_size=300), max_size=2)))
        parts.append(req.SerializeToString())
        parts.extend(draw(st.lists(unknown_field(), max_size=2)))
    return b"".join(draw(st.permutations(parts)))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(data=infer_requests(), value=ids)
def test_inject_matches_protobuf_model_infer_request(data: bytes, value: str) -> None:
    expected = ModelInferRequest.FromString(data)
    expected.model_name = value
    out = inject_id(data, [1], value)
    assert_same(ModelInferRequest.FromString(out), expected)
    assert inject_id(out, [1], value) is out
    parsed = ModelInferRequest.FromString(data).model_name
    got = extract_id(data, [1])
    if parsed:
        assert got == parsed
    else:
        assert got in (None, "")  # proto3 model_name: absent and "" parse alike


# --- malformed input: InvalidArgument or a result, never anything else -----------------------

any_paths = st.lists(st.integers(1, 40), min_size=1, max_size=4)


def _only_invalid_argument(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except InvalidArgument as e:
        assert e.message.startswith("request body is not valid protobuf") or "UTF-8" in e.message
        return None


@settings(max_examples=400)
@given(data=st.binary(max_size=64), path=any_paths)
def test_arbitrary_bytes_never_crash(data: bytes, path: list[int]) -> None:
    _only_invalid_argument(lambda: inject_id(data, path, "m"))
    _only_invalid_argument(lambda: extract_id(data, path))


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, tuple[int, ...]]:
    """A valid message (and a path into it) truncated, or with bytes changed, added or removed."""
    valid, path = draw(messages_and_paths())
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(("truncate", "flip", "insert", "delete")))
        i = draw(st.integers(0, len(data)))
        if op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=3))
        elif data and i < len(data):
            if op == "flip":
                data[i] = draw(st.integers(0, 255))
            else:
                del data[i]
    return bytes(data), path


@settings(max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated(), value=ids)
def test_mutated_messages_never_crash(case: tuple[bytes, tuple[int, ...]], value: str) -> None:
    data, path = case
    out = _only_invalid_argument(lambda: inject_id(data, path, value))
    _only_invalid_argument(lambda: extract_id(data, path))
    try:
        expected = Node.FromString(data)
    except DecodeError:
        return
    if out is not None:
        # Whenever both accept the input, the result is still what protobuf would give.
        set_path(expected, path, value)
        assert_same(Node.FromString(out), expected)


@pytest.mark.parametrize(
    ("data", "path", "fragment"),
    [
        (b"\x10", [1], "truncated varint at byte 1"),
        (b"\x10\x80\x80", [1], "truncated varint at byte 1"),
        (b"\x80", [1], "truncated varint at byte 0"),
        (b"\x10" + b"\xff" * 10 + b"\x01", [1], "varint longer than 10 bytes at byte 1"),
        (b"\xff" * 11, [1], "varint longer than 10 bytes at byte 0"),
        (b"\x0a\x05abc", [1], "runs past the end of its message"),
        (b"\x12\x05abc", [1], "runs past the end of its message"),
        (b"\x0a\x80", [1], "truncated varint at byte 1"),
        # The inner length fits in the buffer but not in its enclosing message.
        (b"\x0a\x03\x12\x05a" + ld(20, b"bcdefgh"), [1, 2], "runs past the end of its message"),
        (b"\x16", [1], "invalid wire type 6"),
        (b"\x17", [1], "invalid wire type 7"),
        (b"\x0e", [1], "field 1 at byte 0 has wire type 6"),
        (b"\x00", [1], "field number 0 at byte 0"),
        (b"\x02\x00", [1], "field number 0 at byte 0"),
        (b"\x80\x00\x01", [1], "field number 0 at byte 0"),
        (varint(((MAX_FIELD_NUMBER + 1) << 3) | 2) + b"\x00", [1], "out of range"),
        (b"\x11abc", [1], "truncated fixed-width field at byte 0"),
        (b"\x15ab", [1], "truncated fixed-width field at byte 0"),
        (b"\x14", [1], "end-group for field 2 at byte 0 without a start-group"),
        (b"\x13\x08\x01", [1], "start-group for field 2 at byte 0 is never closed"),
        (b"\x13\x1c", [1], "end-group for field 3 at byte 1 inside a group for field 2"),
        (b"\x13\x1b\x1c", [1], "start-group for field 2 at byte 0 is never closed"),
        (b"\x13" * 101 + b"\x14" * 101, [1], "groups nested deeper than 100"),
        (b"\x13" * 100_000, [1], "groups nested deeper than 100"),
        (b"\x13\x0e\x14", [1], "invalid wire type 6"),
        (b"\x13\x00\x14", [1], "field number 0"),
        (b"\x13\x0a\x05ab\x14", [1], "runs past the end of its message"),
        # Groups do not cross the bounds of a length-delimited message, either way.
        (b"\x0a\x01\x1c", [1, 2], "end-group for field 3 at byte 2 without a start-group"),
        (b"\x0a\x01\x1b\x1b\x1c", [1, 2], "start-group for field 3 at byte 2 is never closed"),
        # The path names a group, or a scalar, field.
        (b"\x0b\x0c", [1], "field 1 at byte 0 has wire type 3"),
        (b"\x08\x01", [1], "field 1 at byte 0 has wire type 0"),
        (b"\x08\x01", [1, 2], "field 1 at byte 0 has wire type 0"),
        (b"\x0a\x02\x15\x00", [1, 2], "field 2 at byte 2 has wire type 5"),
        (b"\x0d\x00\x00\x00\x00", [1, 2], "has wire type 5"),
    ],
)
def test_malformed(data: bytes, path: list[int], fragment: str) -> None:
    for fn in (lambda: inject_id(data, path, "m"), lambda: extract_id(data, path)):
        with pytest.raises(InvalidArgument) as e:
            fn()
        assert e.value.message.startswith("request body is not valid protobuf: ")
        assert fragment in e.value.message


def test_groups_deep_but_within_the_limit_are_skipped() -> None:
    data = b"\x13" * 100 + b"\x14" * 100 + ld(1, b"ok")
    assert extract_id(data, [1]) == "ok"
    assert inject_id(data, [1], "ok") is data
    assert inject_id(data, [1], "new") == data[:-4] + ld(1, b"new")


def test_fields_inside_skipped_groups_and_messages_are_not_the_path() -> None:
    # Field 1 inside an unknown group (20) and inside another message (5) is not model_name.
    group = tag(20, 3) + ld(1, b"in-group") + tag(20, 4)
    data = group + ld(5, ld(1, b"in-message")) + ld(1, b"top")
    assert extract_id(data, [1]) == "top"
    out = inject_id(data, [1], "m")
    assert out == group + ld(5, ld(1, b"in-message")) + ld(1, b"m")
    assert ModelInferRequest.FromString(out).model_name == "m"


def test_non_utf8_value() -> None:
    data = ld(1, b"\xff\xfe")
    with pytest.raises(InvalidArgument, match="not valid UTF-8"):
        extract_id(data, [1])
    # Injection replaces it without reading it.
    assert inject_id(data, [1], "m") == ld(1, b"m")
    with pytest.raises(InvalidArgument, match="UTF-8"):
        inject_id(b"", [1], "\ud800")


# --- fast path, exact bytes, edge cases -------------------------------------------------------


def test_already_set_returns_the_same_object() -> None:
    req = ModelInferRequest(model_name="m1", id="r")
    req.raw_input_contents.append(b"\x00" * 4096)
    data = req.SerializeToString()
    assert inject_id(data, [1], "m1") is data
    twice = data + ld(1, b"m1")
    assert inject_id(twice, [1], "m1") is twice
    nested = ld(2, ld(3, b"x") + ld(3, b"m1")) + ld(2, ld(3, b"m1"))
    assert inject_id(nested, [2, 3], "m1") is nested  # only the last occurrence of 2 is written into
    empty = ld(1, b"")
    assert inject_id(empty, [1], "") is empty


def test_every_occurrence_of_the_final_field_is_replaced_in_place() -> None:
    a, b, c = ld(2, b"v"), tag(4, 0) + b"\x01", ld(20, b"unknown")
    data = a + ld(1, b"old") + b + ld(1, b"m") + c + ld(1, b"") + a
    out = inject_id(data, [1], "m")
    assert out == a + ld(1, b"m") + b + ld(1, b"m") + c + ld(1, b"m") + a


def test_nested_splice_fixes_enclosing_lengths_only() -> None:
    head, tail = ld(5, b"blob") + tag(4, 0) + b"\x07", ld(6, b"label")
    first = ld(2, ld(1, b"first"))  # an earlier occurrence of 2: merged by protobuf, left alone
    inner = ld(6, b"x") + ld(1, b"old") + ld(5, b"y")
    data = head + first + ld(2, tag(4, 0) + b"\x01" + ld(3, inner) + ld(300, b"z")) + tail
    out = inject_id(data, [2, 3, 1], "new-id")
    new_inner = ld(6, b"x") + ld(1, b"new-id") + ld(5, b"y")
    assert out == head + first + ld(2, tag(4, 0) + b"\x01" + ld(3, new_inner) + ld(300, b"z")) + tail
    expected = Node.FromString(data)
    expected.child.other.name = "new-id"
    assert_same(Node.FromString(out), expected)


def test_absent_intermediate_is_appended_at_the_end_of_its_enclosing_message() -> None:
    data = ld(2, ld(6, b"a")) + ld(5, b"b")
    out = inject_id(data, [2, 3, 12, 2000], "id")
    assert out == ld(2, ld(6, b"a") + ld(3, ld(12, ld(2000, b"id")))) + ld(5, b"b")
    assert extract_id(out, [2, 3, 12, 2000]) == "id"
    # Present but empty: written into.
    empty = ld(2, b"")
    assert inject_id(empty, [2, 1], "id") == ld(2, ld(1, b"id"))


def test_merged_intermediate_occurrences() -> None:
    # The id is in the first occurrence of 2 only; protobuf merges both, so it is there.
    data = ld(2, ld(1, b"m")) + ld(2, ld(6, b"x"))
    assert extract_id(data, [2, 1]) == "m"
    assert Node.FromString(data).child.name == "m"
    # Writing goes into the last occurrence, where it wins the merge.
    out = inject_id(data, [2, 1], "n")
    assert out == ld(2, ld(1, b"m")) + ld(2, ld(6, b"x") + ld(1, b"n"))
    assert Node.FromString(out).child.name == "n"
    assert extract_id(out, [2, 1]) == "n"


def test_non_ascii_id() -> None:
    value = "modèle-ünïcödé-日本語-🙂"
    assert len(value.encode()) != len(value)
    req = ModelInferRequest(id="r")
    req.raw_input_contents.append(b"\x01\x02")
    data = req.SerializeToString()
    out = inject_id(data, [1], value)
    assert ModelInferRequest.FromString(out).model_name == value
    assert out == data + ld(1, value.encode())
    assert extract_id(out, [1]) == value
    assert inject_id(out, [1], value) is out
    deep = inject_id(ld(2, ld(6, b"a")), [2, 3, 1], value)
    assert Node.FromString(deep).child.other.name == value


def test_long_id_grows_and_shrinks_length_prefixes() -> None:
    long_id = "m" * 200  # a two-byte length, and so a two-byte prefix on every enclosing message
    data = ld(6, b"a") + ld(2, ld(3, ld(1, b"short") + ld(6, b"b")) + ld(6, b"c")) + ld(5, b"d")
    out = inject_id(data, [2, 3, 1], long_id)
    assert out == ld(6, b"a") + ld(2, ld(3, ld(1, long_id.encode()) + ld(6, b"b")) + ld(6, b"c")) + ld(5, b"d")
    # 195 more bytes of id, and the id's, 3's and 2's length prefixes each one byte longer.
    assert len(out) - len(data) == 195 + 3
    assert Node.FromString(out).child.other.name == long_id
    back = inject_id(out, [2, 3, 1], "short")
    assert back == data
    assert extract_id(inject_id(b"", [2, 3, 1], long_id), [2, 3, 1]) == long_id


def test_non_minimal_length_prefixes() -> None:
    # A padded length prefix (0x85 0x00 = 5) is legal; it is copied when the length is unchanged
    # and re-encoded minimally when it changes.
    data = b"\x12\x85\x00" + ld(1, b"abc")
    assert Node.FromString(data).child.name == "abc"
    same_length = inject_id(data, [2, 1], "xyz")
    assert same_length == b"\x12\x85\x00" + ld(1, b"xyz")
    longer = inject_id(data, [2, 1], "longer")
    assert longer == ld(2, ld(1, b"longer"))
    assert Node.FromString(longer).child.name == "longer"


def test_empty_message() -> None:
    assert inject_id(b"", [1], "m") == b"\x0a\x01m"
    assert inject_id(b"", [1], "") == b"\x0a\x00"
    assert inject_id(b"", [300], "m") == b"\xe2\x12\x01m"
    assert inject_id(b"", [2, 3, 1], "m") == ld(2, ld(3, ld(1, b"m")))
    assert extract_id(b"", [1]) is None
    assert extract_id(b"", [2, 1]) is None
    assert extract_id(ld(2, b""), [2, 1]) is None
    assert extract_id(ld(1, b""), [1]) == ""


def test_big_request_keeps_the_payload() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    req = ModelInferRequest(model_name="a", id="r")
    req.raw_input_contents.append(payload)
    data = req.SerializeToString()
    out = inject_id(data, [1], "model-b")
    assert out.endswith(ld(7, payload))
    parsed = ModelInferRequest.FromString(out)
    assert (parsed.model_name, parsed.id, parsed.raw_input_contents[0] == payload) == ("model-b", "r", True)
    assert extract_id(data, [1]) == "a"


@pytest.mark.parametrize("path", [[], (), [0], [-1], [MAX_FIELD_NUMBER + 1], [1, 0], [1.0], [True], ["1"], None, 5])
def test_path_validation(path: Any) -> None:
    with pytest.raises(ValueError):
        check_path(path)
    with pytest.raises(ValueError):
        inject_id(b"", path, "m")
    with pytest.raises(ValueError):
        extract_id(b"", path)


def test_check_path_returns_a_tuple() -> None:
    assert check_path([1]) == (1,)
    assert check_path((2, 3, MAX_FIELD_NUMBER)) == (2, 3, MAX_FIELD_NUMBER)
    assert inject_id(b"", (MAX_FIELD_NUMBER,), "m") == varint(MAX_FIELD_NUMBER << 3 | 2) + b"\x01m"
