"""OpenAI-compatible HTTP on meshd's REST port, through the mesh (a thin transport).

    GET  /v1/models              the registered language models and vmodels
    POST /v1/completions         \\
    POST /v1/chat/completions     }  body {"model": <model or vmodel id>, ...}
    POST /v1/embeddings          /

A call is checked here before any engine sees it (decisions.openai: a JSON object, a `model`
that is registered and of a language-model type), then carried as one
`meshd.llm.OpenAI/Call` and routed like any inference: a loaded copy here or on a peer, a
load where placement says, and another copy when one fails before its first answer. The
engine's answer is relayed as it arrives: with `"stream": true`, each Server-Sent Event is
written as soon as it comes, never held back. A copy beside this instance is streamed from
its engine by meshd itself (openai_direct: one Python process on the path, what has queued
written at once); a peer's is relayed by the peer. Errors have OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`); 429 and 503 carry `Retry-After`. A
stream that fails after its first event ends with one `data: {"error": ...}` event.

With metrics on, each answered call is counted in the gen_ai_* histograms (time to first
token, time per output token, tokens: decisions.openai.token_timing): a byte count per piece.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from aiohttp import HttpVersion11, web

from meshd._proto.meshd import llm_pb2
from meshd.api.openai_direct import EngineStreams
from meshd.core.errors import MeshError, ModelLoadError, NotFound
from meshd.core.model_types import is_llm_type
from meshd.decisions.openai import (
    LOAD_FAILED_CODE,
    LOAD_FAILED_STATUS,
    OPENAI_PATHS,
    BadRequest,
    TokenTiming,
    error_body,
    http_status,
    parse_request,
    retry_after,
    stream_events,
    tensor_model_message,
    token_timing,
)
from meshd.decisions.placement.llm import prefix_key
from meshd.serving.proxy.headers import RequestIds, http_timeout_s
from meshd.serving.router import Answered, DirectOpen

log = logging.getLogger(__name__)

SSE_TYPE = "text/event-stream"


@dataclass(frozen=True, slots=True)
class Target:
    """What a request's `model` names: a registered model (directly or as a vmodel's active one)."""

    model_id: str
    vmodel_id: str | None
    model_type: str


Resolve = Callable[[str], Awaitable[Target]]
# (HttpCall, ids, timeout, how to stream a local copy itself, its long prompt prefix's hash:
# decisions.placement.llm.prefix_key)
Route = Callable[[bytes, RequestIds, float | None, DirectOpen | None, str | None], Awaitable[Answered]]
Listing = Callable[[], list[tuple[str, str]]]  # (id, model type) of every registered model and vmodel
NoteTokens = Callable[[str, TokenTiming], None]  # (model id, its figures): Metrics.llm_call
TAIL_BYTES = 4096  # the end of a stream kept for its usage (vLLM's last event; a few hundred bytes)


class OpenAIHttp:
    def __init__(
        self,
        resolve: Resolve,
        route: Route | None,
        listing: Listing,
        timeout_s: float | None,
        note_tokens: NoteTokens | None = None,
        direct: bool = True,
    ) -> None:
        """`route`: carries one serialized HttpCall to a copy (None: the runtime serves no
        OpenAI calls, 501); `timeout_s`: for routing and the first answer; `note_tokens`: where
        an answered call's token figures go (None: metrics off, nothing counted); `direct`: a
        local copy's answer is streamed from its engine (openai_direct), not relayed by the
        runtime."""
        self.note_tokens = note_tokens
        self.resolve = resolve
        self.route = route
        self.listing = listing
        self.timeout_s = timeout_s
        self.engines = EngineStreams() if direct else None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        for path in OPENAI_PATHS:
            app.router.add_post(path, self.call)
        if self.engines is not None:
            app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        if self.engines is not None:
            await self.engines.close()

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {"id": model_id, "object": "model", "created": now, "owned_by": "meshd", "meshd_type": model_type}
            for model_id, model_type in sorted(self.listing())
            if is_llm_type(model_type)
        ]
        return web.json_response({"object": "list", "data": data})

    async def call(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        raw = await request.read()
        try:
            parsed = parse_request(raw)
            target = await self.resolve(parsed.model)
            if not is_llm_type(target.model_type):
                raise BadRequest(tensor_model_message(target.model_id, target.model_type, request.path), "model")
            if self.route is None:
                raise BadRequest("the runtime beside meshd serves no OpenAI calls", code="unsupported", status=501)
        except BadRequest as e:
            return _error(e.status, e.message, e.code, e.param)
        except NotFound:
            return _error(404, f"model {parsed.model!r} does not exist", "model_not_found", "model")
        except MeshError as e:
            return _mesh_error(e)
        try:
            timeout_s = http_timeout_s(request.headers, self.timeout_s)
        except MeshError as e:
            return _mesh_error(e)
        balanced = request.headers.get("mm-balanced", "").lower() == "true"
        ids = RequestIds(target.model_id, None, balanced)
        call = llm_pb2.HttpCall(
            model_id=target.model_id, path=request.path, body=raw, body_names_model=parsed.model == target.model_id
        )
        try:
            direct = self.engines.opener(call) if self.engines is not None else None
            answer = await self.route(call.SerializeToString(), ids, timeout_s, direct, prefix_key(parsed.body))
        except MeshError as e:
            return _mesh_error(e)
        except TimeoutError:
            return _error(504, f"no answer from model {target.model_id!r} within {timeout_s:g} s", "timeout")
        try:
            if self.note_tokens is None:
                return await self._relay(request, answer, parsed.stream)
            return await self._relay_counted(request, answer, parsed.stream, target.model_id, started)
        except ConnectionResetError:  # the client went away (the openai client closes after [DONE])
            return web.Response(status=499)
        finally:
            answer.close()

    async def _relay(
        self, request: web.Request, answer: Answered, streaming: bool, tally: _Tally | None = None
    ) -> web.StreamResponse:
        if answer.first is None:
            return _error(502, "the engine ended the call without an answer", "bad_gateway")
        head = llm_pb2.HttpChunk.FromString(answer.first)
        status = head.status or 200
        response = web.StreamResponse(status=status)
        response.content_type = head.content_type or "application/json"
        if head.content_type.startswith(SSE_TYPE):
            response.headers["Cache-Control"] = "no-cache"
        if answer.splice is not None and request.version >= HttpVersion11:
            response.enable_chunked_encoding()  # _ClientSink frames each read as one chunk
        await response.prepare(request)
        if tally is not None:
            tally.status = status
        if head.data:
            await response.write(head.data)
            if tally is not None:
                tally.piece(head.data)
        try:
            if answer.splice is not None:  # streamed from the engine: each read one write, from its callback
                if head.data:  # else the answer was whole (empty)
                    await answer.splice(_ClientSink(request, response, tally))
            else:
                async for chunk in answer.rest:
                    data = llm_pb2.HttpChunk.FromString(chunk).data
                    if data:
                        await response.write(data)  # as it came: one SSE event at a time
                        if tally is not None:
                            tally.piece(data)
            if tally is not None:
                tally.ended = True  # the answer came whole
        except MeshError as e:
            log.info("OpenAI call %s ended early: %s", request.path, e.message)
            if not await _end_with_error(request, response, e.code, e.message, streaming):
                return response
        except grpc.aio.AioRpcError as e:  # the engine's runtime (or the peer) ended the call
            log.info("OpenAI call %s ended early: %s", request.path, e.details())
            if not await _end_with_error(request, response, e.code(), e.details() or e.code().name, streaming):
                return response
        await response.write_eof()
        return response

    async def _relay_counted(
        self, request: web.Request, answer: Answered, streaming: bool, model_id: str, started: float
    ) -> web.StreamResponse:
        """`_relay`, with the answer's token figures noted once it ended well: the time of its
        first and last pieces, its SSE events and its last bytes (for the engine's usage)."""
        tally = _Tally()
        response = await self._relay(request, answer, streaming, tally)
        if tally.ended and tally.status == 200 and self.note_tokens is not None:
            path = request.path
            timing = token_timing(path, streaming, started, tally.first, tally.last, tally.events, tally.tail)
            self.note_tokens(model_id, timing)
        return response


class _ClientSink:
    """The client's side of a spliced answer (Answered.splice): each read from the engine
    written as one chunk, from the engine socket's callback, past aiohttp's writer (which has
    sent the head and the first piece, and sends the end)."""

    __slots__ = ("chunked", "tally", "transport")

    def __init__(self, request: web.Request, response: web.StreamResponse, tally: _Tally | None) -> None:
        self.transport = request.transport
        self.chunked = response.chunked
        self.tally = tally

    def write(self, segments: list[bytes]) -> bool:
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        data = segments[0] if len(segments) == 1 else b"".join(segments)
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        if self.tally is not None:
            self.tally.piece(data)
        return True

    def backlog(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport is not None else 0


class _Tally:
    """What `_relay` saw of an answer, for its token figures."""

    __slots__ = ("ended", "events", "first", "last", "status", "tail")

    def __init__(self) -> None:
        self.status = 0
        self.first: float | None = None  # perf_counter() of the first piece with data
        self.last: float | None = None
        self.events = 0
        self.tail = b""
        self.ended = False  # relayed to its end, no error

    def piece(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.events += stream_events(data)
        self.tail = data if len(data) >= TAIL_BYTES else (self.tail + data)[-TAIL_BYTES:]


async def _end_with_error(
    request: web.Request, response: web.StreamResponse, code: grpc.StatusCode, message: str, streaming: bool
) -> bool:
    """Tell a client whose answer already started that it will not finish: a stream gets one
    error event (True: finish the response); a JSON body cannot be mended, so its connection
    is cut (False), and the client sees an incomplete body, never a wrong one."""
    if not streaming:
        if request.transport is not None:
            request.transport.abort()
        return False
    body = error_body(http_status(code.name), f"the answer ended early: {message}", "stream_interrupted")
    await response.write(f"data: {json.dumps(body)}\n\n".encode())
    return True


def _mesh_error(e: MeshError) -> web.Response:
    if isinstance(e, ModelLoadError):
        return _error(LOAD_FAILED_STATUS, e.message, LOAD_FAILED_CODE)
    status = http_status(e.code.name)
    code = {404: "model_not_found", 429: "rate_limited", 503: "unavailable"}.get(status, e.code.name.lower())
    return _error(status, e.message, code)


def _error(status: int, message: str, code: str | None, param: str | None = None) -> web.Response:
    response = web.json_response(error_body(status, message, code, param), status=status)
    after = retry_after(status)
    if after is not None:
        response.headers["Retry-After"] = str(after)
    return response
