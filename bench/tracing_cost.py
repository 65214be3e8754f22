"""CPU meshd's tracing adds to one request, in-process, without gRPC: the spans of a request
served from a local copy (a server span continuing the client's trace, a client span for the
runtime call, the context extracted and injected), sampled and not sampled.

    .venv/bin/python bench/tracing_cost.py [--requests N]

Needs the `otel` extra (in the dev install). Prints microseconds of CPU per request; compare
with meshd's CPU per proxied request from bench/proxy_overhead.py.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from meshd.observability.tracing import Metadata, Tracing

PATH = "/inference.GRPCInferenceService/ModelInfer"
METADATA: Metadata = (
    ("mm-model-id", "m1"),
    ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
)
WARMUP = 1000


class Dropping(SpanExporter):
    """Takes every batch and keeps nothing: the SDK's cost without an exporter's."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


async def runtime_call(request: bytes, metadata: Metadata, timeout: float | None) -> bytes:  # noqa: ASYNC109 - a grpc call's signature
    return request


async def one_request(tracing: Tracing) -> None:
    span = tracing.start_server(PATH, METADATA)
    with tracing.active(span):
        tracing.note_model("m1", None)
        await tracing.call_unary(runtime_call, PATH, b"x", METADATA, None, {"meshd.hop": "runtime"})
    tracing.finish(span, None)


async def cpu_per_request_us(provider: TracerProvider, requests: int) -> float:
    tracing = Tracing(provider)
    for _ in range(WARMUP):
        await one_request(tracing)
    start = time.process_time()
    for _ in range(requests):
        await one_request(tracing)
    used = time.process_time() - start
    provider.shutdown()
    return used / requests * 1e6


async def main(requests: int) -> None:
    sampled = TracerProvider()
    sampled.add_span_processor(BatchSpanProcessor(Dropping()))
    print(f"sampled (batch processor, spans dropped): {await cpu_per_request_us(sampled, requests):6.1f} us/request")
    unsampled = TracerProvider(sampler=ALWAYS_OFF)
    print(f"not sampled:                              {await cpu_per_request_us(unsampled, requests):6.1f} us/request")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="measured requests per case (default 20000)")
    args = parser.parse_args()
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    asyncio.run(main(args.requests))
