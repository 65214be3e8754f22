"""OpenAI calls at meshd's HTTP port: what a request must hold, and error shapes (pure)."""

from __future__ import annotations

import pytest

from meshd.decisions.openai import BadRequest, error_body, http_status, parse_request, retry_after


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
