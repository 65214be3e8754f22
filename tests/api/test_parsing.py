"""Requests that do not parse become `Malformed` (answered INVALID_ARGUMENT), never an exception."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.api.parsing import Malformed, tolerant_parser

parse = tolerant_parser(mm.RegisterModelRequest)


def test_valid_bytes_parse_to_the_generated_class() -> None:
    req = mm.RegisterModelRequest(modelId="m", modelInfo=mm.ModelInfo(type="t"), loadNow=True)
    got = parse(req.SerializeToString())
    assert type(got) is mm.RegisterModelRequest and got == req


def test_malformed_and_non_utf8_bytes_name_the_message_type() -> None:
    for raw in (b"\x0a\xff\xff", b"\x0a\x02\xff\xfe", b"\x12\x05\x0a\x01"):
        got = parse(raw)
        assert isinstance(got, Malformed), raw
        assert "mmesh.RegisterModelRequest" in got.reason


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_raise(raw: bytes) -> None:
    got = parse(raw)
    assert isinstance(got, (Malformed, mm.RegisterModelRequest))
