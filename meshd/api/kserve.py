"""KServe V2 health, server metadata and the model-repository extension, for the whole mesh.

ServerLive and ServerReady are this instance's (ready: serving and not stopping),
ServerMetadata names meshd, and ModelReady is true when a copy of the model is loaded
anywhere in the mesh (unknown models are "not ready", as Triton answers, not an error). The
other model calls (ModelMetadata, ModelConfig, ModelInfer) are routed to a copy like any
inference call. Raw-bytes handlers, so they sit in the same generic handler as the proxy.

Repository extension (SPEC §4): RepositoryIndex lists every registered model with its
mesh-wide state (READY, LOADING, UNAVAILABLE with the reason); RepositoryModelLoad loads a
registered model (here, like ensureLoaded) and answers once it is loaded; RepositoryModelUnload
unloads every copy, the model staying registered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError  # type: ignore[import-untyped, unused-ignore]

import meshd
from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd.errors import InvalidArgument, MeshError, NotFound
from meshd.proxy.headers import parse_request_headers
from meshd.status import ModelStatus, StatusView

SERVICE = "/inference.GRPCInferenceService/"
RawUnary = Callable[[bytes, Any], Awaitable[bytes]]


INDEX_STATES = {
    ModelStatus.LOADED: "READY",
    ModelStatus.LOADING: "LOADING",
    ModelStatus.NOT_LOADED: "UNAVAILABLE",
    ModelStatus.LOADING_FAILED: "UNAVAILABLE",
}


class Repository(Protocol):
    """What the repository extension needs of the mesh."""

    def model_ids(self) -> list[str]: ...

    async def load(self, model_id: str) -> StatusView: ...

    async def unload(self, model_id: str) -> None: ...


class MeshKServe:
    def __init__(
        self,
        status: Callable[[str], StatusView],
        serving: Callable[[], bool],
        repository: Repository | None = None,
        resolve_vmodel: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        """`status`: a model's mesh-wide status (getModelStatus); `serving`: whether this
        instance takes work (false once it starts stopping); `resolve_vmodel`: a vmodel's
        active model."""
        self.status = status
        self.resolve_vmodel = resolve_vmodel
        self.serving = serving
        self.repository = repository
        self.handlers: dict[str, RawUnary] = {
            SERVICE + "ServerLive": self.server_live,
            SERVICE + "ServerReady": self.server_ready,
            SERVICE + "ServerMetadata": self.server_metadata,
            SERVICE + "ModelReady": self.model_ready,
        }
        if repository is not None:
            self.handlers[SERVICE + "RepositoryIndex"] = self.repository_index
            self.handlers[SERVICE + "RepositoryModelLoad"] = self.repository_load
            self.handlers[SERVICE + "RepositoryModelUnload"] = self.repository_unload

    async def server_live(self, request: bytes, context: Any) -> bytes:
        return bytes(v2.ServerLiveResponse(live=True).SerializeToString())

    async def server_ready(self, request: bytes, context: Any) -> bytes:
        return bytes(v2.ServerReadyResponse(ready=self.serving()).SerializeToString())

    async def server_metadata(self, request: bytes, context: Any) -> bytes:
        extensions = ["model_repository"] if self.repository is not None else []
        resp = v2.ServerMetadataResponse(name="meshd", version=meshd.__version__, extensions=extensions)
        return bytes(resp.SerializeToString())

    async def model_ready(self, request: bytes, context: Any) -> bytes:
        req = await _parse(v2.ModelReadyRequest, request, context)
        try:
            # As for routing: a model header wins, then a vmodel header, then the body's name
            # (a model, or else a vmodel of that name).
            ids, _ = parse_request_headers(context.invocation_metadata(), required=False)
            name = ids.model_id or (await self._active(ids.vmodel_id) if ids.vmodel_id else req.name)
            if not name:
                raise InvalidArgument("ModelReady needs a model name (body or mm-model-id header)")
            view = self.status(name)
            if view.status == ModelStatus.NOT_FOUND and not ids.model_id and not ids.vmodel_id:
                with contextlib.suppress(NotFound):
                    view = self.status(await self._active(name))
            ready = view.status == ModelStatus.LOADED
        except MeshError as e:
            await context.abort(e.code, e.message)
            raise AssertionError("abort returned") from e
        return bytes(v2.ModelReadyResponse(ready=ready).SerializeToString())

    async def _active(self, vmodel_id: str) -> str:
        if self.resolve_vmodel is None:
            raise NotFound(f"vmodel {vmodel_id!r} not found")
        return await self.resolve_vmodel(vmodel_id)

    async def repository_index(self, request: bytes, context: Any) -> bytes:
        req = await _parse(v2.RepositoryIndexRequest, request, context)
        assert self.repository is not None
        resp = v2.RepositoryIndexResponse()
        for model_id in sorted(self.repository.model_ids()):
            try:
                view = self.status(model_id)
            except MeshError as e:  # a corrupt record: listed, with the reason
                resp.models.add(name=model_id, state="UNAVAILABLE", reason=e.message)
                continue
            if view.status == ModelStatus.NOT_FOUND:
                continue  # unregistered meanwhile
            state = INDEX_STATES.get(view.status, "UNAVAILABLE")
            if req.ready and state != "READY":
                continue
            reason = "; ".join(view.errors) or ("" if state != "UNAVAILABLE" else "not loaded")
            resp.models.add(name=model_id, version="", state=state, reason=reason)
        return bytes(resp.SerializeToString())

    async def repository_load(self, request: bytes, context: Any) -> bytes:
        req = await _parse(v2.RepositoryModelLoadRequest, request, context)
        assert self.repository is not None
        try:
            view = await self.repository.load(_name(req.model_name))
        except MeshError as e:
            await context.abort(e.code, e.message)
            raise AssertionError("abort returned") from e
        if view.status != ModelStatus.LOADED:
            reason = "; ".join(view.errors) or view.status.name
            await context.abort(grpc.StatusCode.INTERNAL, f"failed to load {req.model_name!r}: {reason}")
        return bytes(v2.RepositoryModelLoadResponse().SerializeToString())

    async def repository_unload(self, request: bytes, context: Any) -> bytes:
        req = await _parse(v2.RepositoryModelUnloadRequest, request, context)
        assert self.repository is not None
        try:
            await self.repository.unload(_name(req.model_name))
        except MeshError as e:
            await context.abort(e.code, e.message)
            raise AssertionError("abort returned") from e
        return bytes(v2.RepositoryModelUnloadResponse().SerializeToString())


async def _parse(message_type: Any, raw: bytes, context: Any) -> Any:
    try:
        return message_type.FromString(raw)
    except DecodeError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {message_type.DESCRIPTOR.name}: {e}")
        raise AssertionError("abort returned") from e


def _name(model_name: str) -> str:
    if not model_name:
        raise InvalidArgument("model_name is empty")
    return model_name
