"""JSON log lines and the per-invocation log (MM_LOG_EACH_INVOKE)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from meshd.observability.logs import JsonFormatter, parse_log_format
from meshd.observability.metrics import NO_METRICS
from meshd.serving.invocations import SERVED, Invocations
from meshd.serving.proxy.headers import RequestIds

INFER = "/inference.GRPCInferenceService/ModelInfer"


def record(msg: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("meshd.test", logging.WARNING, __file__, 1, msg, args, exc_info)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_parse_with_message_exception_and_extras() -> None:
    line = JsonFormatter().format(record("loaded %s in %d ms", "m1", 12, exc=True, modelId="m1", durationMs=1.5))
    assert "\n" not in line  # one object per line, the traceback escaped inside it
    obj = json.loads(line)
    assert obj["level"] == "WARNING" and obj["logger"] == "meshd.test"
    assert obj["message"] == "loaded m1 in 12 ms"
    assert obj["time"].endswith("+00:00") and "T" in obj["time"]
    assert "ValueError: boom" in obj["exception"]
    assert (obj["modelId"], obj["durationMs"]) == ("m1", 1.5)
    assert "args" not in obj and "msecs" not in obj


def test_log_format_values() -> None:
    assert parse_log_format(" JSON ") == "json" and parse_log_format("text") == "text"
    with pytest.raises(ValueError, match="text or json"):
        parse_log_format("xml")


def test_one_invoke_record_per_call_with_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    calls = Invocations(NO_METRICS, log_each=True, self_id="inst-a")
    caplog.set_level(logging.INFO, logger="meshd.invocations")
    started = calls.start()
    SERVED.set(("m1", "inst-a"))  # what the router notes when the local runtime serves
    calls.done(INFER, RequestIds(None, "vm"), "OK", started, 10, 20)
    started = calls.start()  # a new call forgets the last one's note
    calls.done(INFER, RequestIds("nope", None), "NOT_FOUND", started, 10, -1)
    started = calls.start()
    SERVED.set(("m2", "inst-b"))
    calls.done(INFER, RequestIds("m2", None), "OK", started, 10, 20)
    fields = [
        (r.levelname, r.modelId, r.vModelId, r.method, r.code, r.servedBy)  # type: ignore[attr-defined]
        for r in caplog.records
    ]
    assert fields == [
        ("INFO", "m1", "vm", INFER, "OK", "local"),
        ("INFO", "nope", None, INFER, "NOT_FOUND", None),
        ("INFO", "m2", None, INFER, "OK", "inst-b"),
    ]
    assert all(r.durationMs >= 0 for r in caplog.records)  # type: ignore[attr-defined]


def test_no_invoke_records_when_off(caplog: pytest.LogCaptureFixture) -> None:
    calls = Invocations(NO_METRICS, log_each=False, self_id="inst-a")
    caplog.set_level(logging.DEBUG)
    assert not calls.active
    calls.done(INFER, RequestIds("m1", None), "OK", calls.start(), 1, 1)
    assert caplog.records == []
