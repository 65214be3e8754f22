"""`mmesh.ModelMesh` servicer (SPEC §2): message conversion around `Management`."""

from __future__ import annotations

from typing import Any

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.api.grpc_errors import statuses
from meshd.ids import ModelInfo
from meshd.management import Management
from meshd.status import StatusView


def status_message(view: StatusView) -> Any:
    return mm.ModelStatusInfo(
        status=view.status.name,
        errors=list(view.errors),
        modelCopyInfos=[
            mm.ModelStatusInfo.ModelCopyInfo(location=c.location, copyStatus=c.status.name, time=c.time_ms)
            for c in view.copies
        ],
    )


class ModelMeshServicer(mm_grpc.ModelMeshServicer):  # type: ignore[misc]
    def __init__(self, management: Management) -> None:
        self.m = management

    @statuses
    async def registerModel(self, request: Any, context: Any) -> Any:
        info = request.modelInfo
        view = await self.m.register(
            request.modelId,
            ModelInfo(info.type, info.path, info.key),
            request.loadNow,
            request.sync,
            request.lastUsedTime,
        )
        return status_message(view)

    @statuses
    async def unregisterModel(self, request: Any, context: Any) -> Any:
        await self.m.unregister(request.modelId)
        return mm.UnregisterModelResponse()

    @statuses
    async def getModelStatus(self, request: Any, context: Any) -> Any:
        return status_message(self.m.status(request.modelId))

    @statuses
    async def ensureLoaded(self, request: Any, context: Any) -> Any:
        return status_message(await self.m.ensure_loaded(request.modelId, request.lastUsedTime, request.sync))
