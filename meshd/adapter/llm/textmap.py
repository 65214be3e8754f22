"""KServe V2 text completions as Dynamo's KServe frontend maps them (pure).

In: `text_input` (BYTES, one element), optional `streaming` (BOOL); sampling settings as
request parameters (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`). They become one
OpenAI completion. Out: `text_output` and `finish_reason` (BYTES, one element each); a
streamed answer is one response per piece, `finish_reason` set on the last.
"""

from __future__ import annotations

from typing import Any

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd.core.tensor_bytes import join_bytes, split_bytes

TEXT_INPUT = "text_input"
STREAMING = "streaming"
TEXT_OUTPUT = "text_output"
FINISH_REASON = "finish_reason"
SAMPLING = {"max_tokens": int, "temperature": float, "top_p": float, "seed": int, "stop": str}


class BadTextRequest(ValueError):
    """The request is not a text completion this model takes (INVALID_ARGUMENT)."""


def completion_body(
    request: pb.ModelInferRequest, engine_name: str, force_stream: bool | None = None
) -> dict[str, Any]:
    """The OpenAI completion body for a ModelInfer request (`force_stream`: ModelStreamInfer
    streams unless the request says `streaming` false)."""
    text: str | None = None
    stream = False
    for i, tensor in enumerate(request.inputs):
        raw = request.raw_input_contents[i] if i < len(request.raw_input_contents) else None
        if tensor.name == TEXT_INPUT:
            if tensor.datatype != "BYTES":
                raise BadTextRequest(f"{TEXT_INPUT} must be BYTES, not {tensor.datatype or 'untyped'}")
            values = list(tensor.contents.bytes_contents) if raw is None else _raw_bytes(raw)
            if len(values) != 1:
                raise BadTextRequest(f"{TEXT_INPUT} must hold one prompt, not {len(values)}")
            try:
                text = values[0].decode()
            except UnicodeDecodeError:
                raise BadTextRequest(f"{TEXT_INPUT} is not UTF-8 text") from None
        elif tensor.name == STREAMING:
            if tensor.datatype != "BOOL":
                raise BadTextRequest(f"{STREAMING} must be BOOL, not {tensor.datatype or 'untyped'}")
            flags = list(tensor.contents.bool_contents) if raw is None else [b != 0 for b in raw]
            stream = bool(flags and flags[0])
        else:
            raise BadTextRequest(
                f"this language model takes {TEXT_INPUT} (BYTES) and optionally {STREAMING} (BOOL), "
                f"not an input named {tensor.name!r}"
            )
    if text is None:
        raise BadTextRequest(f"no {TEXT_INPUT} input: a language model takes a prompt as {TEXT_INPUT} (BYTES)")
    body: dict[str, Any] = {"model": engine_name, "prompt": text}
    for key, value in request.parameters.items():
        if key in SAMPLING:
            body[key] = _param(key, value)
    if force_stream is not None:
        has_flag = any(t.name == STREAMING for t in request.inputs)
        stream = stream if has_flag else force_stream
    body["stream"] = stream
    return body


def _param(key: str, value: pb.InferParameter) -> Any:
    choice = value.WhichOneof("parameter_choice")
    raw = getattr(value, choice) if choice else None
    kind = SAMPLING[key]
    if kind is str:
        if not isinstance(raw, str):
            raise BadTextRequest(f"parameter {key!r} must be a string")
        return raw
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise BadTextRequest(f"parameter {key!r} must be a number")
    return kind(raw)


def _raw_bytes(raw: bytes) -> list[bytes]:
    try:
        return split_bytes(raw)
    except ValueError as e:
        raise BadTextRequest(f"{TEXT_INPUT}: truncated raw BYTES contents ({e})") from None


def infer_response(model_name: str, request_id: str, text: str, finish_reason: str | None) -> pb.ModelInferResponse:
    """Outputs in `raw_output_contents`, as Triton sends them (tritonclient reads those)."""
    response = pb.ModelInferResponse(model_name=model_name, id=request_id)
    for name, value in ((TEXT_OUTPUT, text), (FINISH_REASON, finish_reason or "")):
        response.outputs.add(name=name, datatype="BYTES", shape=[1])
        response.raw_output_contents.append(join_bytes([value.encode()]))
    return response


def completion_text(answer: dict[str, Any]) -> tuple[str, str | None]:
    """The text and finish reason of an OpenAI completion (whole, or one streamed piece)."""
    choices = answer.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    text = choice.get("text")
    return (text if isinstance(text, str) else ""), choice.get("finish_reason")


def metadata(model_name: str, platform: str) -> pb.ModelMetadataResponse:
    T = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=model_name,
        platform=platform,
        inputs=[T(name=TEXT_INPUT, datatype="BYTES", shape=[1]), T(name=STREAMING, datatype="BOOL", shape=[1])],
        outputs=[
            T(name=TEXT_OUTPUT, datatype="BYTES", shape=[-1]),
            T(name=FINISH_REASON, datatype="BYTES", shape=[-1]),
        ],
    )


def model_config(model_name: str, platform: str) -> pb.ModelConfigResponse:
    """Triton's view: a decoupled model (many responses per streamed request)."""
    config = pb.ModelConfig(name=model_name, platform=platform, backend=platform, max_batch_size=0)
    config.input.add(name=TEXT_INPUT, data_type=pb.TYPE_STRING, dims=[1])
    config.input.add(name=STREAMING, data_type=pb.TYPE_BOOL, dims=[1], optional=True)
    config.output.add(name=TEXT_OUTPUT, data_type=pb.TYPE_STRING, dims=[-1])
    config.output.add(name=FINISH_REASON, data_type=pb.TYPE_STRING, dims=[-1])
    config.model_transaction_policy.decoupled = True
    return pb.ModelConfigResponse(config=config)
