"""OpenAI calls at meshd's HTTP port: what a request must hold, and error shapes (pure)."""

from __future__ import annotations

import json

import pytest

from meshd.decisions.openai import (
    BadRequest,
    error_body,
    http_status,
    parse_request,
    reported_usage,
    retry_after,
    stream_events,
    tensor_model_message,
    token_timing,
)


def test_a_request_names_its_model_and_may_stream() -> None:
    r = parse_request(b'{"model": "m", "prompt": "x", "stream": true}')
    assert (r.model, r.stream, r.body["prompt"]) == ("m", True, "x")
    assert parse_request(b'{"model": "m"}').stream is False


@pytest.mark.parametrize(
    ("raw", "code", "param", "words"),
    [
        (b"{bad", "invalid_request", None, "not valid JSON"),
        (b"\xff\xfe", "invalid_request", None, "not valid JSON"),
        (b"[1, 2]", "invalid_request", None, "JSON object, not list"),
        (b'{"prompt": "x"}', "missing_model", "model", "names no 'model'"),
        (b'{"model": ""}', "invalid_request", "model", "non-empty string"),
        (b'{"model": 3}', "invalid_request", "model", "non-empty string"),
        (b'{"model": "m", "stream": "yes"}', "invalid_request", "stream", "true or false"),
        (b'{"model": "\\ud800"}', "invalid_request", "model", "not valid UTF-8"),
        (b'{"model": "a\\u0000b"}', "invalid_request", "model", "control characters"),
        (b'{"model": "' + b"m" * 2000 + b'"}', "invalid_request", "model", "the limit is 1024"),
    ],
)
def test_malformed_requests_are_refused_with_the_reason(raw: bytes, code: str, param: str | None, words: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_request(raw)
    assert (e.value.code, e.value.param, e.value.status) == (code, param, 400)
    assert words in e.value.message


def test_errors_have_openai_shape_and_status() -> None:
    assert error_body(404, "gone", "model_not_found", "model") == {
        "error": {"message": "gone", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    }
    assert error_body(503, "x")["error"]["type"] == "service_unavailable"
    assert error_body(500, "x")["error"]["type"] == "server_error"
    assert [http_status(c) for c in ("NOT_FOUND", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "INTERNAL")] == [
        404,
        503,
        429,
        500,
    ]
    assert (retry_after(503), retry_after(429), retry_after(404)) == (1, 1, None)


# ---- token accounting ------------------------------------------------------------------


def _events(*texts: str, usage: dict[str, int] | None = None) -> bytes:
    out = b"".join(f'data: {{"choices": [{{"text": "{t}"}}]}}\n\n'.encode() for t in texts)
    if usage is not None:
        out += f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
    return out + b"data: [DONE]\n\n"


def test_stream_events_counts_json_events_not_done() -> None:
    assert stream_events(_events("a", "b", "c")) == 3
    assert stream_events(b"") == 0
    assert stream_events(b"data: [DONE]\n\n") == 0


def test_reported_usage_reads_the_last_usage_event_or_a_json_body() -> None:
    assert reported_usage(_events("a", usage={"prompt_tokens": 7, "completion_tokens": 2})) == (7, 2)
    assert reported_usage(b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}') == (3, 9)
    assert reported_usage(b'{"data": [], "usage": {"prompt_tokens": 5, "total_tokens": 5}}') == (5, 0)  # embeddings
    assert reported_usage(_events("a", "b")) is None
    assert reported_usage(b'data: {"usage": {"prompt_tokens": "x"}}\n\n') is None
    assert reported_usage(b'data: {"usage": trunc') is None


def test_token_timing_of_a_stream() -> None:
    t = token_timing("/v1/completions", True, 10.0, 10.5, 11.5, 5, _events("e"))
    assert (t.operation, t.ttft_s, t.tpot_s, t.output_tokens, t.input_tokens) == ("text_completion", 0.5, 0.25, 5, None)
    # The engine's usage, when it sends one, is the count (its event is not a token).
    tail = _events("e", usage={"prompt_tokens": 4, "completion_tokens": 3})
    t = token_timing("/v1/chat/completions", True, 0.0, 1.0, 2.0, 6, tail)
    assert (t.operation, t.tpot_s, t.output_tokens, t.input_tokens) == ("chat", 0.5, 3, 4)
    one = token_timing("/v1/completions", True, 0.0, 1.0, 1.0, 1, b"")
    assert one.tpot_s is None and one.output_tokens == 1  # no time per token with one token


def test_token_timing_of_a_json_answer() -> None:
    body = b'{"choices": [{"text": "x"}], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}'
    t = token_timing("/v1/completions", False, 0.0, 1.0, 1.0, 0, body)
    assert (t.ttft_s, t.tpot_s, t.output_tokens, t.input_tokens) == (None, None, 9, 3)
    assert token_timing("/v1/completions", False, 0.0, 1.0, 1.0, 0, b"{}").output_tokens is None
    e = token_timing("/v1/embeddings", False, 0.0, 1.0, 1.0, 0, b'{"usage": {"prompt_tokens": 5}}')
    assert (e.operation, e.output_tokens, e.input_tokens) == ("embeddings", None, 5)


def test_a_tensor_model_message_names_the_language_model_types() -> None:
    """A type with a typo (`llama`, not `llamacpp`) reads as a tensor model: the answer names
    the types that are language models, so the fix is plain."""
    message = tensor_model_message("typo", "llama", "/v1/chat/completions")
    assert "'typo' (type 'llama') is not a language model" in message
    assert "gguf, llamacpp, llm, lora, ollama, sglang, vllm" in message
    assert message.endswith("infer with POST /v2/models/typo/infer")
