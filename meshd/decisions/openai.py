"""OpenAI-compatible calls at meshd's HTTP port: what a request must hold, and errors in
OpenAI's shape (pure).

A call's body is a JSON object naming its `model` (a model or vmodel id); `stream`, when
present, is a boolean. Errors are `{"error": {"message", "type", "code", "param"}}` with the
HTTP status the OpenAI API uses for the same case: 400 a malformed request, 404 an unknown
model, 429 no copy could take it in time (retry later), 503 nothing can serve it now; and 502
`model_load_failed` for a registered model that could not be loaded (no retry will help until
the model or its runtime is fixed: the OpenAI API has no such case).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshd.core.errors import InvalidArgument
from meshd.core.model_types import LLM_MODEL_TYPES
from meshd.decisions.ids import check_id

# Paths meshd carries to an LLM engine, and the gRPC method that carries them (protos/meshd/llm.proto).
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
CALL_METHOD = "/meshd.llm.OpenAI/Call"
# Seconds a client is told to wait on 429/503: engines restart in about a second, and a
# refused load is worth retrying as soon as a loading thread frees.
RETRY_AFTER_S = 1
# A registered model whose loads failed wherever they were tried (gRPC: INTERNAL, upstream's
# answer): a bad gateway, the model's engine behind meshd, with a code of its own.
LOAD_FAILED_STATUS = 502
LOAD_FAILED_CODE = "model_load_failed"

# gRPC status (its name) of a mesh error -> HTTP status (as the KServe REST port maps them).
_HTTP = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_implemented",
    503: "service_unavailable",
    504: "timeout",
}


class BadRequest(ValueError):
    """A request meshd refuses before routing it (400 unless `status` says otherwise)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    model: str
    stream: bool
    body: dict[str, Any]


def parse_request(raw: bytes) -> OpenAIRequest:
    """The request's model and stream flag; BadRequest naming what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
    model = body.get("model")
    if model is None:
        raise BadRequest("the body names no 'model'", param="model", code="missing_model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    try:
        check_id(model, "'model'")  # it becomes an etcd key: not empty, bounded, printable UTF-8
    except InvalidArgument as e:
        raise BadRequest(e.message, param="model") from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, not {json.dumps(stream)}", param="stream")
    return OpenAIRequest(model, stream, body)


def http_status(code_name: str) -> int:
    """The HTTP status for a gRPC status name (500 for any other)."""
    return _HTTP.get(code_name, 500)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for an HTTP status."""
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def retry_after(status: int) -> int | None:
    """The Retry-After (seconds) for an error status: only where a retry soon may succeed."""
    return RETRY_AFTER_S if status in (429, 503) else None


def tensor_model_message(model_id: str, model_type: str, path: str) -> str:
    """Names the language model types: a type with a typo (`llama`) reads as a tensor model."""
    return (
        f"model {model_id!r} (type {model_type!r}) is not a language model and does not serve {path} "
        f"(language model types: {', '.join(sorted(LLM_MODEL_TYPES))}); "
        f"infer with POST /v2/models/{model_id}/infer"
    )


# ---- token accounting (the gen_ai_* metrics) ------------------------------------------
# OpenTelemetry's GenAI operation names for the paths meshd carries.
OPERATIONS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat", "/v1/embeddings": "embeddings"}
_EVENT = b"data: {"  # one SSE event with a JSON object: a piece of the answer (or an error)
_USAGE = b'"usage"'


def stream_events(piece: bytes) -> int:
    """The SSE events in a piece of a streamed answer (`[DONE]` not counted). Engines send one
    event per token (vLLM, SGLang, llama.cpp at their default stream interval), so this is
    the output token count when the engine reports no usage; chat's first piece (the role)
    and last (the finish reason) count too. A byte count, not a parse: it runs per piece."""
    return piece.count(_EVENT)


def reported_usage(tail: bytes) -> tuple[int, int] | None:
    """(input tokens, output tokens) from the `usage` object of an answer: a JSON body, or the
    last events of a stream (vLLM sends it last with `stream_options.include_usage`); None
    when it holds none. Only the last `data:` event holding a usage is read."""
    at = tail.rfind(_USAGE)
    if at < 0:
        return None
    start = tail.rfind(b"data: ", 0, at)
    text = tail[start + 6 :] if start >= 0 else tail
    end = text.find(b"\n\n")
    try:
        value = json.loads(text[:end] if end >= 0 else text)
    except (ValueError, UnicodeDecodeError):
        return None
    usage = value.get("usage") if isinstance(value, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or isinstance(prompt, bool) or prompt < 0:
        return None
    if not isinstance(completion, int) or isinstance(completion, bool) or completion < 0:
        completion = 0  # embeddings report prompt tokens only
    return prompt, completion


@dataclass(frozen=True, slots=True)
class TokenTiming:
    """One answered call's token figures, for the gen_ai_* metrics (None: not known)."""

    operation: str  # OPERATIONS' value
    ttft_s: float | None  # time to the first piece of a stream, from the call's arrival
    tpot_s: float | None  # time per output token after the first (streams of 2 tokens or more)
    output_tokens: int | None
    input_tokens: int | None


def token_timing(
    path: str, streamed: bool, started: float, first: float | None, last: float | None, events: int, tail: bytes
) -> TokenTiming:
    """A call's figures from its clock readings (seconds: arrival, first and last piece), the
    SSE events counted and the last bytes of the answer (a JSON answer: all of it)."""
    usage = reported_usage(tail)
    operation = OPERATIONS.get(path, path)
    if not streamed:
        if usage is None:
            return TokenTiming(operation, None, None, None, None)
        return TokenTiming(operation, None, None, usage[1] if operation != "embeddings" else None, usage[0])
    output = usage[1] if usage is not None and usage[1] > 0 else events
    ttft = first - started if first is not None else None
    tpot = (last - first) / (output - 1) if first is not None and last is not None and output > 1 else None
    return TokenTiming(operation, ttft, tpot, output, usage[0] if usage is not None else None)
