"""meshd.observability.tracing: which OTEL_* values turn tracing on, that bad ones never stop an instance,
and the W3C trace context in and out of gRPC metadata."""

from __future__ import annotations

import logging
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from meshd.observability.tracing import Tracing, from_env, trace_settings

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)


def test_off_unless_an_exporter_is_named() -> None:
    assert not trace_settings({}).enabled
    assert not trace_settings({"OTEL_TRACES_EXPORTER": "none"}).enabled
    assert not trace_settings({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}).enabled
    assert trace_settings({"OTEL_TRACES_EXPORTER": "otlp, console,otlp"}).exporters == ("otlp", "console")
    assert trace_settings({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}).enabled
    assert from_env("inst-a") is None


def test_protocol_from_either_variable() -> None:
    assert trace_settings({"OTEL_TRACES_EXPORTER": "otlp"}).otlp_protocol == "grpc"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert trace_settings(env).otlp_protocol == "http/protobuf"
    assert trace_settings({**env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}).otlp_protocol == "grpc"


def test_bad_values_are_reported_and_ignored() -> None:
    s = trace_settings(
        {
            "OTEL_TRACES_EXPORTER": "jaeger,console",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "pigeon",
            "OTEL_BSP_SCHEDULE_DELAY": "soon",
            "OTEL_BSP_MAX_QUEUE_SIZE": "-1",
        }
    )
    assert s.exporters == ("console",)
    assert s.otlp_protocol == "grpc"
    assert s.batch == {"schedule_delay_millis": 5000, "max_queue_size": 2048}
    assert len(s.problems) == 4 and all("\n" not in p for p in s.problems)


@pytest.mark.parametrize(
    "var,value",
    [
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "zip"),
        ("OTEL_BSP_SCHEDULE_DELAY", "soon"),
        ("OTEL_TRACES_SAMPLER", "sometimes"),
        ("OTEL_TRACES_SAMPLER_ARG", "half"),
        ("OTEL_RESOURCE_ATTRIBUTES", "no-equals-sign"),
        ("OTEL_TRACES_EXPORTER", "otlp,jaeger"),
    ],
)
def test_bad_otel_values_never_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, var: str, value: str
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv(var, value)
    with caplog.at_level(logging.WARNING):
        tracing = from_env("inst-a")  # on, or off with a warning: never an exception
    if tracing is not None:
        tracing.provider.shutdown()
    assert not any(r.exc_info for r in caplog.records), "no traceback in the log"


def test_resource_names_meshd_and_the_instance_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    tracing = from_env("inst-a")
    assert tracing is not None
    attrs = tracing.provider.resource.attributes
    assert attrs["service.name"] == "meshd" and attrs["service.instance.id"] == "inst-a"
    tracing.provider.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mesh-east")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7,team=ml")
    tracing = from_env("inst-a")
    assert tracing is not None
    attrs = tracing.provider.resource.attributes
    assert (attrs["service.name"], attrs["service.instance.id"], attrs["team"]) == ("mesh-east", "pod-7", "ml")
    tracing.provider.shutdown()


def in_memory() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def test_server_span_continues_the_callers_trace_and_injects_its_own() -> None:
    tracing, exporter = in_memory()
    incoming = (("traceparent", TRACEPARENT), ("tracestate", "vendor=1"), ("x-user", "u"))
    span = tracing.start_server("/meshd.demo.Echo/Unary", incoming)
    with tracing.active(span):
        tracing.note_model("m1", "v1")
        outgoing = tracing.inject((*incoming, ("mm-model-id", "m1")))
    tracing.finish(span, None)
    (done,) = exporter.get_finished_spans()
    assert done.name == "meshd.demo.Echo/Unary" and done.kind is SpanKind.SERVER
    assert done.parent is not None and f"{done.parent.span_id:016x}" == PARENT_ID
    assert f"{done.context.trace_id:032x}" == TRACE_ID
    attrs = done.attributes or {}
    assert attrs["rpc.service"] == "meshd.demo.Echo" and attrs["rpc.method"] == "Unary"
    assert (attrs["meshd.model_id"], attrs["meshd.vmodel_id"], attrs["rpc.grpc.status_code"]) == ("m1", "v1", 0)
    # The caller's trace headers are replaced by meshd's own (same trace, this span the parent).
    keys = [k for k, _ in outgoing]
    assert keys.count("traceparent") == 1 and keys.count("tracestate") == 1
    assert dict(outgoing)["traceparent"] == f"00-{TRACE_ID}-{done.context.span_id:016x}-01"
    assert dict(outgoing)["tracestate"] == "vendor=1"
    assert ("x-user", "u") in outgoing and ("mm-model-id", "m1") in outgoing


def test_a_call_without_trace_context_starts_a_trace() -> None:
    tracing, exporter = in_memory()
    span = tracing.start_server("/inference.GRPCInferenceService/ModelInfer", (("mm-model-id", "m"),))
    tracing.finish(span, None)
    (done,) = exporter.get_finished_spans()
    assert done.parent is None


def test_without_the_otel_extra_tracing_stays_off_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with caplog.at_level(logging.WARNING):
        assert from_env("inst-a") is None
    assert "OpenTelemetry is not installed (meshd[otel])" in caplog.text
