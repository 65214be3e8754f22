"""The internal port's generic handler: inference forwarded by peers, original method and bytes.

Only requests marked by a peer (`meshd-hop`) are taken; the model id is the concrete one
the peer resolved (`mm-model-id-bin`). Refusals carry `meshd-reason` so the peer reroutes;
a stream is accepted (initial metadata `meshd-accepted`) before its messages are read.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from meshd.core.errors import InvalidArgument, MeshError, NotFound
from meshd.decisions.ids import check_id, decode_id
from meshd.decisions.openai import CALL_METHOD
from meshd.observability.tracing import Activate
from meshd.serving.peer_protocol import (
    ACCEPTED,
    HOP,
    LOADS,
    MODE,
    PASSED_ON,
    PRICE_LIMIT,
    REASON,
    UNKNOWN_MODEL,
    UNKNOWN_PEER,
    PeerRefusal,
    read_price_limit,
)
from meshd.serving.proxy.handler import RawMethodHandler, StreamHandler, UnaryHandler, relay_responses
from meshd.serving.proxy.headers import INTERNAL_PREFIX, MODEL_ID, MODEL_ID_BIN, Metadata
from meshd.serving.proxy.methods import MethodSpec

ACCEPTED_METADATA = ((ACCEPTED, "1"),)


def parse_peer_metadata(metadata: Any, is_peer: Callable[[str], bool]) -> tuple[str, str, Metadata, float | None]:
    """(model id, mode, headers for the runtime, price limit) of a forwarded call from a live peer."""
    hop = mode = None
    model_id: str | None = None
    price_limit: float | None = None
    runtime_md: list[tuple[str, str | bytes]] = []
    for key, value in metadata:
        if key == HOP:
            hop = value
        elif key == MODE:
            mode = value
        elif key == PRICE_LIMIT:
            price_limit = read_price_limit(value)
        elif key.startswith(INTERNAL_PREFIX) or key.startswith("grpc-") or key in ("content-type", "user-agent"):
            continue
        else:
            if key == MODEL_ID_BIN:
                model_id = decode_id(value if isinstance(value, bytes) else value.encode())
            elif key == MODEL_ID and model_id is None:
                model_id = check_id(value if isinstance(value, str) else value.decode())
            runtime_md.append((key, value))
    if hop is None or model_id is None or mode not in ("serve", "load"):
        raise InvalidArgument("not a meshd peer call (the internal port serves live peers only)")
    if not is_peer(str(hop)):
        # A well-formed peer call from an instance this one does not see as live (yet): its
        # record may be back in etcd but not in this mirror. Refused, so the sender reroutes,
        # never INVALID_ARGUMENT to its client.
        raise PeerRefusal(UNKNOWN_PEER, f"{hop} is not (yet) a live instance of the mesh here")
    return model_id, mode, tuple(runtime_md), price_limit


async def _refuse(context: Any, e: MeshError, loads: int | None = None) -> None:
    if isinstance(e, PeerRefusal):
        reason = e.reason
    else:
        # Every answer of ours carries a reason, so the peer can tell it from gRPC's
        # own UNAVAILABLE (this instance unreachable) whatever the details say.
        reason = UNKNOWN_MODEL if isinstance(e, NotFound) else PASSED_ON
    trailers: Metadata = ((REASON, reason),) if loads is None else ((REASON, reason), (LOADS, str(loads)))
    await context.abort(e.code, e.message, trailing_metadata=trailers)


class PeerInferenceHandler(RawMethodHandler):
    """Internal port: calls forwarded by peers."""

    def _unary(self, spec: MethodSpec) -> UnaryHandler:
        router = self.router
        tracing = router.tracing

        async def traced(request: bytes, context: Any) -> bytes:
            assert tracing is not None  # the sender's trace context is the parent
            return await tracing.serve_unary(spec.path, context, handle(request, context))

        async def handle(request: bytes, context: Any) -> bytes:
            try:
                model_id, mode, metadata, limit = parse_peer_metadata(context.invocation_metadata(), router.is_peer)
                response = await router.serve_forwarded(
                    spec, request, model_id, mode, metadata, context.time_remaining(), limit
                )
            except MeshError as e:
                await _refuse(context, e, router.local.loads_in_progress)
                raise  # unreachable: abort raises
            context.set_trailing_metadata(((LOADS, str(router.local.loads_in_progress)),))
            return response

        return handle if tracing is None else traced

    def _stream(self, spec: MethodSpec) -> StreamHandler:
        router = self.router
        tracing = router.tracing

        async def traced(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            assert tracing is not None
            async for response in tracing.serve_stream(spec.path, context, lambda on: handle(requests, context, on)):
                yield response

        async def handle(
            requests: AsyncIterator[bytes], context: Any, active: Activate = contextlib.nullcontext
        ) -> AsyncIterator[bytes]:
            try:
                model_id, mode, metadata, limit = parse_peer_metadata(context.invocation_metadata(), router.is_peer)
                with active():
                    stream = await router.open_forwarded_stream(
                        spec, requests, model_id, mode, metadata, context.time_remaining(), limit
                    )
            except MeshError as e:
                await _refuse(context, e)
                return
            # A language model's call: its load goes back (for routing by load), and the engine's
            # reading is kept here whatever the routing, for copy scaling (queues that stay deep).
            llm = spec.path == CALL_METHOD
            try:
                await context.send_initial_metadata(
                    ACCEPTED_METADATA + router.engine_load_here(model_id) if llm else ACCEPTED_METADATA
                )
            except BaseException:
                stream.close()
                raise
            try:
                async for response in relay_responses(stream, context):
                    yield response
                    if llm:  # the runtime sent its engine's load with its first answer
                        llm = False
                        await router.note_runtime_load(model_id, stream)
            except MeshError as e:  # a request message we refused (id injection)
                await _refuse(context, e)

        return handle if tracing is None else traced
