"""Demo model file format, generation, math, and KServe V2 request/response helpers."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd.runtimes.models import (
    FORMAT,
    DemoModel,
    decode_infer_request,
    decode_infer_response,
    generate_models,
    main,
    make_echo_request,
    make_infer_request,
    make_infer_response,
    pack_f32,
    unpack_f32,
    write_echo_model,
)


def linear(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "format": FORMAT,
        "kind": "linear",
        "inputs": 2,
        "outputs": 2,
        "weights": [[1.0, 2.0], [-1.0, 0.5]],
        "bias": [0.25, -3.0],
        "size_bytes": 1000,
    }
    data.update(overrides)
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "JSON object"),
        (linear(format="meshd-demo/2"), "'format'"),
        (linear(kind="conv"), "'kind'"),
        (linear(inputs=0), "'inputs'"),
        (linear(outputs=True), "'outputs'"),
        (linear(weights=[[1.0, 2.0]]), "list of 2 rows"),
        (linear(weights=[[1.0, 2.0], [1.0]]), "'weights'[1]"),
        (linear(weights=[[1.0, "2"], [1.0, 1.0]]), "'weights'[0][1]"),
        (linear(bias=[1.0]), "'bias'"),
        (linear(bias=[1.0, float("nan")]), "'bias'[1]"),
        (linear(size_bytes=-1), "'size_bytes'"),
        ({"format": FORMAT, "kind": "echo", "weights": [[1.0]]}, "echo model has no 'weights'"),
    ],
)
def test_invalid_model_files_are_rejected_with_clear_messages(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=r"^src: ") as info:
        DemoModel.from_dict(data, source="src")
    assert message in str(info.value)


def test_load_reads_valid_files_and_names_the_path_on_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(linear(extra_key="ignored")))
    model = DemoModel.load(good)
    assert (model.kind, model.inputs, model.outputs, model.size_bytes) == ("linear", 2, 2, 1000)
    assert model.weights == ((1.0, 2.0), (-1.0, 0.5))

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"{bad}: not valid JSON"):
        DemoModel.load(bad)
    with pytest.raises(OSError):
        DemoModel.load(tmp_path / "missing.json")

    # size_bytes is optional: the runtime then reports its default.
    no_size = linear()
    del no_size["size_bytes"]
    assert DemoModel.from_dict(no_size).size_bytes is None


def test_predict_computes_wx_plus_b() -> None:
    model = DemoModel.from_dict(linear())
    assert model.predict([[1.0, 1.0], [2.0, -4.0]]) == [[3.25, -3.5], [-5.75, -7.0]]
    with pytest.raises(ValueError, match="row 0 has 3 values"):
        model.predict([[1.0, 2.0, 3.0]])


def test_echo_model_returns_its_inputs(tmp_path: Path) -> None:
    path = write_echo_model(tmp_path / "sub" / "echo.json", size_bytes=12345)
    model = DemoModel.load(path)
    assert (model.kind, model.size_bytes) == ("echo", 12345)
    assert model.predict([[1.0, 2.0, 3.0], [4.0]]) == [[1.0, 2.0, 3.0], [4.0]]


def test_generate_models_is_deterministic_and_distinct(tmp_path: Path) -> None:
    first = generate_models(tmp_path / "a", 5, prefix="m-", inputs=3, outputs=2, size_bytes=777, seed=7)
    again = generate_models(tmp_path / "b", 5, prefix="m-", inputs=3, outputs=2, size_bytes=777, seed=7)
    other = generate_models(tmp_path / "c", 5, prefix="m-", inputs=3, outputs=2, size_bytes=777, seed=8)
    assert [g.id for g in first] == ["m-0000", "m-0001", "m-0002", "m-0003", "m-0004"]
    assert [g.path.read_bytes() for g in first] == [g.path.read_bytes() for g in again]
    assert [g.path.read_bytes() for g in first] != [g.path.read_bytes() for g in other]

    loaded = [DemoModel.load(g.path) for g in first]
    assert len({m.weights for m in loaded}) == 5
    assert all((m.inputs, m.outputs, m.size_bytes) == (3, 2, 777) for m in loaded)
    # bias[0] is the index, so all-zero input tells which model answered.
    assert [m.predict([[0.0, 0.0, 0.0]])[0][0] for m in loaded] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_float32_encoding_is_little_endian() -> None:
    assert pack_f32([1.0, -2.5]) == struct.pack("<2f", 1.0, -2.5)
    assert unpack_f32(struct.pack("<3f", 0.5, 3.0, -1.0)) == [0.5, 3.0, -1.0]
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack_f32(b"\x00" * 5)


def test_infer_request_round_trips_through_the_wire() -> None:
    rows = [[1.0, 2.0, 3.0], [-0.5, 0.25, 8.0]]
    req = make_infer_request("m1", rows)
    assert (req.model_name, req.inputs[0].name, req.inputs[0].datatype) == ("m1", "x", "FP32")
    assert list(req.inputs[0].shape) == [2, 3]
    assert req.raw_input_contents[0] == struct.pack("<6f", *rows[0], *rows[1])
    parsed = pb.ModelInferRequest.FromString(req.SerializeToString())
    assert decode_infer_request(parsed, 3) == rows

    # Typed contents instead of raw bytes are accepted too.
    typed = pb.ModelInferRequest(model_name="m1")
    typed.inputs.add(name="x", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([1.5, 2.5])
    assert decode_infer_request(typed, 2) == [[1.5, 2.5]]

    with pytest.raises(ValueError, match="at least one row"):
        make_infer_request("m1", [])
    with pytest.raises(ValueError, match="row 1 has 1 values"):
        make_infer_request("m1", [[1.0, 2.0], [1.0]])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.inputs[0].__setattr__("datatype", "FP64"), "datatype 'FP64'"),
        (lambda r: r.inputs[0].shape.__setitem__(slice(None), [6]), "expected [batch, n]"),
        (lambda r: r.inputs[0].shape.__setitem__(slice(None), [3, 2]), "the model takes [batch, 3]"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\x00" * 8), "has 2 values"),
        (lambda r: r.inputs.add(name="z", datatype="FP32", shape=[1]), "raw_input_contents for 2 inputs"),
        (lambda r: r.ClearField("inputs"), "no input tensors"),
    ],
)
def test_decode_infer_request_rejects_bad_tensors(mutate: Any, message: str) -> None:
    req = make_infer_request("m1", [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mutate(req)
    with pytest.raises(ValueError) as info:
        decode_infer_request(req, 3)
    assert message in str(info.value)


def test_infer_response_round_trips_raw_and_typed() -> None:
    rows = [[1.0, -2.0], [0.125, 4.0]]
    resp = pb.ModelInferResponse.FromString(make_infer_response("m1", rows, 2).SerializeToString())
    assert (resp.model_name, resp.outputs[0].name, list(resp.outputs[0].shape)) == ("m1", "y", [2, 2])
    assert decode_infer_response(resp) == rows

    typed = pb.ModelInferResponse(model_name="m1")
    typed.outputs.add(name="y", datatype="FP32", shape=[1, 3]).contents.fp32_contents.extend([1.0, 2.0, 3.0])
    assert decode_infer_response(typed) == [[1.0, 2.0, 3.0]]

    with pytest.raises(ValueError, match="no output tensors"):
        decode_infer_response(pb.ModelInferResponse())


def test_echo_request_carries_the_requested_number_of_bytes() -> None:
    req = make_echo_request("echo", 1000)
    assert (req.model_name, req.inputs[0].datatype, list(req.inputs[0].shape)) == ("echo", "UINT8", [1000])
    assert len(req.raw_input_contents[0]) == 1000
    assert req.raw_input_contents[0][:3] == b"\x00\x01\x02"
    assert make_echo_request("echo", 0).raw_input_contents[0] == b""


def test_gen_models_command_prints_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "out"), "--count", "3", "--size-bytes", "99", "--prefix", "p-"]) == 0
    assert capsys.readouterr().out.split() == ["p-0000", "p-0001", "p-0002"]
    assert DemoModel.load(tmp_path / "out" / "p-0002.json").size_bytes == 99
    with pytest.raises(SystemExit):
        main([str(tmp_path / "out"), "--count", "-1"])
