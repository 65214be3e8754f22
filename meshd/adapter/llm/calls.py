"""Inference on the LLM runtime: meshd.llm.OpenAI/Call and KServe text completions, each
handed to the engine of the model meshd names (field 1, written by meshd).

The engine sees its own name for the model, never the client's: meshd has already checked
the name, and engines answer unknown names wrongly (llama.cpp serves whatever it holds).
A call that only asks `where` is told the engine's address: meshd then streams a warm copy's
answer from the engine itself, and this relay serves the rest (peers' calls, fallbacks).
A model this runtime does not hold is NOT_FOUND (meshd confirms and reroutes or reloads);
one whose engine is restarting is UNAVAILABLE at once, saying so. An engine that dies in
the middle of an answer ends the call UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as pb_grpc
from meshd._proto.meshd import llm_pb2, llm_pb2_grpc
from meshd.adapter.llm import textmap
from meshd.adapter.llm.grpc_abort import abort
from meshd.adapter.llm.process import EngineProcess, describe_exit
from meshd.adapter.llm.runtime import Engines, Served, State
from meshd.decisions.placement.llm import LOAD_HEADER, format_load

log = logging.getLogger(__name__)

OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
EXIT_GRACE_S = 0.2
JSON_HEADERS = {"Content-Type": "application/json"}
# An engine that stops answering without exiting must not hold a call forever: it connects at
# once, and a silence this long between two pieces of an answer (prefill included) ends the call.
ENGINE_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)


class EngineGone(Exception):
    """The engine stopped answering (UNAVAILABLE)."""


def _model_id(field: str, context: Any) -> str:
    if field:
        return field
    for key, value in context.invocation_metadata() or ():
        if key == "mm-model-id":
            return str(value)
        if key == "mm-model-id-bin":
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


async def _served(engines: Engines, model_id: str, context: Any) -> Served:
    served = engines.served.get(model_id)
    if served is None:
        await abort(context, grpc.StatusCode.NOT_FOUND, f"model {model_id!r} is not loaded in this runtime")
    if served.owner.state is State.RESTARTING:
        await abort(context, grpc.StatusCode.UNAVAILABLE, served.restarting_message())
    return served


async def _post(engines: Engines, served: Served, path: str, body: dict[str, Any] | bytes) -> aiohttp.ClientResponse:
    """POST JSON to the model's engine; EngineGone when it does not answer."""
    url = served.owner.engine.base_url + path
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        return await engines.http().post(url, data=data, headers=JSON_HEADERS, timeout=ENGINE_TIMEOUT)
    except aiohttp.ClientError as e:
        raise EngineGone(await _gone(served, e)) from None


async def _gone(served: Served, e: BaseException) -> str:
    """Why the engine stopped answering: its exit is seen within moments of the broken
    connection (a thread waits on the process), so wait that long before saying."""
    engine = served.owner.engine
    if engine.child is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(engine.child.wait(), EXIT_GRACE_S)
    if served.owner.state is State.RESTARTING:
        return served.restarting_message()
    if not engine.running:
        return f"the engine of model {served.model_id!r} stopped ({_exit(engine)}); it is restarting"
    return f"the engine of model {served.model_id!r} did not answer: {type(e).__name__}: {e}"


def _exit(engine: EngineProcess) -> str:
    code = engine.child.returncode if engine.child is not None else None
    return "exited" if code is None else describe_exit(code)


class OpenAICalls(llm_pb2_grpc.OpenAIServicer):  # type: ignore[misc]
    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    async def Call(self, request: llm_pb2.HttpCall, context: Any) -> AsyncIterator[llm_pb2.HttpChunk]:
        model_id = _model_id(request.model_id, context)
        if request.where:  # meshd streams from the engine itself (a warm copy beside it)
            served = await _served(self.engines, model_id, context)
            # meshd asks again while its calls go straight to the engine: the engine's load
            # comes with each answer, as with a relayed call's (its queue decides copies).
            watch = served.owner.watch
            watch.refresh(self.engines.http(), served.owner.engine.base_url)
            await context.send_initial_metadata(((LOAD_HEADER, format_load(watch.load())),))
            yield llm_pb2.HttpChunk(engine_url=served.owner.engine.base_url)
            return
        if request.path not in OPENAI_PATHS:
            await abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"not an OpenAI path this runtime serves: {request.path!r}"
            )
        served = await _served(self.engines, model_id, context)
        raw = request.body
        if not (request.body_names_model and request.model_id == model_id):
            try:
                body = json.loads(raw)
            except ValueError as e:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"the body is not JSON: {e}")
            if not isinstance(body, dict):
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the body must be a JSON object")
            body["model"] = model_id  # the engine's name for it (its alias)
            raw = json.dumps(body).encode()
        sent = False
        watch = served.owner.watch  # the engine's load, sent to meshd with the answer
        watch.inflight += 1
        try:
            watch.refresh(self.engines.http(), served.owner.engine.base_url)
            response = await _post(self.engines, served, request.path, raw)
            async with response:
                # The first chunk waits for the first piece of the answer (after the prefill), so
                # an engine failing before it is rerouted by meshd, not reported to the client.
                pieces = response.content.iter_any()  # as they arrive: one SSE event or more
                first = await anext(pieces, b"")
                content_type = response.headers.get("Content-Type", "")
                await context.send_initial_metadata(((LOAD_HEADER, format_load(watch.load())),))
                yield llm_pb2.HttpChunk(status=response.status, content_type=content_type, data=first)
                sent = True
                async for piece in pieces:
                    yield llm_pb2.HttpChunk(data=piece)
        except EngineGone as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        except (aiohttp.ClientError, ConnectionError) as e:
            message = await _gone(served, e)
            log.info("%s: %s (after the first chunk: %s)", model_id, message, sent)
            await abort(context, grpc.StatusCode.UNAVAILABLE, message)
        finally:
            watch.inflight -= 1


