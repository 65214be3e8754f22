"""KServe V2 health, server metadata and the repository extension over gRPC (a thin transport).

Each handler parses the request, calls KServeCore (api/kserve_core.py, shared with the REST
endpoints) and serializes the answer; core errors become their gRPC status. Unknown models
are "not ready" for ModelReady, as Triton answers, not an error. The other model calls
(ModelMetadata, ModelConfig, ModelInfer) are routed to a copy like any inference call.
Raw-bytes handlers, so they sit in the same generic handler as the proxy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd.api.kserve_core import KServeCore
from meshd.core.errors import MeshError
from meshd.serving.proxy.headers import parse_request_headers

SERVICE = "/inference.GRPCInferenceService/"
RawUnary = Callable[[bytes, Any], Awaitable[bytes]]


class MeshKServe:
    def __init__(self, core: KServeCore) -> None:
        self.core = core
        self.handlers: dict[str, RawUnary] = {
            SERVICE + "ServerLive": self.server_live,
            SERVICE + "ServerReady": self.server_ready,
            SERVICE + "ServerMetadata": self.server_metadata,
            SERVICE + "ModelReady": self.model_ready,
        }
        if core.repository is not None:
            self.handlers[SERVICE + "RepositoryIndex"] = self.repository_index
            self.handlers[SERVICE + "RepositoryModelLoad"] = self.repository_load
            self.handlers[SERVICE + "RepositoryModelUnload"] = self.repository_unload

    async def server_live(self, request: bytes, context: Any) -> bytes:
        return bytes(v2.ServerLiveResponse(live=self.core.live()).SerializeToString())

    async def server_ready(self, request: bytes, context: Any) -> bytes:
        return bytes(v2.ServerReadyResponse(ready=self.core.ready()).SerializeToString())

    async def server_metadata(self, request: bytes, context: Any) -> bytes:
        md = self.core.metadata()
        resp = v2.ServerMetadataResponse(name=md.name, version=md.version, extensions=list(md.extensions))
        return bytes(resp.SerializeToString())

    async def model_ready(self, request: bytes, context: Any) -> bytes:
        req = await _parse(v2.ModelReadyRequest, request, context)
        try:
            ids, _ = parse_request_headers(context.invocation_metadata(), required=False)
            ready = await self.core.model_ready(req.name, ids.model_id or "", ids.vmodel_id or "")
        except MeshError as e:
            await _abort(context, e)
        return bytes(v2.ModelReadyResponse(ready=ready).SerializeToString())

    async def repository_index(self, request: bytes, context: Any) -> bytes:
        req = await _parse(v2.RepositoryIndexRequest, request, context)
        try:
            entries = await self.core.index(ready_only=req.ready)
        except MeshError as e:
            await _abort(context, e)
        resp = v2.RepositoryIndexResponse()
        for entry in entries:
            resp.models.add(name=entry.name, version=entry.version, state=entry.state, reason=entry.reason)
        return bytes(resp.SerializeToString())

    async def repository_load(self, request: bytes, context: Any) -> bytes:
        req = await _parse(v2.RepositoryModelLoadRequest, request, context)
        try:
            await self.core.load(req.model_name)
        except MeshError as e:
            await _abort(context, e)
        return bytes(v2.RepositoryModelLoadResponse().SerializeToString())

    async def repository_unload(self, request: bytes, context: Any) -> bytes:
        req = await _parse(v2.RepositoryModelUnloadRequest, request, context)
        try:
            await self.core.unload(req.model_name)
        except MeshError as e:
            await _abort(context, e)
        return bytes(v2.RepositoryModelUnloadResponse().SerializeToString())


async def _abort(context: Any, e: MeshError) -> NoReturn:
    await context.abort(e.code, e.message)
    raise AssertionError("abort returned") from e


async def _parse(message_type: Any, raw: bytes, context: Any) -> Any:
    try:
        return message_type.FromString(raw)
    except DecodeError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {message_type.DESCRIPTOR.name}: {e}")
        raise AssertionError("abort returned") from e
