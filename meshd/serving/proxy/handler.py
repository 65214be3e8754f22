"""The generic gRPC handlers that carry any allowed runtime method as raw bytes.

Thin: parse the headers (or extract the id from the body), hand the call to the router,
map MeshError to a status. One handler per method path, made once and cached; unary
methods get a unary handler, streaming ones a stream handler (see `methods`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from meshd.core.errors import DeadlineExceeded, MeshError
from meshd.observability.metrics import NO_METRICS
from meshd.observability.tracing import Activate
from meshd.serving.invocations import Invocations
from meshd.serving.proxy.headers import INTERNAL_PREFIX, Metadata, RequestIds, ids_from_body, parse_request_headers
from meshd.serving.proxy.methods import MAX_CACHED_METHODS, MethodSpec, MethodTable
from meshd.serving.proxy.streams import ResponseStream
from meshd.serving.proxy.wire import extract_id
from meshd.serving.router import Router

UnaryHandler = Callable[[bytes, Any], Awaitable[bytes]]
StreamHandler = Callable[[AsyncIterator[bytes], Any], AsyncIterator[bytes]]


class RawMethodHandler(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A raw-bytes handler per carried method path, made once and cached."""

    def __init__(self, router: Router, methods: MethodTable) -> None:
        self.router = router
        self.methods = methods
        self._handlers: dict[str, Any] = {}
        self._fixed: dict[str, Any] = {}  # handlers kept across a dataplane change
        self._version = methods.version

    def service(self, handler_call_details: Any) -> Any:
        method: str = handler_call_details.method
        if self._version != self.methods.version:  # the dataplane config changed
            self._version = self.methods.version
            self._handlers = dict(self._fixed)
        handler = self._handlers.get(method)
        if handler is None:
            spec = self.methods.spec(method)
            if spec is None:
                return None  # grpc answers UNIMPLEMENTED
            if spec.streaming:
                handler = grpc.stream_stream_rpc_method_handler(self._stream(spec))
            else:
                handler = grpc.unary_unary_rpc_method_handler(self._unary(spec))
            if len(self._handlers) < MAX_CACHED_METHODS:
                self._handlers[method] = handler
        return handler

    def _unary(self, spec: MethodSpec) -> UnaryHandler:
        raise NotImplementedError

    def _stream(self, spec: MethodSpec) -> StreamHandler:
        raise NotImplementedError


async def relay_responses(stream: ResponseStream, context: Any) -> AsyncIterator[bytes]:
    """Yield an open stream's responses; a runtime's or peer's status goes on as it is."""
    try:
        async for response in stream:
            yield response
    except grpc.aio.AioRpcError as e:
        # The status as it is, with its trailers (minus meshd's own between peers).
        trailers = tuple((k, v) for k, v in (e.trailing_metadata() or ()) if not k.startswith(INTERNAL_PREFIX))
        await context.abort(e.code(), e.details() or "", trailing_metadata=trailers)
    finally:
        stream.close()


def _ids(spec: MethodSpec, context: Any, body: bytes | None) -> tuple[RequestIds, Metadata]:
    """The model a request names: the dataplane's extraction path (the body wins), else the
    headers, else (KServe methods) the body's model name."""
    ids, forward = parse_request_headers(context.invocation_metadata(), required=not (spec.extract or spec.fallback))
    if spec.extract:
        body_id = extract_id(body, spec.extract) if body is not None else None
        return ids_from_body(body_id, spec.extract_vmodel, ids), forward
    if ids.model_id is None and ids.vmodel_id is None:
        body_id = extract_id(body, spec.fallback) if body is not None else None
        return ids_from_body(body_id, False, ids), forward
    return ids, forward