class TextInference(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """KServe V2 for the language models here, as Dynamo maps it (textmap)."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    def _platform(self) -> str:
        return f"meshd-llm/{self.engines.config.engine}"

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        served = self.engines.served.get(_model_id(request.name, context))
        return pb.ModelReadyResponse(ready=served is not None and served.owner.state is State.READY)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        served = await _served(self.engines, _model_id(request.name, context), context)
        return textmap.metadata(served.model_id, self._platform())

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        served = await _served(self.engines, _model_id(request.name, context), context)
        return textmap.model_config(served.model_id, self._platform())

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        served = await _served(self.engines, _model_id(request.model_name, context), context)
        try:
            body = textmap.completion_body(request, served.model_id)
        except textmap.BadTextRequest as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"model {served.model_id!r}: {e}")
        body["stream"] = False  # one answer: ModelStreamInfer streams
        try:
            response = await _post(self.engines, served, "/v1/completions", body)
            async with response:
                raw = await response.read()
        except EngineGone as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        except (aiohttp.ClientError, ConnectionError) as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, await _gone(served, e))
        answer = _json(raw)
        if response.status != 200:
            await abort(
                context, _status(response.status), f"the engine answered {response.status}: {_message(answer, raw)}"
            )
        text, finish = textmap.completion_text(answer)
        return textmap.infer_response(request.model_name or served.model_id, request.id, text, finish)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        async for request in requests:
            served = await _served(self.engines, _model_id(request.model_name, context), context)
            name = request.model_name or served.model_id
            try:
                body = textmap.completion_body(request, served.model_id, force_stream=True)
            except textmap.BadTextRequest as e:
                yield pb.ModelStreamInferResponse(error_message=f"model {served.model_id!r}: {e}")
                continue
            try:
                async for piece, finish in self._pieces(served, body):
                    yield pb.ModelStreamInferResponse(
                        infer_response=textmap.infer_response(name, request.id, piece, finish)
                    )
            except EngineGone as e:
                await abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
            except _EngineError as e:
                yield pb.ModelStreamInferResponse(error_message=str(e))

    async def _pieces(self, served: Served, body: dict[str, Any]) -> AsyncIterator[tuple[str, str | None]]:
        try:
            response = await _post(self.engines, served, "/v1/completions", body)
            async with response:
                if response.status != 200:
                    raw = await response.read()
                    raise _EngineError(f"the engine answered {response.status}: {_message(_json(raw), raw)}")
                if not body.get("stream"):
                    yield textmap.completion_text(_json(await response.read()))
                    return
                async for line in response.content:  # SSE: "data: {...}" lines, blank lines between
                    text = line.decode(errors="replace").strip()
                    if not text.startswith("data:"):
                        continue
                    data = text[5:].strip()
                    if data == "[DONE]":
                        return
                    yield textmap.completion_text(_json(data.encode()))
        except (aiohttp.ClientError, ConnectionError) as e:
            raise EngineGone(await _gone(served, e)) from None


class _EngineError(Exception):
    """The engine refused one streamed request (the stream goes on)."""


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _message(answer: dict[str, Any], raw: bytes) -> str:
    error = answer.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    return raw[:300].decode(errors="replace")


def _status(http: int) -> grpc.StatusCode:
    if http in (400, 422):
        return grpc.StatusCode.INVALID_ARGUMENT
    if http == 404:
        return grpc.StatusCode.NOT_FOUND
    if http == 429:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if http == 503:
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL
