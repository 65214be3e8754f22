"""KServe V2 HTTP inference JSON (and its binary-data extension) to ModelInfer and back."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd.api.kserve_json import (
    BadTensor,
    OutputChoice,
    decode,
    flatten,
    parse_infer_request,
    render_infer_response,
)

NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
SAMPLES: dict[str, list[Any]] = {
    "BOOL": [True, False, True, True],
    "UINT8": [0, 1, 254, 255],
    "UINT16": [0, 1, 65534, 65535],
    "UINT32": [0, 1, 2**32 - 2, 2**32 - 1],
    "UINT64": [0, 1, 2**64 - 2, 2**64 - 1],
    "INT8": [-128, -1, 0, 127],
    "INT16": [-32768, -1, 0, 32767],
    "INT32": [-(2**31), -1, 0, 2**31 - 1],
    "INT64": [-(2**63), -1, 0, 2**63 - 1],
    "FP16": [0.5, -1.5, 2.0, 65504.0],
    "FP32": [0.25, -1.5, 3.0, 1e10],
    "FP64": [0.1, -1e300, 3.0, 2.5],
}


def request(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def parse(body: bytes, header_length: int | None = None) -> tuple[pb.ModelInferRequest, OutputChoice]:
    return parse_infer_request(body, header_length, "m1", "")


@pytest.mark.parametrize("datatype", sorted(NUMPY))
def test_every_fixed_datatype_goes_raw_as_numpy_lays_it_out(datatype: str) -> None:
    values = SAMPLES[datatype]
    req, _ = parse(request([{"name": "x", "shape": [2, 2], "datatype": datatype, "data": values}]))
    assert req.model_name == "m1"
    tensor = req.inputs[0]
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("x", datatype, [2, 2])
    expected = np.array(values, dtype=NUMPY[datatype]).astype(np.dtype(NUMPY[datatype]).newbyteorder("<"))
    assert req.raw_input_contents[0] == expected.tobytes()
    assert decode(datatype, req.raw_input_contents[0], "x") == values


def test_nested_data_is_row_major_and_bytes_are_length_prefixed() -> None:
    assert flatten([[1, 2], [3, [4, 5]]]) == [1, 2, 3, 4, 5]
    assert flatten(7) == [7]
    doc = [
        {"name": "a", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]},
        {"name": "s", "shape": [2], "datatype": "BYTES", "data": ["hé", ""]},
    ]
    req, _ = parse(request(doc))
    assert req.raw_input_contents[0] == struct.pack("<4i", 1, 2, 3, 4)
    assert req.raw_input_contents[1] == struct.pack("<I", 3) + "hé".encode() + struct.pack("<I", 0)
    assert decode("BYTES", req.raw_input_contents[1], "s") == ["hé", ""]


def test_bf16_is_the_upper_half_of_float32() -> None:
    req, _ = parse(request([{"name": "x", "shape": [3], "datatype": "BF16", "data": [1.5, -2.0, 0.0]}]))
    raw = req.raw_input_contents[0]
    assert raw == b"".join(struct.pack("<f", v)[2:] for v in (1.5, -2.0, 0.0))
    assert decode("BF16", raw, "x") == [1.5, -2.0, 0.0]


def test_binary_inputs_follow_the_json_header_in_input_order() -> None:
    a = np.arange(6, dtype=np.float32)
    s = struct.pack("<I", 2) + b"\xff\x00"  # BYTES need not be UTF-8 when binary
    header = request(
        [
            {"name": "a", "shape": [2, 3], "datatype": "FP32", "parameters": {"binary_data_size": a.nbytes}},
            {"name": "j", "shape": [1], "datatype": "INT64", "data": [7]},
            {"name": "s", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": len(s)}},
        ],
        parameters={"binary_data_output": True, "priority": 3, "tag": "t", "ratio": 0.5, "fast": False},
        id="req-1",
    )
    req, choice = parse(header + a.tobytes() + s, len(header))
    assert list(req.raw_input_contents) == [a.tobytes(), struct.pack("<q", 7), s]
    assert req.id == "req-1" and choice.all_binary
    # The HTTP-only parameters stay here; the rest go on typed.
    assert set(req.parameters) == {"priority", "tag", "ratio", "fast"}
    assert req.parameters["priority"].int64_param == 3 and req.parameters["tag"].string_param == "t"
    assert req.parameters["ratio"].double_param == 0.5 and req.parameters["fast"].WhichOneof("parameter_choice")
    assert "binary_data_size" not in req.inputs[0].parameters


def test_requested_outputs_and_their_binary_choice() -> None:
    body = request(
        [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}],
        outputs=[{"name": "y", "parameters": {"binary_data": True, "classification": 2}}, {"name": "z"}],
    )
    req, choice = parse(body)
    assert [o.name for o in req.outputs] == ["y", "z"]
    assert set(req.outputs[0].parameters) == {"classification"}
    assert choice.wants_binary("y") and not choice.wants_binary("z")


@pytest.mark.parametrize(
    ("body", "header_length", "message"),
    [
        (b"{", None, "malformed JSON"),
        (b"[]", None, "must be a JSON object"),
        (b"{}", None, "'inputs' must be a non-empty list"),
        (request([{"shape": [1], "datatype": "FP32", "data": [1]}]), None, "name must be a non-empty string"),
        (request([{"name": "x", "shape": [1], "datatype": "FP8", "data": [1]}]), None, "datatype must be one of"),
        (request([{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]), None, "shape must be a list"),
        (request([{"name": "x", "shape": "1", "datatype": "FP32", "data": [1]}]), None, "shape must be a list"),
        (request([{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2]}]), None, "needs 3 elements"),
        (request([{"name": "x", "shape": [1], "datatype": "FP32"}]), None, "has no 'data'"),
        (request([{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}]), None, "does not fit INT8"),
        (request([{"name": "x", "shape": [1], "datatype": "UINT8", "data": [-1]}]), None, "does not fit UINT8"),
        (request([{"name": "x", "shape": [1], "datatype": "INT32", "data": [1.5]}]), None, "does not fit INT32"),
        (request([{"name": "x", "shape": [1], "datatype": "FP32", "data": ["1"]}]), None, "must be numbers"),
        (request([{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}]), None, "true or false"),
        (request([{"name": "x", "shape": [1], "datatype": "BYTES", "data": [1]}]), None, "must be strings"),
        (request([{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], id=3), None, "'id' must be"),
        (request([{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], outputs={}), None, "'outputs'"),
        (
            request([{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}], parameters={"p": [1]}),
            None,
            "parameters.p must be",
        ),
        (request([{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]), 10_000, "outside the body"),
    ],
)
def test_bad_requests_say_what_is_wrong(body: bytes, header_length: int | None, message: str) -> None:
    with pytest.raises(BadTensor, match=message):
        parse(body, header_length)


@pytest.mark.parametrize(
    ("size", "binary", "message"),
    [
        (8, b"\0" * 4, "runs past the binary data"),
        (4, b"\0" * 8, "4 bytes after the JSON header belong to no input"),
        (6, b"\0" * 6, "needs 2 elements, the binary data holds 1"),
        (3, b"\0" * 3, "not a whole number of FP32"),
    ],
)
def test_bad_binary_inputs(size: int, binary: bytes, message: str) -> None:
    dtype = "FP64" if size == 6 else "FP32"
    if size == 6:
        binary, size = b"\0" * 8, 8
    shape = [2] if dtype == "FP64" else [size // 4 or 1]
    header = request([{"name": "x", "shape": shape, "datatype": dtype, "parameters": {"binary_data_size": size}}])
    with pytest.raises(BadTensor, match=message):
        parse(header + binary, len(header))


def test_data_and_binary_together_is_refused() -> None:
    header = request(
        [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1], "parameters": {"binary_data_size": 4}}]
    )
    with pytest.raises(BadTensor, match="both 'data' and binary_data_size"):
        parse(header + b"\0" * 4, len(header))


def response(raw: bool = True) -> pb.ModelInferResponse:
    resp = pb.ModelInferResponse(model_name="m1", model_version="2", id="r")
    resp.parameters["seq"].int64_param = 4
    y = resp.outputs.add(name="y", datatype="FP32", shape=[1, 2])
    s = resp.outputs.add(name="s", datatype="BYTES", shape=[2])
    if raw:
        resp.raw_output_contents.extend(
            [struct.pack("<2f", 0.5, -1.0), struct.pack("<I", 2) + b"ok" + struct.pack("<I", 0)]
        )
    else:
        y.contents.fp32_contents.extend([0.5, -1.0])
        s.contents.bytes_contents.extend([b"ok", b""])
    return resp


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed contents"])
def test_responses_as_json(raw: bool) -> None:
    body, header_length = render_infer_response(response(raw), OutputChoice())
    assert header_length is None
    assert json.loads(body) == {
        "model_name": "m1",
        "model_version": "2",
        "id": "r",
        "parameters": {"seq": 4},
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [0.5, -1.0]},
            {"name": "s", "datatype": "BYTES", "shape": [2], "data": ["ok", ""]},
        ],
    }


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed contents"])
@pytest.mark.parametrize("choice", [OutputChoice(frozenset({"y"})), OutputChoice(all_binary=True)])
def test_binary_outputs_follow_the_json_header(raw: bool, choice: OutputChoice) -> None:
    body, header_length = render_infer_response(response(raw), choice)
    assert header_length is not None
    doc = json.loads(body[:header_length])
    y, s = doc["outputs"]
    assert y["parameters"] == {"binary_data_size": 8} and "data" not in y
    rest = body[header_length:]
    assert rest[:8] == struct.pack("<2f", 0.5, -1.0)
    if choice.all_binary:
        assert s["parameters"] == {"binary_data_size": 10} and rest[8:] == struct.pack("<I", 2) + b"ok" + b"\0" * 4
    else:
        assert s["data"] == ["ok", ""] and len(rest) == 8


def test_bytes_that_are_not_text_must_be_asked_for_as_binary() -> None:
    resp = pb.ModelInferResponse(model_name="m1")
    resp.outputs.add(name="s", datatype="BYTES", shape=[1])
    resp.raw_output_contents.append(struct.pack("<I", 1) + b"\xff")
    with pytest.raises(BadTensor, match="not UTF-8 text: ask for it as binary data"):
        render_infer_response(resp, OutputChoice())
    body, header_length = render_infer_response(resp, OutputChoice(frozenset({"s"})))
    assert header_length is not None and body[header_length:] == struct.pack("<I", 1) + b"\xff"


def test_a_runtime_answer_with_mismatched_raw_outputs_is_an_error() -> None:
    resp = response()
    resp.raw_output_contents.append(b"")
    with pytest.raises(ValueError, match="2 outputs with 3 raw_output_contents"):
        render_infer_response(resp, OutputChoice())