class InferenceHandler(RawMethodHandler):
    """External port: client calls, routed by the model they name.

    `default_timeout_s`: applied when the client sets no deadline (None: no limit)."""

    def __init__(
        self,
        router: Router,
        methods: MethodTable,
        default_timeout_s: float | None = None,
        answered: Mapping[str, UnaryHandler] | None = None,
        invocations: Invocations | None = None,
    ) -> None:
        """`answered`: methods meshd answers itself (KServe health for the mesh);
        `invocations`: where each call is recorded (metrics, the invoke log)."""
        super().__init__(router, methods)
        self.default_timeout_s = default_timeout_s
        self.invocations = invocations or Invocations(NO_METRICS, False, router.self_id)
        for path, fn in (answered or {}).items():
            self._fixed[path] = self._handlers[path] = grpc.unary_unary_rpc_method_handler(fn)

    def _deadline(self, context: Any) -> tuple[float | None, bool]:
        """(seconds left, whether meshd itself must enforce them: the client set none)."""
        remaining: float | None = context.time_remaining()
        if remaining is None and self.default_timeout_s is not None:
            return self.default_timeout_s, True
        return remaining, False

    def _timed_out(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"no answer within the default request timeout of {self.default_timeout_s:g} s "
            "(MESHD_REQUEST_TIMEOUT_MS; set a deadline on the call to choose another)"
        )

    def _unary(self, spec: MethodSpec) -> UnaryHandler:
        router = self.router
        calls = self.invocations
        tracing = router.tracing

        async def traced(request: bytes, context: Any) -> bytes:
            assert tracing is not None
            return await tracing.serve_unary(spec.path, context, handle(request, context))

        async def handle(request: bytes, context: Any) -> bytes:
            started = calls.start()
            ids = None
            code = "OK"
            response = b""
            try:
                ids, forward = _ids(spec, context, request)
                remaining, enforce = self._deadline(context)
                if not enforce:
                    response = await router.unary(spec, request, ids, forward, remaining)
                    return response
                try:
                    async with asyncio.timeout(remaining):
                        response = await router.unary(spec, request, ids, forward, remaining)
                        return response
                except TimeoutError:
                    raise self._timed_out() from None
            except MeshError as e:
                code = e.code.name
                await context.abort(e.code, e.message)
                raise  # unreachable: abort raises
            except BaseException as e:
                code = _code_of(e, context)
                raise
            finally:
                calls.done(
                    spec.path,
                    ids,
                    code,
                    started,
                    len(request),
                    len(response) if code == "OK" else -1,
                    request,
                    response,
                    context.invocation_metadata(),
                )

        return handle if tracing is None else traced  # untraced: not even a check per call

    def _stream(self, spec: MethodSpec) -> StreamHandler:
        router = self.router
        calls = self.invocations
        tracing = router.tracing

        async def traced(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            assert tracing is not None  # an async generator itself: grpc.aio tells handlers apart so
            async for response in tracing.serve_stream(spec.path, context, lambda on: handle(requests, context, on)):
                yield response

        async def handle(
            requests: AsyncIterator[bytes],
            context: Any,
            active: Activate = contextlib.nullcontext,
        ) -> AsyncIterator[bytes]:
            started = calls.start()
            ids = None
            code = "OK"
            try:
                remaining, enforce = self._deadline(context)
                # meshd's own timer covers opening only: a timer firing while this generator is
                # suspended at a yield would land in grpc, not here. Once open, the outbound
                # call carries the deadline and its DEADLINE_EXCEEDED is relayed.
                timeout = asyncio.timeout(remaining) if enforce else contextlib.nullcontext()
                loop = asyncio.get_running_loop()
                opened = loop.time()
                try:
                    async with timeout:
                        first = None
                        if spec.extract or spec.fallback:  # the first message may name the model
                            ids, _ = parse_request_headers(context.invocation_metadata(), required=False)
                            if spec.extract or (ids.model_id is None and ids.vmodel_id is None):
                                first = await anext(aiter(requests), None)
                        ids, forward = _ids(spec, context, first)
                        left = None if remaining is None else max(0.001, remaining - (loop.time() - opened))
                        with active():  # the stream's span is the parent of what opening it does
                            stream = await router.open_stream(spec, first, requests, ids, forward, left)
                except TimeoutError:
                    raise self._timed_out() from None
                async for response in relay_responses(stream, context):
                    yield response
            except MeshError as e:
                code = e.code.name
                await context.abort(e.code, e.message)
            except BaseException as e:
                code = _code_of(e, context)
                raise
            finally:
                calls.done(spec.path, ids, code, started, -1, -1)  # sizes: per message, not per call

        return handle if tracing is None else traced


def _code_of(e: BaseException, context: Any = None) -> str:
    """The status name a call ended with when it did not end with a MeshError of ours."""
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining() if context is not None else None
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    if isinstance(e, grpc.aio.AbortError) and context is not None:  # a relayed status
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return "UNKNOWN"
