"""KServe V2 health and server metadata answered by meshd for the whole mesh.

ServerLive and ServerReady are this instance's (ready: serving and not stopping),
ServerMetadata names meshd, and ModelReady is true when a copy of the model is loaded
anywhere in the mesh (unknown models are "not ready", as Triton answers, not an error). The
other model calls (ModelMetadata, ModelConfig, ModelInfer) are routed to a copy like any
inference call. Raw-bytes handlers, so they sit in the same generic handler as the proxy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]

import meshd
from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd.errors import MeshError
from meshd.status import ModelStatus, StatusView

SERVICE = "/inference.GRPCInferenceService/"
RawUnary = Callable[[bytes, Any], Awaitable[bytes]]


class MeshKServe:
    def __init__(self, status: Callable[[str], StatusView], serving: Callable[[], bool]) -> None:
        """`status`: a model's mesh-wide status (getModelStatus); `serving`: whether this
        instance takes work (false once it starts stopping)."""
        self.status = status
        self.serving = serving
        self.handlers: dict[str, RawUnary] = {
            SERVICE + "ServerLive": self.server_live,
            SERVICE + "ServerReady": self.server_ready,
            SERVICE + "ServerMetadata": self.server_metadata,
            SERVICE + "ModelReady": self.model_ready,
        }

    async def server_live(self, request: bytes, context: Any) -> bytes:
        return bytes(v2.ServerLiveResponse(live=True).SerializeToString())

    async def server_ready(self, request: bytes, context: Any) -> bytes:
        return bytes(v2.ServerReadyResponse(ready=self.serving()).SerializeToString())

    async def server_metadata(self, request: bytes, context: Any) -> bytes:
        resp = v2.ServerMetadataResponse(name="meshd", version=meshd.__version__)
        return bytes(resp.SerializeToString())

    async def model_ready(self, request: bytes, context: Any) -> bytes:
        try:
            req = v2.ModelReadyRequest.FromString(request)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed ModelReadyRequest: {e}")
            raise AssertionError("abort returned") from e
        name = req.name or _header_id(context)
        if not name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ModelReady needs a model name")
        try:
            ready = self.status(name).status == ModelStatus.LOADED
        except MeshError as e:
            await context.abort(e.code, e.message)
            raise AssertionError("abort returned") from e
        return bytes(v2.ModelReadyResponse(ready=ready).SerializeToString())


def _header_id(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "mm-model-id":
            return str(value)
        if key == "mm-model-id-bin":
            return bytes(value).decode("utf-8", "replace")
    return ""
