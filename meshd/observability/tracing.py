"""OpenTelemetry traces: set-up from the standard `OTEL_*` variables, and the few helpers the
request path calls.

Off by default: unless `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`) and
`OTEL_SDK_DISABLED` is not true, there is no `Tracing` object and the request path checks
`tracing is None` and does nothing else; the client's `traceparent`/`tracestate` then go to
peers and the runtime like any other header. On, each instance has its own TracerProvider
(resource from `OTEL_SERVICE_NAME`/`OTEL_RESOURCE_ATTRIBUTES`, sampler from
`OTEL_TRACES_SAMPLER[_ARG]`, exporter endpoint etc. from `OTEL_EXPORTER_OTLP_*`, all read by
the SDK), the incoming W3C trace context is the parent of the server span, and meshd's own
context replaces it in the metadata sent to peers and the runtime.

The SDK and the OTLP exporter are the optional extra `meshd[otel]`; this module imports
them only when tracing is on, so meshd runs without them.

Spans (names follow OpenTelemetry's RPC conventions, `<package.Service>/<Method>`):
a SERVER span per call received (external or from a peer; a stream's span lasts its life),
`meshd.queue` while waiting on a copy's concurrency gate, `meshd.load` while waiting for a
load on a cache miss, and a CLIENT span per unary call to a peer (`meshd.hop=peer`) or to
the runtime (`meshd.hop=runtime`).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from meshd.core.errors import MeshError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})
KNOWN_EXPORTERS = ("otlp", "console", "none")
DEFAULT_OTLP_PROTOCOL = "grpc"  # as OpenTelemetry's Python distro (the spec's default is http/protobuf)
DEFAULT_SERVICE_NAME = "meshd"
MAX_CACHED_NAMES = 1024  # span names per method path; more (allowAnyMethod) are computed per call
# The batch processor's variables, its argument for each, and the spec's default: the SDK
# logs a traceback for a value that is not a number, so meshd checks them first.
BATCH_SETTINGS = (
    ("OTEL_BSP_SCHEDULE_DELAY", "schedule_delay_millis", 5000),
    ("OTEL_BSP_EXPORT_TIMEOUT", "export_timeout_millis", 30000),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "max_queue_size", 2048),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "max_export_batch_size", 512),
)
# Server spans are errors for these codes only (OpenTelemetry's RPC conventions); the
# others are the caller's mistake. Client spans: any non-OK code.
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

Metadata = tuple[tuple[str, str | bytes], ...]
Activate = Callable[[], AbstractContextManager[None]]  # makes a call's span current inside


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """What the `OTEL_*` variables ask for (pure; the SDK reads the rest itself)."""

    exporters: tuple[str, ...]  # "otlp" and/or "console"; empty: tracing off
    otlp_protocol: str = DEFAULT_OTLP_PROTOCOL
    batch: Mapping[str, int] = field(default_factory=dict)  # BatchSpanProcessor arguments for bad OTEL_BSP_*
    problems: tuple[str, ...] = ()  # values ignored, one line each, for the log

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def trace_settings(env: Mapping[str, str]) -> TraceSettings:
    """Read `OTEL_SDK_DISABLED`, `OTEL_TRACES_EXPORTER` and the OTLP protocol. Never raises:
    an unknown value is reported and ignored, so a typo cannot stop an instance."""
    problems: list[str] = []
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TraceSettings(())
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    exporters: list[str] = []
    for name in names:
        if name not in KNOWN_EXPORTERS:
            problems.append(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} ignored (known: otlp, console, none)")
        elif name != "none" and name not in exporters:
            exporters.append(name)
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip().lower() or DEFAULT_OTLP_PROTOCOL
    if protocol not in ("grpc", "http/protobuf"):
        problems.append(f"OTEL_EXPORTER_OTLP_PROTOCOL: unknown protocol {protocol!r}, using grpc")
        protocol = DEFAULT_OTLP_PROTOCOL
    batch: dict[str, int] = {}
    for var, arg, default in BATCH_SETTINGS:
        text = env.get(var, "").strip()
        if text and not (text.isdigit() and int(text) > 0):
            problems.append(f"{var}: {text!r} is not a positive integer, using {default}")
            batch[arg] = default
    return TraceSettings(tuple(exporters), protocol, batch, tuple(problems))


def from_env(instance_id: str) -> Tracing | None:
    """Tracing as the process environment asks for it, or None (off). Never raises: whatever
    goes wrong (a bad value, the extra not installed) is one warning and tracing stays off.
    (The SDK reads the variables from os.environ, so this does too.)"""
    settings = trace_settings(os.environ)
    for problem in settings.problems:
        log.warning("tracing: %s", problem)
    if not settings.enabled:
        return None
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("tracing off: OTEL_TRACES_EXPORTER is set but OpenTelemetry is not installed (meshd[otel])")
        return None
    try:
        provider = TracerProvider(resource=_resource(instance_id))
        for name in settings.exporters:
            b = settings.batch  # None: the SDK reads the variable
            processor = BatchSpanProcessor(
                _exporter(name, settings.otlp_protocol),
                max_queue_size=b.get("max_queue_size"),
                schedule_delay_millis=b.get("schedule_delay_millis"),
                max_export_batch_size=b.get("max_export_batch_size"),
                export_timeout_millis=b.get("export_timeout_millis"),
            )
            provider.add_span_processor(processor)
    except Exception as e:  # a bad OTEL_* value the SDK rejects: log it, serve untraced
        log.warning("tracing off: cannot set up OpenTelemetry: %s", e)
        return None
    log.info("tracing on: exporters %s", ", ".join(settings.exporters))
    return Tracing(provider)


def _resource(instance_id: str) -> Any:
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES...), named `meshd` and
    for this instance where those variables do not say otherwise."""
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, OTELResourceDetector, Resource

    told = OTELResourceDetector().detect().attributes
    ours = {SERVICE_NAME: DEFAULT_SERVICE_NAME, SERVICE_INSTANCE_ID: instance_id}
    return Resource.create({k: v for k, v in ours.items() if k not in told})  # these win over the SDK's defaults


