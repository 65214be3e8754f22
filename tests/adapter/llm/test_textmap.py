"""KServe V2 text completions as Dynamo maps them (pure)."""

from __future__ import annotations

import struct

import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd.adapter.llm import textmap


def request(**parameters: object) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="m", id="7")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hello")
    for key, value in parameters.items():
        p = r.parameters[key]
        if isinstance(value, float):
            p.double_param = value
        elif isinstance(value, int):
            p.int64_param = value
        else:
            p.string_param = str(value)
    return r


def test_text_input_and_parameters_become_one_completion() -> None:
    body = textmap.completion_body(request(max_tokens=8, temperature=0.5, stop="\n", other=1), "engine-name")
    assert body == {
        "model": "engine-name",
        "prompt": "hello",
        "max_tokens": 8,
        "temperature": 0.5,
        "stop": "\n",
        "stream": False,
    }


def test_raw_contents_and_the_streaming_flag() -> None:
    r = pb.ModelInferRequest(model_name="m")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    r.inputs.add(name="streaming", datatype="BOOL", shape=[1])
    r.raw_input_contents.extend([struct.pack("<I", 2) + b"hi", b"\x01"])
    assert textmap.completion_body(r, "e") == {"model": "e", "prompt": "hi", "stream": True}
    # ModelStreamInfer streams unless the request says otherwise.
    assert textmap.completion_body(request(), "e", force_stream=True)["stream"] is True


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda r: r.inputs.add(name="x", datatype="FP32"), "not an input named 'x'"),
        (lambda r: r.ClearField("inputs"), "no text_input"),
        (lambda r: setattr(r.inputs[0], "datatype", "FP32"), "must be BYTES"),
        (lambda r: r.inputs[0].contents.bytes_contents.append(b"two"), "one prompt, not 2"),
        (lambda r: r.raw_input_contents.append(b"\x09\x00"), "truncated"),
        (lambda r: r.parameters["max_tokens"].CopyFrom(pb.InferParameter(string_param="8")), "must be a number"),
    ],
)
def test_what_a_language_model_does_not_take_is_refused(change: object, words: str) -> None:
    r = request()
    change(r)  # type: ignore[operator]
    with pytest.raises(textmap.BadTextRequest, match=words):
        textmap.completion_body(r, "e")


def test_answers_in_raw_bytes_as_triton_sends_them() -> None:
    resp = textmap.infer_response("m", "7", "héllo", "length")
    assert [(o.name, o.datatype, list(o.shape)) for o in resp.outputs] == [
        ("text_output", "BYTES", [1]),
        ("finish_reason", "BYTES", [1]),
    ]
    assert resp.raw_output_contents[0] == struct.pack("<I", 6) + "héllo".encode()
    assert textmap.completion_text({"choices": [{"text": "a", "finish_reason": None}]}) == ("a", None)
    assert textmap.completion_text({}) == ("", None)
    config = textmap.model_config("m", "p").config
    assert config.model_transaction_policy.decoupled and [i.name for i in config.input] == ["text_input", "streaming"]