def _exporter(name: str, protocol: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if protocol == "http/protobuf":  # not in meshd[otel]: it needs `requests` too
        try:
            http = importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
        except ImportError:
            raise RuntimeError(
                "OTLP over http/protobuf needs opentelemetry-exporter-otlp-proto-http installed (or use grpc)"
            ) from None
        exporter: SpanExporter = http.OTLPSpanExporter()
        return exporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _rpc_names(path: str) -> tuple[str, str, str]:
    """(span name, rpc.service, rpc.method) of a method path `/pkg.Service/Method`."""
    name = path.lstrip("/")
    service, _, method = name.rpartition("/")
    return name, service, method


def _code_of(e: BaseException) -> grpc.StatusCode:
    if isinstance(e, MeshError):
        return e.code
    if isinstance(e, grpc.aio.AioRpcError):
        code: grpc.StatusCode = e.code()
        return code
    # Not an Exception: CancelledError and the like, the call went away.
    return grpc.StatusCode.UNKNOWN if isinstance(e, Exception) else grpc.StatusCode.CANCELLED


class Tracing:
    """One instance's tracer and the W3C trace context propagator (exists only when on)."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from meshd import __version__

        self.provider = provider
        self.tracer = provider.get_tracer("meshd", __version__)
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._names: dict[str, tuple[str, str, str]] = {}

    def _names_of(self, path: str) -> tuple[str, str, str]:
        names = self._names.get(path)
        if names is None:
            names = _rpc_names(path)
            if len(self._names) < MAX_CACHED_NAMES:  # clients choose paths: keep the cache bounded
                self._names[path] = names
        return names

    # ---- server side -------------------------------------------------------------------
    def start_server(self, path: str, metadata: Iterable[tuple[str, str | bytes]], **attributes: str) -> Span:
        """The SERVER span of a received call, child of the caller's W3C trace context."""
        carrier = {k: v for k, v in metadata if k in TRACE_HEADERS and isinstance(v, str)}
        parent = self._propagator.extract(carrier) if carrier else None
        name, service, method = self._names_of(path)
        attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, **attributes}
        return self.tracer.start_span(name, context=parent, kind=self._trace.SpanKind.SERVER, attributes=attrs)

    @contextmanager
    def active(self, span: Span) -> Iterator[None]:
        """`span` is the parent of spans started (and the context injected) inside."""
        with self._trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield

    def finish(self, span: Span, code: grpc.StatusCode | None, server: bool = True, details: str = "") -> None:
        """End a call's span with its gRPC status (None: OK)."""
        code = code or grpc.StatusCode.OK
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK and (not server or code in SERVER_ERROR_CODES):
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
        span.end()

    async def serve_unary(self, path: str, context: Any, serve: Awaitable[bytes], **attributes: str) -> bytes:
        """Run a received unary call (`serve`, which aborts on failure) inside its SERVER span."""
        span = self.start_server(path, context.invocation_metadata(), **attributes)
        code: grpc.StatusCode | None = None
        try:
            with self.active(span):
                return await serve
        except BaseException as e:
            code = _aborted_code(context) or _code_of(e)
            raise
        finally:
            self.finish(span, code)

    async def serve_stream(
        self, path: str, context: Any, serve: Callable[[Activate], AsyncIterator[bytes]], **attributes: str
    ) -> AsyncIterator[bytes]:
        """Relay a received stream inside one SERVER span for its life. `serve` gets a context
        manager factory to make the span current around what it awaits between messages (never
        across a yield: the context would leak into whoever resumes the generator)."""
        span = self.start_server(path, context.invocation_metadata(), **attributes)
        code: grpc.StatusCode | None = None
        try:
            async for response in serve(lambda: self.active(span)):
                yield response
        except BaseException as e:
            code = _aborted_code(context) or _code_of(e)
            raise
        finally:
            self.finish(span, code)

    def note_model(self, model_id: str, vmodel_id: str | None) -> None:
        """The model (and vmodel) the current call is for, on its span."""
        span = self._trace.get_current_span()
        span.set_attribute("meshd.model_id", model_id)
        if vmodel_id is not None:
            span.set_attribute("meshd.vmodel_id", vmodel_id)

    # ---- inside a call -----------------------------------------------------------------
    @contextmanager
    def span(self, name: str, attributes: Mapping[str, str]) -> Iterator[None]:
        """An INTERNAL child span of the current one (queueing, loading)."""
        with self.tracer.start_as_current_span(name, attributes=attributes, record_exception=False):
            yield

    def inject(self, metadata: Metadata) -> Metadata:
        """`metadata` with the current trace context instead of any the caller sent."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        kept = tuple(kv for kv in metadata if kv[0] not in TRACE_HEADERS)
        return kept + tuple(carrier.items())

    async def call_unary(
        self,
        call: Callable[..., Awaitable[bytes]],
        path: str,
        request: bytes,
        metadata: Metadata,
        remaining_s: float | None,
        attributes: Mapping[str, str],
    ) -> bytes:
        """One outgoing unary call (to a peer or the runtime) in a CLIENT span, its context injected."""
        name, service, method = self._names_of(path)
        attrs = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, **attributes}
        span = self.tracer.start_span(name, kind=self._trace.SpanKind.CLIENT, attributes=attrs)
        code: grpc.StatusCode | None = None
        details = ""
        try:
            with self.active(span):
                md = self.inject(metadata)
            return await call(request, metadata=md, timeout=remaining_s)
        except BaseException as e:
            code = _code_of(e)
            details = e.details() or "" if isinstance(e, grpc.aio.AioRpcError) else ""
            raise
        finally:
            self.finish(span, code, server=False, details=details)

    async def shutdown(self) -> None:
        """Flush and stop the exporters (a blocking call, so in a thread)."""
        import asyncio

        await asyncio.to_thread(self.provider.shutdown)


def _aborted_code(context: Any) -> grpc.StatusCode | None:
    """The status a handler aborted with (grpc.aio keeps it on the context)."""
    try:
        code = context.code()
    except Exception:
        return None
    return code if isinstance(code, grpc.StatusCode) else None
